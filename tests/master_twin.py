"""A model held in FP16 with FP32 masters, run side by side with a reference that is right by construction.

The reference is the same model with FP32 weights whose forward computes in FP16 from `weight.half()`
(what autocast does): its optimizer, its scaler, its clipping and its state are the FP32-weight paths
that torch's own tests cover. Its gradients are the FP16 gradients cast to FP32, as the masters' are.
The two can only differ where FP16 gradients are summed (accumulation): the data make every gradient
a small integer times a power of two, so that those sums are exact in FP16 too, and the ceiling of the
scale keeps them below FP16's overflow. Where masters are *meant* to differ from FP32 weights, the
reference does so explicitly: a parameter entering a new optimizer starts from its FP16 weight (its old
master lived and died with the old optimizer), so the reference rounds it there.

Why not "FP32 weights rounded to FP16 after every applied step": that is pure FP16 training, which
loses the updates below half an FP16 ulp that masters exist to keep.
"""

from __future__ import annotations

import io
import math

import torch

from hf_lossscale import DynamicLossScaler

C = 2.0**-4  # the loss's factor: gradients are integers x C x scale
KINDS = ("finite", "loss_inf", "loss_nan", "grad_inf", "grad_nan")
SHAPES = {"w1": (2, 3), "b1": (2,), "w2": (2, 3)}
CONFIG = dict(init_scale=2.0**8, max_scale=2.0**12, min_scale=1.0, growth_interval=2, backoff_factor=0.5)


class _NaNGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


def batch(seed: int, kind: str) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randint(-2, 3, (2, 3), generator=g).half(),
        "t1": torch.randint(-2, 3, (2, 2), generator=g).half(),
        "t2": torch.randint(-2, 3, (2, 2), generator=g).half(),
        "kind": kind,
    }


def loss_of(w: dict[str, torch.Tensor], b: dict) -> torch.Tensor:
    """The loss from FP16 weights (each gradient: integers x C)."""
    y1 = b["x"] @ w["w1"].t() + w["b1"]
    y2 = b["x"] @ w["w2"].t()
    loss = ((y1 * b["t1"]).sum().float() + (y2 * b["t2"]).sum().float()) * C
    kind = b["kind"]
    if kind == "loss_inf":
        loss = loss + float("inf")
    elif kind == "loss_nan":
        loss = loss + float("nan")
    elif kind == "grad_inf":  # a finite loss whose FP16 gradient overflows
        loss = loss + w["w1"].float().sum() * 2.0**100
    elif kind == "grad_nan":  # a finite loss whose gradient is NaN
        loss = loss + _NaNGrad.apply(w["w2"]).float().sum() * 0
    return loss


class Module(torch.nn.Module):
    """The model as `nn.Module` (for Accelerate and the Trainer): FP16 weights (the subject) or FP32
    weights computed in FP16 (the reference)."""

    def __init__(self, values: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        super().__init__()
        for name, v in values.items():
            self.register_parameter(name, torch.nn.Parameter(v.detach().to(dtype).clone()))

    def forward(self, x=None, t1=None, t2=None, kind=None, labels=None):
        w = {n: p if p.dtype == torch.float16 else p.half() for n, p in self.named_parameters()}
        kinds = kind if isinstance(kind, (list, tuple)) else [kind]
        names = {0: "finite", 1: "loss_inf", 2: "loss_nan", 3: "grad_inf", 4: "grad_nan"}
        if isinstance(kind, torch.Tensor):
            kinds = [names[int(k)] for k in kind.reshape(-1).tolist()]
        kinds = [k for k in kinds if k != "finite"]
        b = {"x": x.half().reshape(-1, 3), "t1": t1.half().reshape(-1, 2), "t2": t2.half().reshape(-1, 2)}
        b["kind"] = kinds[0] if kinds else "finite"
        return {"loss": loss_of(w, b)}


def initial_values(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g).half() for n, shape in SHAPES.items()}


class Lion(torch.optim.Optimizer):
    """A user's own optimizer (Lion, Chen et al. 2023, as its reference code writes it): reads `p.grad`,
    writes `p` in place, keeps its state in `self.state[p]`."""

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.mul_(1 - group["lr"] * group["weight_decay"])
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                update = state["exp_avg"].mul(b1).add(p.grad, alpha=1 - b1).sign_()
                p.add_(update, alpha=-group["lr"])
                state["exp_avg"].mul_(b2).add_(p.grad, alpha=1 - b2)


