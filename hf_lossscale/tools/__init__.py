"""The `hf-lossscale` command line: compare, verdicts, reports, the demo."""
