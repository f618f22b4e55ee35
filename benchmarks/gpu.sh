#!/usr/bin/env bash
# The GPU acceptance run, all in one, for a session lent a device machine: `run` with command
# `bash benchmarks/gpu.sh` and timeout_s 600; the script keeps within --budget SECONDS (default 540). Predicted on one
# H100 or H200: its checks about 242 s (`python benchmarks/gpu_check.py --predict`, an estimate from their sizes,
# not a measurement), the whole script within its parts' timeouts. It uses the machine's own python3 (PyTorch with
# CUDA, Triton, transformers) with this checkout on PYTHONPATH, writes what it prints to $OUT/gpu.log and the
# benchmarks' JSON files to $OUT, to be committed under benchmarks/results/gpu-h200_<date>/. Runs and checkpoints go
# to a new directory under $WORK_ROOT for each invocation (not brought back), so the script can run again at once.
#
# Parts, each with its timeout (1 to 3 sum to 530 s, under the budget); a part that no longer fits in the budget is
# skipped with a line saying so, and every part prints the time it took:
#   1. (90 s) the tests that run on the GPU (pytest -m gpu: the Triton kernels on CUDA tensors, compiled per tile);
#   2. (280 s) benchmarks/gpu_check.py: kernel parity (sdpa, triton; float32 and bfloat16) against float64, the KV
#      cache against the full forward, Hugging Face DiffLlama parity, `difftx train` (small preset at T 1024,
#      bfloat16, deterministic) killed with SIGKILL at a random step and resumed, plainly and under torchrun with a
#      process group of one (NCCL: the collectives run for real), and compiled, each against an uninterrupted run;
#      peak memory;
#   3. (170 s) throughput, bfloat16: the attention core and layer (sdpa vs triton vs standard vs HF, T 2K to 8K),
#      training steps of the small preset (DIFF / standard / DiffLlama / DIFF with Triton), and decode tokens/s;
#   4. with the time left (at least 60 s) and its corpus carried (data/shakespeare, data/sotu: `difftx data fetch`
#      here first, then carry both): a slice of the language-model study at GPU scale.
#
# --cpu: the same script on the CPU (gpu_check.py --cpu: the same checks at the same sizes, fewer training steps),
# each part that needs CUDA skipped with a line saying so, timeouts and budget CPU_SCALE times longer; make test runs
# it (tests/test_gpu_script.py). GPU_CHECKS="cache hf" runs only those checks of part 2. The exit status is 1 when
# any check or part failed.
set -uo pipefail
CPU=0
BUDGET=540
while (($#)); do
  case "$1" in
    --cpu) CPU=1 ;;
    --budget) BUDGET=$2; shift ;;
    *) echo "gpu.sh: unknown argument $1 (use --cpu, --budget SECONDS)" >&2; exit 2 ;;
  esac
  shift
done
CPU_SCALE=3
SCALE=$((CPU ? CPU_SCALE : 1))
BUDGET=$((BUDGET * SCALE))
OUT=${OUT:-/tmp/gpu-out}
WORK_ROOT=${WORK_ROOT:-/tmp}
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$WORK_ROOT"
WORK=$(mktemp -d "$WORK_ROOT/gpu-work.XXXXXX")
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
status=0

# part TITLE SECONDS COMMAND...: run COMMAND with a timeout of SECONDS (times SCALE) when it fits in what is left of
# the budget, else say why not; print the time it took
part() {
  local title=$1 limit=$(($2 * SCALE)) start=$SECONDS
  shift 2
  if ((SECONDS + limit > BUDGET)); then
    echo "SKIP $title: ${SECONDS} s gone, its ${limit} s would pass the ${BUDGET} s budget"
    return
  fi
  timeout "$limit" "$@"
  local code=$?
  if ((code == 124)); then echo "FAIL $title: stopped at its timeout, ${limit} s"; status=1
  elif ((code != 0)); then echo "FAIL $title: exit status $code"; status=1; fi
  echo "     ($title: $((SECONDS - start)) s of its ${limit} s)"
}

(
  date -u
  echo "work directory: $WORK; budget ${BUDGET} s"
  if ((CPU)); then
    echo "--cpu: on the CPU, the same checks at the same sizes; what needs CUDA is skipped"
  else
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  fi
  "$PY" - <<'PY'
import importlib, torch
versions = {name: getattr(importlib.import_module(name), "__version__", "?") for name in ("torch",)}
for name in ("triton", "transformers", "pytest"):
    try:
        versions[name] = importlib.import_module(name).__version__
    except ImportError:
        versions[name] = "not installed"
print(" ".join(f"{k} {v}" for k, v in versions.items()), "| cuda:", torch.cuda.is_available())
PY
  echo "predicted on a GPU (gpu_check.py --predict): $("$PY" benchmarks/gpu_check.py --predict)"

  echo "== 1. the tests that run on the GPU"
  if ((CPU)); then
    echo "SKIP GPU tests: needs CUDA (make test runs them on the CPU, the Triton kernels in the interpreter)"
  elif ! "$PY" -c "import pytest" 2>/dev/null; then
    echo "SKIP GPU tests: pytest is not installed here"
  else
    # only the modules that hold GPU tests are collected (another module's optional imports need not be here)
    part "GPU tests" 90 "$PY" -m pytest -q -p no:cacheprovider -m gpu $(grep -l "pytest.mark.gpu" tests/test_*.py)
  fi

  echo "== 2. checks: parity, cache, Hugging Face, training killed and resumed, peak memory"
  part "checks" 280 "$PY" benchmarks/gpu_check.py --out "$WORK/check" $( ((CPU)) && echo --cpu) \
    ${GPU_CHECKS:+--only $GPU_CHECKS}

  echo "== 3. throughput, bfloat16"
  if ((CPU)); then
    echo "SKIP throughput: needs CUDA (CPU numbers: benchmarks/cpu.sh)"
  else
    part "bench attention" 60 "$PY" -m difftransformer bench attention --device cuda --dtype bfloat16 \
      --seq 2048 4096 8192 --batch 4 --dim 2048 --heads 16 --repeats 5 --json "$OUT/attention_h200.json"
    part "bench train" 70 "$PY" -m difftransformer bench train --device cuda --dtype bfloat16 --preset small \
      --seq 2048 4096 8192 --batch 4 --repeats 5 --json "$OUT/train-small_h200.json"
    part "bench decode" 30 "$PY" -m difftransformer bench decode --device cuda --dtype bfloat16 --preset small \
      --context 512 4096 --tokens 64 --repeats 3 --json "$OUT/decode-small_h200.json"
  fi

  echo "== 4. language-model study, GPU scale, a slice: the learning-rate sweep at 12 steps, with the time left"
  left=$((BUDGET - SECONDS - 10))
  if ((CPU)); then
    echo "SKIP the study slice: needs CUDA"
  elif ((left < 60)); then
    echo "SKIP the study slice: ${left} s left of the budget, under 60 s"
  elif [[ -d data/shakespeare && -d data/sotu ]]; then
    part "study slice" "$left" "$PY" -m difftransformer repro lm --scale gpu --steps 12 --seeds 1 --part sweep \
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
