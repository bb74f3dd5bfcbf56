"""Accelerate and transformers: the hook, the Trainer and its callbacks, TensorBoard, TRL, and the upstream internals we touch (compat)."""
