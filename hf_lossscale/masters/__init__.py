"""FP32 master weights for models held in FP16: the optimizer's side of loss scaling.

`weights` (the scaler's view: `MasterWeights`, `masters_of`), `optimizer` (one optimizer's masters),
`pair` (an FP16 parameter, its master and its gradient's stand-ins), `hooks` (what they hang on the
optimizer and the parameters), `step` (the chunked Adam/AdamW/SGD update, Kahan and stochastic
rounding), `kernel` (the one-pass Triton step on CUDA), `optimizer_wrappers` (the torch optimizer
inside its wrappers). Imports only torch; nothing here is imported by `import hf_lossscale.masters`.
"""
