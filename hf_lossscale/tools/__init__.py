"""The `hf-lossscale` command line: compare, verdicts, reports, the demo, and the commands around `fp16/` (advise, underflow, preflight, precision)."""
