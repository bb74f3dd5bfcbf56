#!/usr/bin/env bash
# One-shot GPU check, for a CUDA machine with no network, within 5 minutes.
#
#   bash benchmarks/gpu_check.sh [WHEEL_DIR]
#
# WHEEL_DIR (default ./wheels) holds the wheels brought along (`pip download` them on a machine with
# network: the CUDA torch build, and `pip wheel -w wheels .[dev]` for the rest). The script installs
# from them only, then writes everything to benchmarks/results/gpu_check.txt:
#   1. the CUDA-only tests (pytest -m cuda), among them no host sync on the fused path:
#      torch.cuda.set_sync_debug_mode("error") around scale/unscale/step/update with fused AdamW,
#      telemetry every step and one overflowing step, and around scale/clip_grad_norm_/step/update
#      with fused AdamW and SGD over a run with two skipped steps in the middle
#      (tests/test_clip.py::test_cuda_clip_path_has_no_sync);
#   2. fp16_emulation(policy="cuda") against real CUDA autocast: flushed fractions on MiniLM-L6
#      (benchmarks/gpu_check.py);
#   3. the step-overhead benchmark with absolute times, the clip table first (torch's unscale_ +
#      clip_grad_norm_, the DeepSpeed-style fold, clip_grad_norm_ with fused and foreach AdamW).
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS="${1:-wheels}"
OUT=benchmarks/results/gpu_check.txt
mkdir -p benchmarks/results
exec > >(tee "$OUT") 2>&1
echo "== gpu_check $(date -u +%FT%TZ) =="
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || { echo "no GPU"; exit 1; }
if [ -d "$WHEELS" ]; then
  python -m pip install -q --no-index --find-links "$WHEELS" torch || exit 1
  python -m pip install -q --no-index --find-links "$WHEELS" -e ".[dev]" || exit 1
else
  echo "(no $WHEELS folder: using the packages already installed)"
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python -c "import torch; assert torch.cuda.is_available(), 'torch has no CUDA'; print('torch', torch.__version__, torch.cuda.get_device_name())" || exit 1
status=0
echo "== 1. CUDA tests =="; timeout 120 python -m pytest -q -m cuda -p no:cacheprovider tests || status=1
echo "== 2. emulation vs CUDA autocast (ops, architectures) =="; timeout 240 python benchmarks/gpu_check.py || status=1
echo "== 3. step overhead (absolute times) =="; timeout 120 python benchmarks/step_overhead.py --repeats 10 || status=1
echo "== done: status $status (results in $OUT and benchmarks/results/*.json) =="
exit $status
