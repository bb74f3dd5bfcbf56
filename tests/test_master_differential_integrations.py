"""The differential test of FP32 master weights (issue 45) driven through Accelerate and the Trainer:
generated runs (micro-batches whose loss or gradients are finite, inf or NaN; accumulation; clipping;
optimizers; a save and a resume into fresh objects) of a model held in FP16 against the same model with
FP32 weights computing in FP16 (tests/master_twin.py), compared after every optimizer step: weights,
masters, optimizer state and scaler statistics. Seeded; `HF_LOSSSCALE_DIFF_EXAMPLES` runs more."""

from __future__ import annotations

import os
import warnings

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from master_twin import CONFIG, KINDS, Module, batch, initial_values

EXAMPLES = max(4, int(os.environ.get("HF_LOSSSCALE_DIFF_EXAMPLES", "60")) // 8)
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
KIND_INDEX = {k: i for i, k in enumerate(KINDS)}
kinds = st.sampled_from(("finite",) * 6 + KINDS[1:])


def _inner(opt):
    return getattr(opt, "optimizer", opt)


def _snapshot(model, opt, scaler) -> dict:
    inner = _inner(opt)
    params = [p for g in inner.param_groups for p in g["params"]]
    state = [
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inner.state.get(p, {}).items()}
        for p in params
    ]
    return {
        "weights16": {n: p.detach().half().clone() for n, p in model.named_parameters()},
        "fp32": [p.detach().float().clone() for p in params if p.dtype == torch.float32],
        "state": state,
        "stats": scaler.stats(),
    }


def _compare(a: dict, b: dict, where: str) -> None:
    for n in a["weights16"]:
        assert torch.equal(a["weights16"][n], b["weights16"][n]), f"{where}: FP16 weight {n}"
    assert len(a["fp32"]) == len(b["fp32"]), where
    for k, (x, y) in enumerate(zip(a["fp32"], b["fp32"], strict=True)):
        assert torch.equal(x, y), f"{where}: master {k} vs the reference's FP32 weight"
    for k, (x, y) in enumerate(zip(a["state"], b["state"], strict=True)):
        assert sorted(x) == sorted(y), f"{where}: state keys of tensor {k}: {sorted(x)} vs {sorted(y)}"
        for key in x:
            same = torch.equal(x[key], y[key]) if isinstance(x[key], torch.Tensor) else x[key] == y[key]
            assert same, f"{where}: state {key} of tensor {k}"
    assert a["stats"] == b["stats"], f"{where}: {a['stats']} vs {b['stats']}"


def _compare_runs(sub: list[dict], ref: list[dict], label: str) -> None:
    assert len(sub) == len(ref) > 0
    for k, (a, b) in enumerate(zip(sub, ref, strict=True)):
        _compare(a, b, f"{label}, snapshot {k}")


def _as_inputs(b: dict) -> dict:
    return {
        "x": b["x"].float(),
        "t1": b["t1"].float(),
        "t2": b["t2"].float(),
        "kind": torch.tensor([KIND_INDEX[b["kind"]]] * 2),
    }


# ---------------------------------------------------------------------- Accelerate
accelerate_runs = st.fixed_dictionaries({
    "ga": st.sampled_from((1, 2)),
    "clip": st.sampled_from((None, 0.5, 1e3)),
    "opt": st.sampled_from(("adamw", "sgd")),
    "kinds": st.lists(kinds, min_size=2, max_size=8),
    "save_at": st.sampled_from((None, 1, 2)),
})  # fmt: skip


def _accelerate_run(run: dict, dtype: torch.dtype, folder: str) -> list[dict]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from hf_lossscale import LossScaleConfig, install_loss_scaler

    def fresh(values):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()
        accelerator = Accelerator(mixed_precision="fp16", gradient_accumulation_steps=run["ga"], cpu=True)
        scaler = install_loss_scaler(accelerator, LossScaleConfig(**CONFIG))
        model = Module(values, dtype)
        params = list(model.parameters())
        if run["opt"] == "sgd":
            opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
        else:
            opt = torch.optim.AdamW(params, lr=0.05)
        model, opt = accelerator.prepare(model, opt)
        return accelerator, scaler, model, opt

    accelerator, scaler, model, opt = fresh(initial_values())
    snaps = []
    step = 0
    for i, kind in enumerate(run["kinds"]):
        with accelerator.accumulate(model):
            out = model(**_as_inputs(batch(i + 1, kind)))
            accelerator.backward(out["loss"])
            if accelerator.sync_gradients and run["clip"] is not None:
                accelerator.clip_grad_norm_(model.parameters(), run["clip"])
            opt.step()
            opt.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            snaps.append(_snapshot(accelerator.unwrap_model(model), opt, scaler))
            if run["save_at"] == step:
                accelerator.save_state(folder)
                values = {n: p.detach() for n, p in accelerator.unwrap_model(model).named_parameters()}
                accelerator, scaler, model, opt = fresh({n: torch.zeros_like(v) for n, v in values.items()})
                accelerator.load_state(folder)
                snaps.append(_snapshot(accelerator.unwrap_model(model), opt, scaler))
    return snaps


