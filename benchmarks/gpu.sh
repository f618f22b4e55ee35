#!/usr/bin/env bash
# The GPU acceptance run, all in one (under 9 minutes on one H200), for a session lent a device machine: `run` with
# command `bash benchmarks/gpu.sh`, timeout_s 580, and carry ["data/shakespeare", "data/sotu"] for the last part (the
# language-model study's corpus, fetched here first with `difftx data fetch`; without it that part is skipped). It
# uses the machine's own python3 (PyTorch with CUDA, Triton, transformers) with this checkout on PYTHONPATH, and
# writes what it prints to $OUT/gpu.log and the benchmarks' JSON files to $OUT, to be committed under
# benchmarks/results/gpu-h200_<date>/. Runs and checkpoints go to $WORK (not brought back).
#
#   1. the kernel tests on the GPU (tests/test_triton.py, tests/test_diff_attention.py);
#   2. benchmarks/gpu_check.py: kernel parity (sdpa, triton, block; float32 and bfloat16) against float64, the KV
#      cache against the full forward, Hugging Face DiffLlama parity, `difftx train` (small preset, bfloat16, 50
#      steps) killed with SIGKILL at a random step and resumed, plainly and under torchrun with a process group of
#      one (NCCL: the collectives run for real), and compiled, each against an uninterrupted run; peak memory;
#   3. the throughput tables: training tokens/s DIFF / standard / DiffLlama at 2K, 4K, 8K (bfloat16), the attention
#      core (sdpa vs triton);
#   4. a 2-minute slice of the language-model study at GPU scale, when there is time left and its data were carried.
#
# --dry-run: the same script on the CPU with tiny sizes, each part that needs CUDA skipped with a line saying so;
# make test runs it (tests/test_gpu_script.py), so that the script cannot rot between GPU sessions. The exit
# status is 1 when any check failed.
set -uo pipefail
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; fi
OUT=${OUT:-/tmp/gpu-out}
WORK=${WORK:-/tmp/gpu-work}
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$WORK"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
(
  status=0
  date -u
  if ((DRY)); then
    echo "dry run: on the CPU with tiny sizes; what needs CUDA is skipped"
  else
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  fi
  "$PY" - <<'PY'
import importlib, torch
versions = {name: getattr(importlib.import_module(name), "__version__", "?") for name in ("torch",)}
for name in ("triton", "transformers"):
    try:
        versions[name] = importlib.import_module(name).__version__
    except ImportError:
        versions[name] = "not installed"
print(" ".join(f"{k} {v}" for k, v in versions.items()), "| cuda:", torch.cuda.is_available())
PY
  echo "== 1. kernel tests on the GPU"
  if ((DRY)); then
    echo "SKIP kernel tests on the GPU: needs CUDA (make test runs them on the CPU)"
  else
    timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_triton.py tests/test_diff_attention.py || status=1
  fi
  echo "== 2. checks: parity, cache, Hugging Face, training killed and resumed, peak memory"
  timeout 330 "$PY" benchmarks/gpu_check.py --out "$WORK/check" $( ((DRY)) && echo --dry-run) || status=1
  echo "== 3. throughput, bfloat16"
  if ((DRY)); then
    echo "SKIP throughput: needs CUDA (CPU numbers: benchmarks/cpu.sh)"
  else
    timeout 90 "$PY" -m difftransformer bench attention --device cuda --dtype bfloat16 --seq 2048 4096 8192 \
      --batch 4 --dim 2048 --heads 16 --repeats 5 --json "$OUT/attention_h200.json" || status=1
    timeout 150 "$PY" -m difftransformer bench train --device cuda --dtype bfloat16 --preset small \
      --seq 2048 4096 8192 --batch 4 --repeats 5 --json "$OUT/train-small_h200.json" || status=1
  fi
  echo "== 4. language-model study, GPU scale, a 2-minute slice: the learning-rate sweep at 12 steps"
  if ((DRY)); then
    echo "SKIP the study slice: needs CUDA"
  elif ((SECONDS > 360)); then
    echo "SKIP the study slice: ${SECONDS} s gone, no time left"
  elif [[ -d data/shakespeare && -d data/sotu ]]; then
    timeout 140 "$PY" -m difftransformer repro lm --scale gpu --steps 12 --seeds 1 --part sweep \
      --out "$WORK/lm-gpu-slice" --corpora data/shakespeare data/sotu
    cp "$WORK/lm-gpu-slice/section.md" "$OUT/lm-gpu-slice.md" 2>/dev/null || true
    cp "$WORK/lm-gpu-slice/results.json" "$OUT/lm-gpu-slice.json" 2>/dev/null || true
  else
    echo "SKIP the study slice: data/shakespeare and data/sotu were not carried"
  fi
  echo "gpu.sh: $( ((status)) && echo 'FAILED (see FAIL above)' || echo passed) in ${SECONDS} s"
  exit $status
) 2>&1 | tee "$OUT/gpu.log"
exit "${PIPESTATUS[0]}"
