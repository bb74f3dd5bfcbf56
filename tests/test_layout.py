"""The package's tiers (docs/development.md, "Layout"): what each may import, the order they import
in, the shared helpers' one home each, and the paths the docs name.

- `masters/`: FP32 master weights, the optimizer's side (masters, stand-ins, the chunked step, the
  kernel, Kahan and stochastic rounding); torch only.
- `core/`: the scaler and what it records; torch only (the config not even torch).
- `fp16/`: what FP16 does to a model (emulation, FP32 fallback, underflow map, advice, preflight,
  precision); torch, and transformers to load models.
- `integrations/`: Accelerate, the Trainer and its callbacks, the resume rule, DeepSpeed, TensorBoard,
  TRL, compat.
- `tools/`: the command line (its commands, compare, verdicts, reports, the demo). `recipes/`: the recipes.
"""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "hf_lossscale"
#: What importing each tier may bring in, beyond torch and the standard library.
HEAVY = ("accelerate", "transformers", "datasets", "evaluate", "matplotlib", "sklearn", "trl", "tensorboard")
#: (transformers' `Trainer` imports datasets when it is installed; without it, it does not need it.)
ALLOWED = {
    "masters": set(),
    "core": set(),
    "fp16": {"transformers"},
    "integrations": {"accelerate", "transformers", "datasets"},
}


ROOT = PKG.parent
#: The files a user reads: every `hf_lossscale.<path>` they name must import.
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "recipes" / "README.md",
        ROOT / "benchmarks" / "README.md"]  # fmt: skip


def _documented_paths() -> list[str]:
    import re

    found = set()
    for doc in DOCS:
        found.update(re.findall(r"hf_lossscale(?:\.[A-Za-z_]\w*)+", doc.read_text()))
    return sorted(found)


