#!/usr/bin/env bash
# All GPU checks and benchmarks in one run (about 9 minutes on one H200), for a session lent a device machine: `run`
# with command `bash benchmarks/gpu.sh`, timeout_s 580 and carry ["data/shakespeare", "data/sotu"] (the language-model
# study's corpus, fetched here first with `difftx data fetch`; without it that step is skipped). It uses the machine's own python3
# (PyTorch with CUDA, Triton, transformers) with this checkout on PYTHONPATH, and writes everything it prints to
# $OUT/gpu.log plus the benchmark JSON files, to be committed under benchmarks/results/.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
log="$OUT/gpu.log"
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  echo "== kernel checks on the GPU (fp32 against the plain path; the model step against the PyTorch path)"
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton.py tests/test_diff_attention.py
  echo "== bf16 kernel vs float64 plain path, T = 2048"
  timeout 60 python3 - <<'PY'
import torch
from difftransformer.core.attention import kernels
from difftransformer.core.attention.diff import differential_attention
torch.manual_seed(0)
q = torch.randn(2, 8, 2, 2048, 64, device="cuda"); k = torch.randn(2, 4, 2, 2048, 64, device="cuda")
v = torch.randn(2, 4, 2048, 128, device="cuda"); lam = torch.tensor(0.6, device="cuda")
ref = differential_attention(*(t.double() for t in (q, k, v, lam)), scale=0.125)[0]
for impl in ("triton", "sdpa"):
    out = kernels.diff_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), lam, scale=0.125, impl=impl)
    print(impl, "bf16 max abs error", (out.double() - ref).abs().max().item())
PY
  python3 -m difftransformer bench attention --device cuda --dtype bfloat16 --seq 2048 4096 8192 --batch 4 \
    --dim 2048 --heads 16 --repeats 10 --json "$OUT/attention_h200.json"
  python3 -m difftransformer bench train --device cuda --dtype bfloat16 --preset small --seq 2048 4096 --batch 8 \
    --repeats 10 --json "$OUT/train-small_h200.json"
  echo "== language-model study, GPU scale, a 2-minute slice: the learning-rate sweep at 12 steps (speed, pipeline)"
  if [[ -d data/shakespeare && -d data/sotu ]]; then
    timeout 150 python3 -m difftransformer repro lm --scale gpu --steps 12 --seeds 1 --part sweep \
      --out "$OUT/lm-gpu-slice" --corpora data/shakespeare data/sotu
    cp "$OUT/lm-gpu-slice/section.md" "$OUT/lm-gpu-slice.md" 2>/dev/null || true
    cp "$OUT/lm-gpu-slice/results.json" "$OUT/lm-gpu-slice.json" 2>/dev/null || true
    rm -rf "$OUT/lm-gpu-slice"
  else
    echo "skipped: data/shakespeare and data/sotu were not carried"
  fi
} 2>&1 | tee "$log"
