"""`OptimizerMasters`: one optimizer's masters (or Kahan buffers, or rounding generators): which FP16
parameters have one, the hand-over of their gradients, the chunked or one-pass step, the weights
written back, and the masters checked after a load. Held by the optimizer itself (`masters_of`).

Imports only torch.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from . import hooks
from .kernel import OnePassSlot, one_pass_reason, run_one_pass
from .pair import (
    COMPENSATION_KEY,
    HALF_DTYPES,
    MODES,
    RNG_KEY,
    STATE_KEY,
    GradientInMaster,
    Pair,
    agrees,
    cast_chunk,
    never_stepped,
)  # fmt: skip
from .step import BUCKET_ELEMENTS, Slot, adam_state, chunkable, kahan_split, round_stochastic, run_chunked

__all__ = ["OptimizerMasters"]


class OptimizerMasters:
    """The masters of one optimizer (see the module docstring); kept as an attribute of the optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, mode: str = "masters") -> None:
        if mode not in MODES:
            raise ValueError(f"master_weights mode {mode!r} is not one of {MODES}.")
        self.mode = mode
        self.pairs: dict[int, Pair] = {}  # id(FP16 parameter) -> pair (the pair holds the parameter)
        self.by_master: dict[int, Pair] = {}  # id(master) -> pair
        # the groups' lengths when the FP16 parameters were last looked for
        self._layout: tuple[int, ...] = ()
        self._frozen: list[torch.nn.Parameter] = []  # FP16 parameters left in the groups (frozen then)
        self._hook_handles: list[Any] = []  # the FP16 parameters' gradient hooks
        self._loaded = False  # masters were loaded from a state and await their check (`take_loaded`)
        self.generators: dict[torch.device, torch.Generator] = {}  # "stochastic_rounding"
        self._loaded_rng: dict[torch.device, torch.Tensor] = {}
        self._work: list[tuple[dict, list[Pair]]] | None = None  # the chunked step under way
        ref = weakref.ref(self)
        # `optimizer.zero_grad()` clears the FP16 gradients not yet read into the masters, too (its groups
        # hold the masters): the one method wrapped, on this instance; torch has no hook for it
        # (the optimizer held weakly: no reference cycle keeps it, or its masters, alive after `del`)
        original = optimizer.__dict__.get("hooks.zero_grad")
        original = original if original is not None else functools.partial(type(optimizer).zero_grad)
        optimizer.zero_grad = functools.partial(hooks.zero_grad, original, weakref.ref(optimizer), ref)
        # an optimizer that moves its parameters itself outside `step()` (schedule-free's `eval()` and
        # `train()`, which the Trainer calls around evaluation) moves the masters: the FP16 weights follow
        for mode_switch in ("eval", "train"):
            own = getattr(optimizer, mode_switch, None)
            if callable(own) and not isinstance(own, functools.partial):
                setattr(optimizer, mode_switch, functools.partial(hooks.then_write_back, own, ref))
        optimizer.register_state_dict_post_hook(functools.partial(hooks.state_dict_hook, ref))
        optimizer.register_load_state_dict_pre_hook(functools.partial(hooks.load_pre_hook, ref))
        optimizer.register_load_state_dict_post_hook(functools.partial(hooks.load_post_hook, ref))
        # the update of the FP16 parameters runs chunk by chunk (`masters.step`) between torch's step hooks:
        # their gradients are out of sight of torch's algorithm while it runs (it updates the others)
        self._pre = optimizer.register_step_pre_hook(functools.partial(hooks.before_step, ref))
        self._post = optimizer.register_step_post_hook(functools.partial(hooks.after_step, ref))
        # not at interpreter exit: nothing needs releasing then, and torch may be half torn down
        weakref.finalize(self, hooks.release, self.pairs, self._hook_handles).atexit = False

    # ------------------------------------------------------------------ which parameters
    def sync_params(
        self, optimizer: torch.optim.Optimizer, name: Callable[[torch.Tensor], str | None]
    ) -> int:
        """Masters for trainable FP16 parameters in the groups that have none yet (a new group, an
        unfrozen one); returns how many were made. Cheap when nothing changed."""
        layout = tuple(len(g["params"]) for g in optimizer.param_groups)
        if layout == self._layout and not any(p.requires_grad for p in self._frozen):
            return 0
        made = 0
        frozen = []
        present = {id(p) for g in optimizer.param_groups for p in g["params"]}
        with torch.no_grad():
            for group in optimizer.param_groups:
                params = group["params"]
                for i, p in enumerate(params):
                    if p.dtype not in HALF_DTYPES:
                        continue
                    if not p.requires_grad:
                        frozen.append(p)
                        continue
                    pair = self.pairs.get(id(p))
                    if pair is None:
                        pair = self._new_pair(optimizer, p, name(p))
                        made += 1
                    elif id(pair.master) in present:
                        raise ValueError(
                            f"master_weights: {pair.name or 'an FP16 parameter'} is in the optimizer already "
                            "(as its FP32 master): some parameters appear in more than one parameter group, "
                            "which torch's optimizers refuse."
                        )
                    params[i] = pair.master
        self._frozen = frozen
        self._layout = layout
        return made

    def _new_pair(self, optimizer: torch.optim.Optimizer, half: torch.nn.Parameter, name: str | None) -> Pair:
        label = name or f"<FP16 parameter of shape {tuple(half.shape)}>"
        kind = type(half).__name__
        if kind in ("DTensor", "FlatParameter"):
            raise ValueError(
                f"master_weights: the optimizer holds sharded FP16 parameters ({kind}): under FSDP keep "
                "the parameters in FP32 and let FSDP compute in FP16 (FSDP2 `MixedPrecisionPolicy(param_dtype="
                "torch.float16)`, FSDP1 `MixedPrecision(param_dtype=torch.float16)`), which is the same design; "
                "under DeepSpeed use its FP16 optimizer (`fp16.enabled`), which keeps FP32 masters itself."
            )
        if self.mode != "masters":
            group = next(g for g in optimizer.param_groups if any(q is half for q in g["params"]))
            why = chunkable(optimizer, group)
            if why is not None:
                raise ValueError(
                    f"master_weights={self.mode!r} updates the FP16 weights itself, with torch's Adam, AdamW or SGD "
                    f"arithmetic chunk by chunk: not with {why}. Use master_weights=True (FP32 masters) there."
                )
        state = optimizer.state.get(half)
        adagrad_step = None
        if state and isinstance(optimizer, torch.optim.Adagrad) and never_stepped(state):
            # Adagrad makes its state in its constructor, in the parameter's dtype: the master's is made
            # below as Adagrad makes it for an FP32 parameter (its step counter kept)
            adagrad_step = optimizer.state.pop(half)["step"]
            state = None
        fp32_state = state and all(
            v.dtype == torch.float32
            for k, v in state.items()
            if isinstance(v, torch.Tensor) and k != "step" and v.is_floating_point()
        )
        if state and fp32_state and STATE_KEY not in state:
            # stepped while the parameter was FP32 (then `model.half()`): its FP32 state is the master's
            master = torch.nn.Parameter(half.detach().float())
            optimizer.state[master] = optimizer.state.pop(half)
            state = None
        else:
            master = None
        if state:
            if any(k in state for k in (STATE_KEY, COMPENSATION_KEY, RNG_KEY)):
                raise ValueError(
                    f"master_weights: {label}: this optimizer's state was loaded before its FP32 masters "
                    "existed, so torch cast the masters and the moments to float16. Give the optimizer to "
                    "the scaler first: `scaler.master_weights.attach(optimizer)` (the Trainer and "
                    "`accelerator.prepare` do it), then `optimizer.load_state_dict(...)`."
                )
            raise ValueError(
                f"master_weights: {label} already has optimizer state (the optimizer stepped on FP16 "
                "weights): attach the masters before the first step."
            )
        shell = self.mode != "masters"
        if shell:
            stand_in = torch.zeros((), dtype=torch.float32, device=half.device).expand(half.shape)
            if master is None:
                master = torch.nn.Parameter(stand_in)
            else:  # the FP32 state of a phase with FP32 weights, kept
                master.data = stand_in
        if master is None:
            master = torch.nn.Parameter(half.detach().float())
        if adagrad_step is not None:
            init = optimizer.defaults["initial_accumulator_value"]
            optimizer.state[master] = {"step": adagrad_step, "sum": torch.full_like(master, init)}
        pair = Pair(half=half, master=master, name=name, shell=shell, dtype=half.dtype)
        if self.mode == "kahan":
            pair.compensation = torch.zeros_like(half, memory_format=torch.contiguous_format)
        if self.mode == "stochastic_rounding" and half.device not in self.generators:
            gen = torch.Generator(device=half.device)
            # seeded from the process's seed (`torch.manual_seed`), without drawing from its stream: the
            # same training built twice in one process rounds the same way
            gen.manual_seed((torch.initial_seed() + 0x5EED) % 2**63)
            self.generators[half.device] = gen
        pair.version = pair.weight_version()
        self.pairs[id(half)] = pair
        self.by_master[id(master)] = pair
        me = weakref.ref(pair)
        pair.rehook = weakref.WeakMethod(self._hook_accumulator)
        self._hook_accumulator(pair)
        self._hook_handles.append(
            half.register_post_accumulate_grad_hook(functools.partial(hooks.fold_on_top, me))
        )
        return pair

    def _hook_accumulator(self, pair: Pair) -> None:
        """The FP16 parameter's gradient accumulator, kept (as DDP keeps it), with `on_new_gradient` on
        it: on the accumulator, not the tensor, so that `torch.autograd.grad` (which accumulates nothing)
        leaves it be. Again after a cast of the model: torch gives a parameter whose dtype or device
        changed a new accumulator, which would otherwise add a backward into a marker in place."""
        with torch.enable_grad():
            accumulator = pair.half.view_as(pair.half).grad_fn.next_functions[0][0]
        if accumulator is not pair.accumulator:
            pair.accumulator = accumulator
            self._hook_handles.append(
                accumulator.register_prehook(functools.partial(hooks.on_new_gradient, weakref.ref(pair)))
            )

    # ------------------------------------------------------------------ each step
    def gather(self, optimizer: torch.optim.Optimizer | None = None, defer: bool = False) -> None:
        """Move this iteration's FP16 gradients into the masters (one read each; see the module docstring),
        and bring the masters in line with weights written from outside. `defer` (with the optimizer):
        where the update runs chunk by chunk, the FP16 gradients are taken as they are (`pending`), to be
        cast a chunk at a time inside the step: no FP32 gradient for every parameter at once."""
        self._refresh_masters()
        deferred = self._chunked_masters(optimizer) if defer and optimizer is not None else set()
        fresh_src, fresh_dst, fresh_pairs = [], [], []
        fresh = 0

        def hand_over() -> None:
            # a bucket at a time, each FP16 gradient freed as soon as it is cast: never all the FP16 and
            # all the FP32 gradients at once
            with torch.no_grad():
                torch._foreach_copy_(fresh_dst, fresh_src)
            fresh_src.clear()
            for pair, dst in zip(fresh_pairs, fresh_dst, strict=True):
                pair.master.grad = dst
                pair.on_top = False
                pair.leave_marker()
            fresh_dst.clear()
            fresh_pairs.clear()

        for pair in self.pairs.values():
            grad = pair.half.grad
            if pair.early and grad is not None and not isinstance(grad, GradientInMaster):
                if not pair.collect_early():
                    continue
            if grad is None:
                pair.drop()
                pair.on_top = False
            elif isinstance(grad, GradientInMaster):
                if not pair.marker_is(grad):  # another optimizer's master holds it: none here
                    pair.drop()
                elif pair.master.grad is None and pair.live_pending() is None:
                    # the master's gradient was cleared by hand (`p.grad = None` on the optimizer's
                    # parameter): the model's parameter has none either, as with FP32 weights
                    pair._marker = None
                    pair.half.grad = None
                elif id(pair.master) not in deferred:
                    pair.materialise()
                continue
            elif grad.is_sparse:  # a sparse embedding's: cast as it is (FP32 sparse)
                pair.master.grad = grad.coalesce().float() if pair.master.grad is None or not pair.on_top else (
                    pair.master.grad + grad.float())  # fmt: skip
                pair.on_top = False
                pair.leave_marker()
            elif pair.on_top and pair.master.grad is not None:
                with torch.no_grad():
                    pair.master.grad.add_(grad)
                pair.on_top = False
                pair.leave_marker()
            elif id(pair.master) in deferred:
                pair.defer(grad)
                pair.on_top = False
                pair.leave_marker()
            else:
                fresh_src.append(grad)
                fresh_dst.append(torch.empty(grad.shape, dtype=torch.float32, device=grad.device))
                fresh_pairs.append(pair)
                fresh += grad.numel()
                if fresh >= BUCKET_ELEMENTS:
                    hand_over()
                    fresh = 0
            del grad
        if fresh_pairs:
            hand_over()

    def order_hooks(self, optimizer: torch.optim.Optimizer) -> None:
        """Ours last among the optimizer's step pre-hooks and first among its post-hooks, so that a hook
        of yours, whenever registered, sees the gradients before the step and the updated weights after
        it, as with FP32 weights (torch keeps the hooks in ordered dicts, in registration order)."""
        pre, post = optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks
        if self._pre.id in pre:
            pre.move_to_end(self._pre.id)
        if self._post.id in post:
            post.move_to_end(self._post.id, last=False)

    def _chunked_masters(self, optimizer: torch.optim.Optimizer) -> set[int]:
        """The masters whose update runs chunk by chunk (their groups' options allow it)."""
        return {id(p) for g in optimizer.param_groups if chunkable(optimizer, g) is None for p in g["params"]}

    def pending(self) -> list[torch.Tensor]:
        """The FP16 gradients read but not cast (scaled, or as `set_factor` left them)."""
        return [g for p in self.pairs.values() if (g := p.live_pending()) is not None]

    def set_factor(self, factor: torch.Tensor) -> None:
        """The multiplier (the scale's reciprocal, times a clip coefficient) the pending gradients take
        when they are cast."""
        for pair in self.pairs.values():
            if pair.live_pending() is not None:
                pair.factor = factor if pair.factor is None else pair.factor * factor

    def materialise(self) -> None:
        for pair in self.pairs.values():
            pair.materialise()

    def take_loaded(self, final: bool) -> None:
        """Masters loaded from a state that round to their FP16 weights replace the masters; the others
        wait (the weights may be loaded next) or, when `final`, are rebuilt from the weights with a
        warning that names the parameter."""
        if not self._loaded:  # nothing loaded since the last check: no pass over the pairs
            return
        for device, rng in self._loaded_rng.items():
            gen = self.generators.get(device)
            if gen is not None:
                gen.set_state(rng)
        self._loaded_rng = {}
        loaded = [p for p in self.pairs.values() if p.loaded is not None]
        self._loaded = not final  # a mismatch may wait for the weights; the next step's check settles it
        if loaded:
            with torch.no_grad():
                agree = torch.stack([agrees(p, p.loaded) for p in loaded]).tolist()
                for pair, ok in zip(loaded, agree, strict=True):
                    # a compensation belongs to the weights of the step: taken only then (the model's
                    # weights may be loaded after the optimizer's state)
                    if not final and (not ok or pair.compensation is not None):
                        continue
                    if pair.compensation is not None:  # "kahan": the buffer, or none
                        pair.compensation.copy_(pair.loaded) if ok else pair.compensation.zero_()
                    else:
                        pair.master.copy_(pair.loaded if ok else pair.half)
                    if not ok:
                        warnings.warn(
                            f"master_weights: the {'compensation' if pair.shell else 'FP32 master'} loaded for {pair.name or 'a parameter of shape '}"
                            f"{'' if pair.name else tuple(pair.half.shape)} does not round to its FP16 weight "
                            "(a stale entry, from before a phase that trained the weights without masters, or a "
                            "corrupted file): " + ("dropped." if pair.shell else "rebuilt from the weight."),
                            stacklevel=5,
                        )
                    pair.loaded = None
                    pair.version = pair.weight_version()

    def _refresh_masters(self) -> None:
        """Masters loaded from a state are checked against their weights; weights written from outside
        since our last write are read into their masters."""
        self.take_loaded(final=True)
        self.follow_weights()

    def follow_weights(self) -> None:
        """Weights written from outside since our last write (their version counter moved) are read
        into their masters. A cast of the model (`model.float()`, `.to(torch.bfloat16)`) is not a write:
        the masters carry on, and the weights are them in the new dtype from the next write on."""
        for pair in self.pairs.values():
            if pair.weight_version() != pair.version:
                if pair.half.dtype != pair.dtype and self._cast_of_ours(pair):
                    pair.dtype = pair.half.dtype
                    self._hook_accumulator(pair)
                    with torch.no_grad():
                        pair.half.copy_(pair.master)  # FP32: the master itself; BF16: it rounded
                    pair.version = pair.weight_version()
                    continue
                with torch.no_grad():
                    if pair.compensation is not None:  # the weight written is the value: nothing to carry
                        pair.compensation.zero_()
                    elif not pair.shell:
                        pair.master.copy_(pair.half)
                pair.version = pair.weight_version()

    def _cast_of_ours(self, pair: Pair) -> bool:
        """Whether the weight, in a dtype it did not have, is our last FP16 write cast (not new values)."""
        if pair.shell:
            raise ValueError(
                f"master_weights={self.mode!r} keeps no FP32 master and updates the weights in "
                f"{pair.dtype} itself: {pair.name or 'a parameter'} is now {pair.half.dtype} (the model was "
                "cast mid-run). Cast the model before its first step, or use master_weights=True."
            )
        with torch.no_grad():
            return bool(torch.equal(pair.master.to(pair.dtype).to(pair.half.dtype), pair.half))

    def write_back(self) -> None:
        """The FP16 weights from the masters (round to nearest even), where the chunked step has not
        written them already."""
        pairs = []
        for pair in self.pairs.values():
            if pair.written or pair.shell:
                pair.written = False
                pair.version = pair.weight_version()
            else:
                pairs.append(pair)
        if not pairs:
            return
        with torch.no_grad():
            torch._foreach_copy_([p.half for p in pairs], [p.master for p in pairs])
        for pair in pairs:
            pair.version = pair.weight_version()

    # ------------------------------------------------------------------ the chunked step
    def set_aside(self, optimizer: torch.optim.Optimizer) -> None:
        """Before torch's algorithm runs: the gradients of the pairs whose update runs chunk by chunk are
        taken out of its sight (it updates the optimizer's other parameters)."""
        self.restore()
        work = []
        # pairs already taken: a parameter listed twice is updated once here (torch warns that a list
        # with duplicates will become an error, and meanwhile steps it twice)
        seen: set[int] = set()
        for group in optimizer.param_groups:
            if chunkable(optimizer, group) is not None:
                continue
            taken = []
            for param in group["params"]:
                pair = self.by_master.get(id(param))
                if pair is None or pair.master is not param or id(pair) in seen:
                    continue
                pending = pair.live_pending()
                if pending is None and (param.grad is None or param.grad.is_sparse):
                    if pair.shell and param.grad is not None:
                        raise ValueError(
                            f"master_weights={self.mode!r}: {pair.name or 'an FP16 parameter'} has a sparse "
                            "gradient, which the chunked update does not take: use master_weights=True (FP32 "
                            "masters) for a model with sparse gradients."
                        )
                    continue
                pair.stash, param.grad = param.grad, None
                taken.append(pair)
                seen.add(id(pair))
            if taken:
                work.append((group, taken))
        self._work = work

    def update(self, optimizer: torch.optim.Optimizer) -> None:
        """After torch's algorithm: the pairs set aside, updated chunk by chunk with the same arithmetic
        (and `grad_scale`/`found_inf`, as the scaler hands them to a fused optimizer), and their FP16
        weights written in the same pass."""
        work, self._work = self._work, None
        if not work:
            return
        grad_scale = getattr(optimizer, "grad_scale", None)
        found_inf = getattr(optimizer, "found_inf", None)
        try:
            for group, pairs in work:
                one_pass = self._one_pass_slots(optimizer, group, pairs)
                # one kernel for the group: Triton's on CUDA, `cpu_adam.c` on a CPU (False: the kernel
                # declined before touching anything: a CUDA graph capture, a host counter with a device
                # flag, SGD's first step, ...)
                if isinstance(optimizer, torch.optim.SGD):
                    state_of = functools.partial(_sgd_state, optimizer)
                else:
                    state_of = functools.partial(adam_state, optimizer, group)
                if one_pass is None or not run_one_pass(
                    optimizer, group, one_pass, state_of, grad_scale, found_inf
                ):
                    run_chunked(
                        optimizer, group, [self._slot(p, found_inf) for p in pairs], grad_scale, found_inf
                    )
                for pair in pairs:
                    pair.written = True
                    if grad_scale is not None and pair.live_pending() is not None:
                        # a fused kernel writes an FP32 gradient back divided (not on a step it skips)
                        skipped = found_inf is not None
                        pair.divisor = torch.where(found_inf > 0, 1.0, grad_scale) if skipped else grad_scale
        finally:
            self._work = work
            self.restore()

    def restore(self) -> None:
        """The gradients set aside, back on their masters (a step that raised leaves them there too)."""
        work, self._work = self._work, None
        for _, pairs in work or ():
            for pair in pairs:
                if pair.stash is not None:
                    pair.master.grad, pair.stash = pair.stash, None

    def _one_pass_slots(
        self, optimizer: torch.optim.Optimizer, group: dict, pairs: list[Pair]
    ) -> list | None:
        """The kernel's slots when `masters.kernel` can run this group's update (FP32 masters whose FP16
        gradients are pending; Adam/AdamW on CUDA with Triton, fused Adam/AdamW or SGD on a CPU with
        `cpu_kernel`); None otherwise."""
        if any(p.shell or p.live_pending() is None for p in pairs):
            return None
        slots = [OnePassSlot(p.master, p.pending, p.factor, p.master, p.half) for p in pairs]
        return slots if one_pass_reason(optimizer, group, slots) is None else None

    def _slot(self, pair: Pair, found_inf: torch.Tensor | None) -> Slot:
        half, comp = pair.half, pair.compensation
        pending = pair.live_pending()
        grad = pair.stash if pending is None else pending
        factor = pair.factor if pending is not None else None
        cast = pending is not None
        flat = grad.is_contiguous() and half.is_contiguous() and (pair.shell or pair.master.is_contiguous())

        flats: dict[int, torch.Tensor] = {}  # each tensor's flat view, made once for the step's buckets

        def part(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
            if not flat:
                return t
            whole = flats.get(id(t))
            if whole is None:
                whole = flats[id(t)] = t.view(-1)
            return whole[a:b]

        def kept(a: int, b: int, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
            # a step the fused kernel skipped on the device leaves the stored value bitwise as it was
            return new if found_inf is None else torch.where(found_inf > 0, old, new)

        if not pair.shell:
            master = pair.master

            def load(a: int, b: int) -> torch.Tensor:
                return part(master, a, b)

            def store(a: int, b: int, new: torch.Tensor) -> None:
                part(half, a, b).copy_(new)

        elif comp is not None:

            def load(a: int, b: int) -> torch.Tensor:
                return part(half, a, b).float() + part(comp, a, b).float()

            def store(a: int, b: int, new: torch.Tensor) -> None:
                w, c = part(half, a, b), part(comp, a, b)
                if found_inf is None:
                    kahan_split(new, w, c)
                else:
                    w16, c16 = torch.empty_like(w), torch.empty_like(c)
                    kahan_split(new, w16, c16)
                    w.copy_(kept(a, b, w16, w))
                    c.copy_(kept(a, b, c16, c))

        else:
            gen = self.generators[half.device]

            def load(a: int, b: int) -> torch.Tensor:
                return part(half, a, b).float()

            def store(a: int, b: int, new: torch.Tensor) -> None:
                w = part(half, a, b)
                w.copy_(kept(a, b, round_stochastic(new, gen), w))

        return Slot(
            key=pair.master,
            numel=half.numel(),
            flat=flat,
            grad_of=lambda a, b, out=None: (
                cast_chunk(part(grad, a, b), factor, out) if cast else part(grad, a, b)
            ),
            load=load,
            store=store,
            casts=cast,
        )

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        pair = self.pairs.get(id(param))
        return param if pair is None or pair.half is not param else pair.master

    def half_of(self, param: torch.Tensor) -> torch.Tensor | None:
        pair = self.by_master.get(id(param))
        return pair.half if pair is not None and pair.master is param else None


def _sgd_state(optimizer: torch.optim.Optimizer, key: torch.Tensor) -> dict:
    """SGD's state for `key` as the kernel reads it, making no entry where there is none (torch's SGD
    without momentum keeps no state)."""
    return optimizer.state[key] if key in optimizer.state else {}
