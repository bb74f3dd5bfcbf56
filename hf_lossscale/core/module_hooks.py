"""Hooks on every submodule of a model, each told its module's qualified name: what the overflow
diagnosis, the activation-gradient telemetry and the pre-flight measurements hang on a model. Imports
only torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["ModuleHooks"]


class ModuleHooks:
    """A forward hook (and optionally a full backward hook) on each module of `model` whose qualified
    name `where` accepts (default: every module, the model itself as `""`), in `named_modules()` order
    (a module reached twice is hooked once, under its first name). Each hook is called with the name
    first: `forward(name, module, args, output)`, `forward(name, module, args, kwargs, output)` with
    `with_kwargs=True`, `backward(name, module, grad_input, grad_output)`.

    `remove()` (or leaving a `with` block) removes them all.

    Example:

    ```python
    seen = []
    with ModuleHooks(model, forward=lambda name, module, args, output: seen.append(name)):
        model(batch)
    ```
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        forward: Callable[..., Any] | None = None,
        backward: Callable[..., Any] | None = None,
        with_kwargs: bool = False,
        where: Callable[[str], bool] | None = None,
    ) -> None:
        self.handles: list[Any] = []
        named = [(n, m) for n, m in model.named_modules() if where is None or where(n)]
        try:
            if forward is not None:
                self.handles += [
                    m.register_forward_hook(functools.partial(forward, n), with_kwargs=with_kwargs)
                    for n, m in named
                ]
            if backward is not None:
                self.handles += [
                    m.register_full_backward_hook(functools.partial(backward, n)) for n, m in named
                ]
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        """Remove every hook (a second call does nothing)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def __enter__(self) -> ModuleHooks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
