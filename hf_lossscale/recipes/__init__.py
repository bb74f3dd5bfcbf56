"""The recipes, installed with the package (they need the `recipes` extra):

    accelerate launch --config_file "$(hf-lossscale path cpu.yaml)" -m hf_lossscale.recipes.language_modeling ...
    accelerate launch --config_file "$(hf-lossscale path cpu.yaml)" -m hf_lossscale.recipes.text_classification ...

The `accelerate` launch configs (`configs/*.yaml`) and a small offline sample (`sample/`) are package
data here; `hf-lossscale path` prints where they are installed. `recipes/` in the repository holds
the same scripts as files to run, read and copy, and `recipes/configs` links to `configs/` here.
"""
