"""The recipes, installed with the package (they need the `recipes` extra):

    accelerate launch -m hf_lossscale.recipes.language_modeling --do_train ... --fp16
    accelerate launch -m hf_lossscale.recipes.text_classification --do_train ... --fp16

`recipes/` in the repository holds the same scripts as files to run, read and copy, with the launch
configs (`recipes/configs/*.yaml`).
"""