def test_the_package_root_holds_only_its_entrance():
    """`__init__.py` (the public names), `_extras.py`, `py.typed` and the tiers' folders. Bug caught:
    a module moved into a tier leaving an alias file behind (28 of them did), or a new module
    dropped at the root instead of its tier."""
    files = sorted(p.name for p in PKG.iterdir() if p.is_file())
    folders = sorted(p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert files == ["__init__.py", "_extras.py", "py.typed"]
    assert folders == ["core", "fp16", "integrations", "masters", "recipes", "tools"]


@pytest.mark.parametrize("path", _documented_paths())
def test_every_documented_import_path_imports(path):
    """Each `hf_lossscale...` path the README and the docs name is a module, or a name in one.
    Bug caught: a doc still naming a module path that moved (or an alias that was removed)."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name == "trl":
                pytest.skip("needs trl")
            if err.name is None or not name.startswith(err.name):
                raise
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return
    pytest.fail(f"{path} does not import")


#: Modules that exist to integrate one optional library (the `trl` extra; Triton, for the masters' CUDA
#: kernel) and so import it.
FOR_ONE_LIBRARY = {"trl_trainers", "grpo", "triton_adam"}


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


#: The one import of core/ from a higher tier: the deprecated `LossScaleConfig.to_deepspeed_config()`,
#: a thin call to the function that replaced it (inside the method; removed with it).
DEPRECATED_SHIMS = {("core.config", "integrations.deepspeed")}


def test_core_depends_on_no_other_tier():
    """core/ imports nothing from fp16/, integrations/, tools/ or recipes/ (masters/, below it, it may),
    at import time or inside functions, except the deprecated shim. Bug caught: the scaler importing a
    tool (its dependencies would follow it)."""
    offenders = [
        f"{path.name}: {source}"
        for path in (PKG / "core").glob("*.py")
        for source, _ in _imports(path)
        if source.startswith("hf_lossscale.")
        and not source.startswith(("hf_lossscale.core", "hf_lossscale.masters", "hf_lossscale._extras"))
    ]
    assert offenders == ["config.py: hf_lossscale.integrations.deepspeed"]


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (at the top or inside a function), from the source."""
    mods = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
        for p in PKG.rglob("*.py")
    }
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join([*base, node.module] if node.module else base)
                candidates = [target, *(f"{target}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            else:
                continue
            deps.update(c for c in candidates if c in mods and c != name)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles_outside_the_scaler_and_its_observers():
    """Bug caught: two modules that import each other (the CLI and the demo did; so did the
    reproduction's runner and table), which makes either one's import order matter."""
    assert _cycles(_import_graph()) == [
        ["hf_lossscale.core.config", "hf_lossscale.integrations.deepspeed"],  # the deprecated shim
        ["hf_lossscale.core.scaler", "hf_lossscale.core.scaler_observers"],
    ]
    reproduce = ROOT / "benchmarks" / "reproduce"
    imported = {
        f: {
            n.module
            for n in ast.walk(ast.parse((reproduce / f"{f}.py").read_text()))
            if isinstance(n, ast.ImportFrom)
        }
        for f in ("run", "table", "suite")
    }
    assert "run" not in imported["table"] and "suite" in imported["table"] and "table" in imported["run"]
    assert not {"run", "table"} & imported["suite"]


#: The code of each shared helper, and the one module that holds it (issue 46: each existed 2-3 times).
ONE_HOME = {
    "ReduceOp.MAX": "core/distributed.py",  # all_reduce_max
    ".to_local()": "core/distributed.py",  # local_shard
    'hasattr(tensor, "device_mesh")': "core/distributed.py",  # is_dtensor
    '"optimizer", None), torch.optim.Optimizer)': "masters/optimizer_wrappers.py",  # inner_optimizer
    "register_full_backward_hook": "core/module_hooks.py",  # ModuleHooks
}


@pytest.mark.parametrize("code", sorted(ONE_HOME))
def test_each_shared_helper_has_one_home(code):
    """Bug caught: a second all-reduce, DTensor check, optimizer unwrapper or module-hook walker written
    beside the one in core/ (they drift: one unwrapped Accelerate's wrapper by class, one by attribute)."""
    holders = sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if code in p.read_text())
    assert holders == [ONE_HOME[code]]


#: Tiers, lowest first: a module imports only from its own tier and those before it.
TIER_ORDER = ["masters", "core", "fp16", "integrations", "tools", "recipes"]
#: (module, what it imports) against the order; docs/development.md names each.
UPWARD = {("integrations.callbacks", "tools.bf16")}  # the event log's processor name


def test_imports_go_down_the_tiers():
    """Bug caught: an fp16 module importing from integrations or tools, an integration importing a
    tool (at the top or inside a function): that tool's extras would follow the integration."""
    graph = _import_graph()
    found = set()
    for module, deps in graph.items():
        parts = module.split(".")
        if len(parts) < 3 or parts[1] not in TIER_ORDER:
            continue
        for dep in deps:
            dep_parts = dep.split(".")
            if len(dep_parts) >= 2 and dep_parts[1] in TIER_ORDER:
                if TIER_ORDER.index(dep_parts[1]) > TIER_ORDER.index(parts[1]):
                    found.add((".".join(parts[1:3]), ".".join(dep_parts[1:3])))
    assert found == UPWARD | DEPRECATED_SHIMS


#: Modules over 800 lines, each with why it stays one room (none today). The scaler class: under 700.
LARGE = {}


def test_every_room_is_small_and_the_scaler_class_under_700_lines():
    """Issue 56: each module under 800 lines (master_weights.py was 1,255, scaler.py 949) and the scaler
    class under 700 (854). Bug caught: a room growing back past what one reader holds in mind, a
    helper added to the scaler class instead of the module its job belongs to."""
    big = {
        str(p.relative_to(PKG)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) >= 800
    }
    assert big == LARGE
    tree = ast.parse((PKG / "core" / "scaler.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DynamicLossScaler"]
    assert cls.end_lineno - cls.lineno + 1 < 700