def _adafactor(params: list, lr: float, relative: bool):
    from transformers.optimization import Adafactor

    if relative:  # transformers' defaults: the step size from the parameter's RMS
        return Adafactor(params, lr=None)
    return Adafactor(params, lr=lr, relative_step=False, scale_parameter=False, warmup_init=False)


#: Optimizers beyond torch's Adam/AdamW/SGD (issue 55): each steps on the masters with its own code.
OTHER_OPTIMIZERS = {
    "adagrad": lambda ps, lr: torch.optim.Adagrad(ps, lr=lr, initial_accumulator_value=0.1),
    "rmsprop": lambda ps, lr: torch.optim.RMSprop(ps, lr=lr / 5, momentum=0.5),
    "nadam": lambda ps, lr: torch.optim.NAdam(ps, lr=lr),
    "radam": lambda ps, lr: torch.optim.RAdam(ps, lr=lr),
    "adamax": lambda ps, lr: torch.optim.Adamax(ps, lr=lr),
    "adam_amsgrad": lambda ps, lr: torch.optim.Adam(ps, lr=lr, amsgrad=True),
    "adadelta": lambda ps, lr: torch.optim.Adadelta(ps, lr=lr * 10),
    "asgd": lambda ps, lr: torch.optim.ASGD(ps, lr=lr),
    "rprop": lambda ps, lr: torch.optim.Rprop(ps, lr=lr / 5),
    "sgd_nesterov": lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9, nesterov=True),
    "adafactor": lambda ps, lr: _adafactor(ps, lr, relative=False),
    "adafactor_relative": lambda ps, lr: _adafactor(ps, lr, relative=True),
    "lion": lambda ps, lr: Lion(ps, lr=lr / 10, weight_decay=0.1),
}


def make_optimizer(kind: str, params: list, lr: float):
    if kind in OTHER_OPTIMIZERS:
        return OTHER_OPTIMIZERS[kind](params, lr)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if kind == "sgd_momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=0.01)
    if kind == "adamw_fused":
        return torch.optim.AdamW(params, lr=lr, fused=True)
    return torch.optim.AdamW(params, lr=lr, foreach=True)


class Side:
    """One side of the pair: the subject (FP16 weights) or the reference (FP32 weights)."""

    def __init__(self, dtype: torch.dtype, opt_kind: str, in_first: list[str], values: dict) -> None:
        self.dtype = dtype
        self.opt_kind = opt_kind
        self.params = {n: torch.nn.Parameter(v.to(dtype).clone()) for n, v in values.items()}
        self.scaler = DynamicLossScaler(**CONFIG)
        self.scaler.set_parameter_names(list(self.params.items()))
        self.optimizers = [make_optimizer(opt_kind, [self.params[n] for n in in_first], 0.05)]
        self.members = [[list(in_first)]]  # per optimizer, per group: the parameters' names

    @property
    def reference(self) -> bool:
        return self.dtype == torch.float32

    def weights16(self) -> dict[str, torch.Tensor]:
        return {n: p if p.dtype == torch.float16 else p.half() for n, p in self.params.items()}

    def backward(self, b: dict) -> None:
        self.scaler.scale(loss_of(self.weights16(), b)).backward()

    def opt_params(self, i: int) -> list[torch.Tensor]:
        return [p for g in self.optimizers[i].param_groups for p in g["params"]]

    def in_optimizer(self, name: str) -> int | None:
        for i, groups in enumerate(self.members):
            if any(name in names for names in groups):
                return i
        return None

    def names_of(self, i: int) -> list[str]:
        return [n for names in self.members[i] for n in names]

    # ------------------------------------------------------------------ structural moves
    def round_entering(self, names: list[str]) -> None:
        """Reference only: a parameter entering a new optimizer starts from its FP16 weight."""
        if self.reference:
            with torch.no_grad():
                for n in names:
                    self.params[n].copy_(self.params[n].half().float())

    def new_optimizer(self, i: int, lr: float) -> None:
        names = self.names_of(i)
        self.round_entering(names)
        self.optimizers[i] = make_optimizer(self.opt_kind, [self.params[n] for n in names], lr)
        self.members[i] = [list(names)]

    def add_group(self, i: int, name: str, lr: float) -> None:
        self.round_entering([name])
        self.optimizers[i].add_param_group({"params": [self.params[name]], "lr": lr})
        self.members[i].append([name])

    def second_optimizer(self, name: str, lr: float) -> None:
        self.round_entering([name])
        self.optimizers.append(make_optimizer(self.opt_kind, [self.params[name]], lr))
        self.members.append([[name]])

    def save_load(self) -> None:
        """Everything saved (as a user's checkpoint) and loaded into fresh objects."""
        buf = io.BytesIO()
        torch.save(
            {
                "model": {n: p.detach() for n, p in self.params.items()},
                "optimizers": [o.state_dict() for o in self.optimizers],
                "scaler": self.scaler.state_dict(),
                "members": self.members,
            },
            buf,
        )
        buf.seek(0)
        ckpt = torch.load(buf, weights_only=True)
        self.params = {n: torch.nn.Parameter(torch.empty(SHAPES[n], dtype=self.dtype)) for n in SHAPES}
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(ckpt["model"][n])
        requires = {n: True for n in SHAPES}
        self.scaler = DynamicLossScaler(**CONFIG)
        self.scaler.set_parameter_names(list(self.params.items()))
        self.optimizers = []
        for groups, state in zip(ckpt["members"], ckpt["optimizers"], strict=True):
            opt = make_optimizer(self.opt_kind, [self.params[n] for n in groups[0]], 0.05)
            for names in groups[1:]:
                opt.add_param_group({"params": [self.params[n] for n in names]})
            self.scaler.master_weights.attach(opt)  # plain torch: masters before the state comes in
            opt.load_state_dict(state)
            self.optimizers.append(opt)
        self.members = [[list(names) for names in groups] for groups in ckpt["members"]]
        self.scaler.load_state_dict(ckpt["scaler"])
        del requires


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and torch.equal(
        a.float().nan_to_num(7.0, 8.0, -8.0), b.float().nan_to_num(7.0, 8.0, -8.0)
    )


