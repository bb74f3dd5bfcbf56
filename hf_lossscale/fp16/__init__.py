"""What FP16 does to a model: emulation, the FP32 fallback for overflowing modules, the underflow map, advice, the preflight check and the precision gap. torch, and transformers to load models."""
