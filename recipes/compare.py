"""Run a recipe under FP32, FP16 + dynamic scaling, FP16 + a static scale and FP16 without scaling,
and write summary.md, metrics.json and plots. A thin entry point to `hf-lossscale compare`:

    python recipes/compare.py recipes/language_modeling.py --seeds 0 1 --max_steps 40 \
        --output_dir runs/compare -- --model_name_or_path gpt2 --objective clm ...
"""

import sys

from hf_lossscale.tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["compare", *sys.argv[1:]]))
