"""The accelerate / transformers / torch versions and internals the integration is tested against.

`tests/test_compat.py` fails loudly when the installed versions or these internals change, so an
upgrade is re-verified before it ships.
"""

from __future__ import annotations

TESTED_VERSIONS = {"accelerate": "1.16", "transformers": "5.25", "torch": "2.13", "trl": "1.16"}
#: Optional extras: checked when installed (`hf_lossscale.integrations.trl_trainers` needs trl).
OPTIONAL = {"trl"}

#: The first accelerate release whose `AcceleratedOptimizer.step_was_skipped` is right for fused
#: optimizers (https://github.com/huggingface/accelerate/issues/4242: it says whether the wrapped
#: `optimizer.step` was called, and a fused optimizer is always called, skipping inside its kernel).
#: None: no release fixes it yet (1.16's `accelerate/optimizer.py` still decides it that way).
#: `tests/test_compat.py` observes the bug on the installed accelerate and checks this against it.
ACCELERATE_4242_FIXED_IN: str | None = None


def accelerate_has_4242() -> bool:
    """Whether the installed accelerate has issue 4242 (so `install_loss_scaler` wraps optimizers in
    `LossScaledOptimizer`, whose `step_was_skipped` reads the scaler's flag)."""
    if ACCELERATE_4242_FIXED_IN is None:
        return True
    from importlib.metadata import version

    installed = tuple(int(p) for p in major_minor(version("accelerate")).split("."))
    return installed < tuple(int(p) for p in ACCELERATE_4242_FIXED_IN.split("."))


# Internals we rely on: (module, attribute path).
INTERNALS = [
    ("accelerate.optimizer", "AcceleratedOptimizer"),
    # an optimizer prepared before install_loss_scaler gets its step machinery rebuilt around the scaler
    # by accelerate's own unpickling path, `__setstate__({"scaler": ...})` (it builds the three
    # `_optimizer_*` / `_accelerate_step_called` attributes below when the scaler is set)
    ("accelerate.optimizer", "AcceleratedOptimizer.__setstate__"),
    ("accelerate.accelerator", "Accelerator.unscale_gradients"),
    ("accelerate.accelerator", "Accelerator.clip_grad_norm_"),
    ("accelerate.accelerator", "Accelerator.clip_grad_value_"),
    ("transformers.trainer", "SCALER_NAME"),
    ("transformers.trainer", "TRAINER_STATE_NAME"),
    # the Trainer writes accelerator.scaler's state_dict() through it (we rely on it, not override it)
    ("transformers.trainer", "Trainer._save_scaler"),
    # the one private Trainer method LossScaleMixin overrides: loading (and checking) the scaler state
    ("transformers.trainer", "Trainer._load_scaler"),
    # loss normalisation looks at the model as the Trainer does
    ("transformers.trainer_utils", "unwrap_peft_model"),
    # install_loss_scaler wraps accelerator.clip_grad_norm_ (public) and asks is_fsdp2
    ("accelerate.accelerator", "Accelerator.is_fsdp2"),
    # the resume rule for accelerator.load_state hangs on its public pre-hook
    ("accelerate.accelerator", "Accelerator.register_load_state_pre_hook"),
    # torch's clip_grad_norm_ internals, reproduced step for step so the norm is bitwise torch's
    ("torch.utils._foreach_utils", "_group_tensors_by_device_and_dtype"),
    ("torch.utils._foreach_utils", "_has_foreach_support"),
    ("torch.utils._foreach_utils", "_device_has_foreach_support"),
    ("torch", "_foreach_norm"),
    ("torch", "_foreach_mul_"),
    ("torch", "_amp_foreach_non_finite_check_and_unscale_"),
    # the FP16 emulation rounds outside its own TorchFunctionMode
    ("torch._C", "DisableTorchFunction"),
    # fp16_products(): a dispatch mode that runs an FP16 model's products on FP32 copies of its inputs
    ("torch.utils._python_dispatch", "TorchDispatchMode"),
    ("torch.utils._pytree", "tree_map"),
    ("torch.utils._pytree", "tree_flatten"),
    # the masters' stand-ins and the scaled loss (`core.scaled_loss`) map their own kind in a call's arguments
    ("torch.utils._pytree", "tree_map_only"),
    # `FP16Emulation` starts a backward with itself on (a mode is off in its own `__torch_function__`),
    # as torch's `backward`/`grad` start it past their check: the same helper and engine call
    ("torch.autograd", "_make_grads"),
    ("torch.autograd.graph", "_engine_run_backward"),
    # ... and leaves the aten ops the engine runs during it (`OpOverload`s) as they are
    ("torch._ops", "OpOverload"),
    # the one-pass master kernel (masters/kernel.py) and the chunked fused step (masters/step.py) move
    # step counters as torch's fused Adam does, and the chunked step calls torch's fused kernels as its
    # `_fused_adam` calls them
    ("torch", "_foreach_add_"),
    ("torch", "_foreach_sub_"),
    ("torch", "_fused_adam_"),
    ("torch", "_fused_adamw_"),
    # master weights (masters/): the FP16 gradients read into the masters and the weights
    # written back in one kernel per dtype; a weight written from outside seen by its version counter;
    # the marker left on an FP16 `.grad` reads its own metadata without its own __torch_function__
    ("torch", "_foreach_copy_"),
    ("torch", "Tensor._version"),
    ("torch._C", "DisableTorchFunctionSubclass"),
    # a sparse gradient's stored values: the overflow check and the observers read them, as torch's
    # GradScaler does (`Tensor.values()` refuses an uncoalesced tensor)
    ("torch", "Tensor._values"),
    # the attention kernel a model runs (no public getter): KVCacheSampler restores it after sampling
    # with a kernel of its own (`set_attn_implementation`, public, sets it)
    ("transformers.configuration_utils", "PreTrainedConfig._attn_implementation"),
    # whether this CPU computes BF16 natively (the demo and compare ask before running BF16)
    ("torch.cpu", "_is_avx512_bf16_supported"),
    ("torch.cpu", "_is_amx_tile_supported"),
]