@SETTINGS
@given(accelerate_runs)
def test_accelerate_runs_train_an_fp16_model_on_masters_as_the_fp32_reference(tmp_path, run):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sub = _accelerate_run(run, torch.float16, str(tmp_path / "sub"))
        ref = _accelerate_run(run, torch.float32, str(tmp_path / "ref"))
    _compare_runs(sub, ref, f"Accelerate {run}")


# ---------------------------------------------------------------------- the Trainer
class _Rows(torch.utils.data.Dataset):
    def __init__(self, kinds: list[str]):
        self.items = []
        for i, kind in enumerate(kinds):
            b = _as_inputs(batch(i + 1, kind))
            for r in range(2):  # two rows per micro-batch: the Trainer's batches are these micro-batches
                self.items.append({k: v[r] for k, v in b.items()})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


trainer_runs = st.fixed_dictionaries({
    "ga": st.sampled_from((1, 2)),
    "max_grad_norm": st.sampled_from((0.0, 0.5, 1e3)),
    "optim": st.sampled_from(("adamw_torch", "adamw_torch_fused", "sgd")),
    "kinds": st.lists(kinds, min_size=4, max_size=8),
    "resume": st.booleans(),
})  # fmt: skip


def _trainer_run(run: dict, dtype: torch.dtype, folder: str) -> list[dict]:
    from transformers import TrainerCallback

    from hf_lossscale import LossScaleTrainer, LossScaleTrainingArguments

    snaps: list[dict] = []
    steps = len(run["kinds"]) // run["ga"]

    class Snap(TrainerCallback):
        def __init__(self, trainer_ref):
            self.trainer_ref = trainer_ref

        def on_step_end(self, args, state, control, **kw):
            t = self.trainer_ref[0]
            snaps.append(_snapshot(t.model, t.optimizer, t.loss_scaler))

    def make(max_steps, values, save):
        args = LossScaleTrainingArguments(
            folder, fp16=True, max_steps=max_steps, per_device_train_batch_size=2,
            gradient_accumulation_steps=run["ga"], max_grad_norm=run["max_grad_norm"], optim=run["optim"],
            learning_rate=0.05, lr_scheduler_type="constant", report_to=[], disable_tqdm=True, logging_steps=1,
            seed=0, data_seed=0, save_strategy="steps" if save else "no", save_steps=1,
            loss_scale_init=CONFIG["init_scale"], loss_scale_max=CONFIG["max_scale"],
            loss_scale_min=CONFIG["min_scale"], loss_scale_growth_interval=CONFIG["growth_interval"],
            loss_scale_backoff_factor=CONFIG["backoff_factor"], dataloader_drop_last=True,
        )  # fmt: skip
        holder = []
        trainer = LossScaleTrainer(model=Module(values, dtype), args=args, train_dataset=_Rows(run["kinds"]))
        trainer.callback_handler.callbacks = [
            c for c in trainer.callback_handler.callbacks if type(c).__name__ != "OverflowDiagnosisCallback"
        ]
        trainer.add_callback(Snap(holder))
        holder.append(trainer)
        return trainer

    if run["resume"] and steps >= 2:
        make(1, initial_values(), save=True).train()
        resumed = make(steps, {n: torch.zeros(v.shape) for n, v in initial_values().items()}, save=False)
        resumed.train(resume_from_checkpoint=os.path.join(folder, "checkpoint-1"))
    else:
        make(steps, initial_values(), save=False).train()
    return snaps


@SETTINGS
@given(trainer_runs)
def test_trainer_runs_train_an_fp16_model_on_masters_as_the_fp32_reference(tmp_path, run):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sub = _trainer_run(run, torch.float16, str(tmp_path / f"sub{id(run)}"))
        ref = _trainer_run(run, torch.float32, str(tmp_path / f"ref{id(run)}"))
    _compare_runs(sub, ref, f"Trainer {run}")
