#!/usr/bin/env bash
# The GPU check's dry run on this CPU: proves gpu_check.sh's logic without a GPU.
#
#   python benchmarks/gpu_prepare.py            # fills .whl/ (once)
#   bash benchmarks/gpu_dryrun.sh [VENV] [OUT]  # a few minutes; defaults /tmp/gpu-dryrun-venv, /tmp/gpu-dryrun-out
#
# A throwaway venv starts from the GPU machine's library versions where they matter to our pins
# (transformers 5.17, accelerate 1.15, huggingface_hub 1.33, tokenizers 0.23.2, safetensors 0.8;
# no datasets / evaluate / dill / multiprocess; the other packages it has that we import). Two
# things differ, and are said in the output: torch is this machine's 2.13 CPU wheel (the GPU
# machine's 2.11+cu130 is a multi-GB CUDA build), and Python is this machine's 3.11 (there 3.12),
# so the carried folder is copied with multiprocess's py3.11 wheel in place of its py3.12 one (the
# other carried wheels are pure Python for any 3.x). Then gpu_check.sh runs exactly as there; the
# dry run passes when the carried wheels install and replace the old versions, everything they need
# is found, MiniLM-L6 is restored, the CPU step passes and every CUDA step says "skipped: no GPU".
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-/tmp/gpu-dryrun-venv}"
OUT="${2:-/tmp/gpu-dryrun-out}"
TWIN="${VENV}-wheels"
[ -f .whl/manifest.json ] || { echo "no .whl/manifest.json: run python benchmarks/gpu_prepare.py first"; exit 1; }
echo "== venv $VENV: the GPU machine's versions (torch: this machine's 2.13 CPU wheel) =="
python3 -m venv --clear "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0 transformers==5.17.0 accelerate==1.15.0 huggingface_hub==1.33.0 \
  tokenizers==0.23.2 safetensors==0.8.0 numpy pandas pyarrow xxhash fsspec regex typer pyyaml matplotlib \
  scikit-learn scipy pytest hypothesis tensorboard psutil tqdm requests
"$VENV/bin/python" - <<'PY'
from importlib.metadata import version, PackageNotFoundError
import sys
print("venv: python", sys.version.split()[0], "|", ", ".join(f"{n} {version(n)}" for n in ("torch", "transformers", "accelerate")))
for n in ("datasets", "evaluate", "dill", "multiprocess"):
    try:
        print(f"unexpected: {n} {version(n)} in the venv"); sys.exit(1)
    except PackageNotFoundError:
        pass
print("absent as on the GPU machine: datasets, evaluate, dill, multiprocess")
PY
echo "== the carried folder, for Python $("$VENV/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")') =="
rm -rf "$TWIN" && cp -r .whl "$TWIN"
mp=$(python3 -c "import json; print(json.load(open('.whl/manifest.json'))['packages']['multiprocess'])")
rm -f "$TWIN"/multiprocess-*.whl
"$VENV/bin/pip" download -q --no-deps --only-binary=:all: -d "$TWIN" "multiprocess==$mp"
ls "$TWIN"
rm -rf /tmp/site
rc=0
GPU_CHECK_WHEELS="$TWIN" PYTHON="$VENV/bin/python" bash benchmarks/gpu_check.sh "$OUT" || rc=$?
echo "== dry-run checks =="
s="$OUT/summary.txt"
fail() { echo "DRY RUN FAILED: $1"; exit 1; }
[ "$rc" = 0 ] || fail "gpu_check.sh exited $rc"
grep -q "needed there: all present" "$s" || fail "a needed package is missing"
grep -q "| transformers $(python3 -c 'import transformers; print(transformers.__version__)') | accelerate $(python3 -c 'import accelerate; print(accelerate.__version__)')" "$s" \
  || fail "the carried transformers/accelerate did not replace the venv's"
grep -q "MiniLM-L6 restored to FP32" "$s" || fail "MiniLM-L6 not restored"
grep -q "== 0b. CPU: the project imports and a recipe parses with the carried versions: passed" "$s" || fail "the CPU step did not pass"
n_cuda=$(grep -o 'skip "[0-9]' benchmarks/gpu_check.sh | wc -l)
[ "$(grep -c ': skipped: no GPU ==' "$s")" = "$n_cuda" ] || fail "not every CUDA step says skipped: no GPU"
grep -E "^== [1-9]\..*passed" "$s" && fail "a CUDA step says passed without a GPU"
echo "DRY RUN PASSED (differences from the GPU machine: Python 3.11 here, torch 2.13 CPU; see above)"