# Private attributes of accelerate's *instances* that install_loss_scaler reads or writes:
# (module, class, attribute); tests/test_compat.py builds the instances and checks each.
INSTANCE_INTERNALS = [
    # the prepared optimizers and models, which install_loss_scaler attaches the scaler to (and, under
    # accelerate issue 4242, swaps a freshly prepared optimizer for its LossScaledOptimizer in)
    ("accelerate.accelerator", "Accelerator", "_optimizers"),
    ("accelerate.accelerator", "Accelerator", "_models"),
    # the step machinery AcceleratedOptimizer builds only when it has a scaler (its `__setstate__`
    # builds it for optimizers prepared before the scaler existed; we write none of it)
    ("accelerate.optimizer", "AcceleratedOptimizer", "_accelerate_step_called"),
    ("accelerate.optimizer", "AcceleratedOptimizer", "_optimizer_original_step_method"),
    ("accelerate.optimizer", "AcceleratedOptimizer", "_optimizer_patched_step_method"),
    # where Accelerate keeps a prepared model's own forward under autocast; plain_forward (the
    # flushed-fraction probe) runs it, and our CPU wrapper keeps the same name
    ("torch.nn.modules.linear", "Linear", "_original_forward"),
    # AcceleratedOptimizer.step_was_skipped falls back on it when the scaler is not ours
    ("accelerate.optimizer", "AcceleratedOptimizer", "_is_overflow"),
    # torch's flag for optimizers that unscale and skip inside their own step (fused AdamW/SGD,
    # `grad_scale=`/`found_inf=`): the scaler hands those the scale instead of unscaling
    ("torch.optim.adamw", "AdamW", "_step_supports_amp_scaling"),
    # an optimizer's step hooks, in registration order: the chunked update of FP16 parameters' masters
    # (masters/) keeps its hooks last before torch's algorithm and first after it
    ("torch.optim.adamw", "AdamW", "_optimizer_step_pre_hooks"),
    ("torch.optim.adamw", "AdamW", "_optimizer_step_post_hooks"),
]

# Private attributes of TRL's trainers (only with the `trl` extra), checked on a live trainer by
# tests/test_grpo.py::test_a_skipped_grpo_step_advances_nothing (building one needs a model):
TRL_INSTANCE_INTERNALS = [
    # GRPOTrainer's micro-step counter (which generation slice a micro-batch takes, when to
    # generate again): FP16GRPOTrainer rolls it back on a skipped step
    ("trl.trainer.grpo_trainer", "GRPOTrainer", "_step"),
    # its adaptive entropy controller (TRL 1.16, `use_adaptive_entropy`), which moves inside
    # `compute_loss` before a skip is known: FP16GRPOTrainer restores both on a skipped step
    ("trl.trainer.grpo_trainer", "GRPOTrainer", "entropy_coef"),
    ("trl.trainer.grpo_trainer", "GRPOTrainer", "_last_world_entropy"),
]


def major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


_warned = False


def untested_versions() -> dict[str, str]:
    """Installed packages whose major.minor differs from the tested one: name -> installed version."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name, tested in TESTED_VERSIONS.items():
        try:
            installed = version(name)
        except PackageNotFoundError:
            continue
        if major_minor(installed) != tested:
            out[name] = installed
    return out


def warn_if_untested() -> None:
    """Name, once per process, the installed torch / accelerate / transformers versions the
    integration was not tested against (it may still work; the internals it relies on are listed
    in `INTERNALS`)."""
    global _warned
    if _warned:
        return
    _warned = True
    untested = untested_versions()
    if untested:
        import warnings

        found = ", ".join(
            f"{name} {v} (tested: {TESTED_VERSIONS[name]}.x)" for name, v in sorted(untested.items())
        )
        warnings.warn(
            f"hf_lossscale was tested against other versions than these installed ones: {found}. "
            "It may work; if it misbehaves, these versions are the first suspect.",
            stacklevel=3,
        )
