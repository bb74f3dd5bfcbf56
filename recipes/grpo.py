"""GRPO in FP16 with TRL: dynamic loss scaling, a skipped step that advances nothing, and the
sampler/trainer mismatch logged every step. See `hf_lossscale/recipes/grpo.py` for the flags.

    accelerate launch --config_file recipes/configs/cpu.yaml recipes/grpo.py --do_train \
        --output_dir runs/grpo-fp16 --fp16 --max_steps 40 --report_to none

The code lives in the package, `hf_lossscale/recipes/grpo.py`; this file runs it, and so does
`accelerate launch -m hf_lossscale.recipes.grpo` after `pip install 'hf_lossscale[trl]'`.
"""

from hf_lossscale.recipes.grpo import main

if __name__ == "__main__":
    main()