def check(sub: Side, ref: Side, where: str, grads: bool = True) -> None:
    """Weights, masters, gradients as the optimizers see them, optimizer state and scaler statistics."""
    for n in SHAPES:
        s, r = sub.params[n], ref.params[n]
        assert s.dtype == torch.float16, where
        assert torch.equal(s.detach(), r.detach().half()), (
            f"{where}: FP16 weight {n} differs from the reference's"
        )
        assert s.requires_grad == r.requires_grad, where
    for i, (so, ro) in enumerate(zip(sub.optimizers, ref.optimizers, strict=True)):
        sp, rp = sub.opt_params(i), ref.opt_params(i)
        assert len(sp) == len(rp), f"{where}: optimizer {i} holds {len(sp)} tensors, the reference {len(rp)}"
        for k, (a, b) in enumerate(zip(sp, rp, strict=True)):
            if a.dtype == torch.float32:  # a master: equal to the reference's FP32 weight, bitwise
                assert torch.equal(a.detach(), b.detach()), f"{where}: master {k} of optimizer {i} differs"
            if grads:
                assert _same(sub.scaler.master_weights.grad(so, a), b.grad), (
                    f"{where}: gradient of tensor {k} of optimizer {i}: {a.grad} vs {b.grad}"
                )
            sa, sb = so.state.get(a, {}), ro.state.get(b, {})
            assert sorted(sa) == sorted(sb), f"{where}: state keys {sorted(sa)} vs {sorted(sb)}"
            for key in sa:
                va, vb = sa[key], sb[key]
                if isinstance(va, torch.Tensor):
                    # Before its first step an FP16 parameter has no master yet, and a state its optimizer's
                    # constructor made (Adagrad's `sum`) is in the parameter's dtype: the reference's, rounded.
                    vb = vb.to(va.dtype) if a.dtype == torch.float16 else vb
                    assert torch.equal(va, vb), f"{where}: optimizer {i} state {key} of tensor {k} differs"
                else:
                    assert va == vb, where
        for ga, gb in zip(so.param_groups, ro.param_groups, strict=True):
            assert ga["lr"] == gb["lr"], where
    ss, rs = sub.scaler.stats(), ref.scaler.stats()
    assert ss == rs, f"{where}: scaler {ss} vs reference {rs}"


def both(sub: Side, ref: Side, func) -> tuple:
    """Run `func(side)` on both; both must raise the same exception type or neither."""
    out = []
    for side in (sub, ref):
        try:
            out.append(("ok", func(side)))
        except (RuntimeError, ValueError) as e:
            out.append(("raised", type(e)))
    assert out[0][0] == out[1][0] and (out[0][0] == "ok" or out[0][1] == out[1][1]), out
    return out[0][1], out[1][1]


def finite_number(x: float) -> bool:
    return math.isfinite(x)
