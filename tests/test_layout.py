"""The package's tiers (README, "Layout"): what each may import, and the old module paths.

- `core/`: the scaler and what it records; torch only (the config not even torch).
- `fp16/`: what FP16 does to a model (emulation, FP32 fallback, underflow map, advice, preflight,
  precision); torch, and transformers to load models.
- `integrations/`: Accelerate, the Trainer and its callbacks, TensorBoard, TRL, compat.
- `tools/`: the command line (compare, verdicts, reports, the demo). `recipes/`: the recipes.
"""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "hf_lossscale"
#: Old module path -> where it lives now (the old paths stay for one release).
MOVED = {
    "config": "core.config", "scaler": "core.scaler", "scaler_state": "core.scaler_state",
    "scaler_observers": "core.scaler_observers", "_gradnorm": "core.clip", "_hostcopy": "core.hostcopy",
    "telemetry": "core.telemetry", "overflow": "core.overflow", "events": "core.events",
    "emulation": "fp16.emulation", "fp32_modules": "fp16.fp32_modules", "underflow": "fp16.underflow",
    "advise": "fp16.advise", "preflight": "fp16.preflight", "precision": "fp16.precision",
    "accelerate_hook": "integrations.accelerate_hook", "trainer": "integrations.trainer",
    "callbacks": "integrations.callbacks", "loss_normalisation": "integrations.loss_normalisation",
    "tensorboard": "integrations.tensorboard", "trl_trainers": "integrations.trl_trainers",
    "_compat": "integrations.compat", "cli": "tools.cli", "compare": "tools.compare",
    "verdict": "tools.verdict", "report": "tools.report", "demo": "tools.demo", "files": "tools.files",
}  # fmt: skip
#: What importing each tier may bring in, beyond torch and the standard library.
HEAVY = ("accelerate", "transformers", "datasets", "evaluate", "matplotlib", "sklearn", "trl", "tensorboard")
#: (transformers' `Trainer` imports datasets when it is installed; without it, it does not need it.)
ALLOWED = {
    "core": set(),
    "fp16": {"transformers"},
    "integrations": {"accelerate", "transformers", "datasets"},
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_module_path_is_the_moved_module(old):
    """`hf_lossscale.<old>` is the very module object at its new path, so code that imports, reads
    or monkeypatches a name there (private ones included) acts on the module the package runs.
    Bug caught: a stub that copies the public names only (`from .core.scaler import *`): a patch
    through the old path would then change a copy nobody calls."""
    if old == "trl_trainers":
        pytest.importorskip("trl")
    moved = importlib.import_module(f"hf_lossscale.{MOVED[old]}")
    assert importlib.import_module(f"hf_lossscale.{old}") is moved


#: Modules that exist to integrate one optional library (the `trl` extra) and so import it.
FOR_ONE_LIBRARY = {"trl_trainers"}


def _tier_modules(tier: str) -> list[str]:
    skip = {"__init__", *FOR_ONE_LIBRARY}
    return sorted(f"hf_lossscale.{tier}.{p.stem}" for p in (PKG / tier).glob("*.py") if p.stem not in skip)


@pytest.mark.parametrize("tier", sorted(ALLOWED))
def test_each_tier_imports_only_what_it_may(tier):
    """Importing every module of a tier, in a fresh interpreter, brings in none of the heavy
    libraries that tier may not use. Bug caught: a core module importing transformers at the top
    (the scaler would then cost users the Hub stack), an integration importing matplotlib."""
    code = (
        "import importlib, sys\n"
        f"for m in {_tier_modules(tier)!r}: importlib.import_module(m)\n"
        f"print(sorted(h for h in {HEAVY!r} if h in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = set(ast.literal_eval(out.strip().splitlines()[-1]))
    assert loaded <= ALLOWED[tier], f"importing hf_lossscale.{tier} loads {sorted(loaded - ALLOWED[tier])}"


def test_config_imports_no_torch():
    out = subprocess.run([sys.executable, "-c", "import hf_lossscale.core.config, sys; print('torch' in sys.modules)"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert out.strip() == "False"


def _imports(path: Path):
    """(module imported from, names) for each `from X import names` in `path`, X resolved."""
    package = path.relative_to(PKG.parent).with_suffix("").parts[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            yield source, [a.name for a in node.names]


def test_no_module_imports_another_modules_private_names():
    """Bug caught: a module reaching into another's internals (`from .emulation import _grads`),
    which a refactor of that module breaks without its tests noticing. The old-path stubs (which
    only alias) and `_extras` (the package's shared helper) are the exceptions."""
    offenders = []
    for path in PKG.rglob("*.py"):
        for source, names in _imports(path):
            if not source.startswith("hf_lossscale"):
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and not source.endswith("._extras"):
                offenders.append(f"{path.relative_to(PKG)}: from {source} import {', '.join(private)}")
    assert offenders == []


def test_core_depends_on_no_other_tier():
    """core/ imports nothing from fp16/, integrations/, tools/ or recipes/, at import time or inside
    functions. Bug caught: the scaler importing a tool (its dependencies would follow it)."""
    offenders = [
        f"{path.name}: {source}"
        for path in (PKG / "core").glob("*.py")
        for source, _ in _imports(path)
        if source.startswith("hf_lossscale.")
        and not source.startswith(("hf_lossscale.core", "hf_lossscale._extras"))
    ]
    assert offenders == []
