"""Accelerate and transformers: the hook, the Trainer, its arguments and its callbacks, the resume rule, DeepSpeed, TensorBoard, TRL, and the upstream internals we touch (compat)."""
