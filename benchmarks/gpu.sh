#!/usr/bin/env bash
# The GPU acceptance run, all in one, for a session lent a device machine: `run` with command
# `bash benchmarks/gpu.sh` and timeout_s 600; the script keeps within --budget SECONDS (default 560). It uses the
# machine's own python3 (the image's PyTorch with CUDA, Triton, transformers, pytest, psutil: nothing else) with this
# checkout on PYTHONPATH, writes what it prints to $OUT/gpu.log and the benchmarks' JSON files to $OUT (named after the
# GPU), to be committed under benchmarks/results/gpu-<gpu>_<date>/. Runs and checkpoints go to a new directory under
# $WORK_ROOT for each invocation (not brought back), so the script can run again at once.
#
# Parts, each with its predicted GPU seconds and its timeout (1.5 x the prediction, which counts process starts, cold
# Triton compiles, torch.compile and preparing the built-in corpus: `python benchmarks/gpu_check.py --plan`, estimates
# from the sizes, not measurements). Parts 1 to 3 sum to 545 s of timeouts, under the budget; a part that no longer
# fits in what is left of it says SKIP with the command that runs it alone; every part prints the time it took:
#   1. (51 s, timeout 77 s) the GPU tests that are not slow (pytest -m "gpu and not slow": the Triton kernels on CUDA
#      tensors);
#   2. (246 s, timeout 369 s) benchmarks/gpu_check.py: kernel parity (padded SDPA and Triton; float32 and bfloat16)
#      against float64, the KV cache against the full forward, Hugging Face DiffLlama parity, `difftx train` (small
#      preset at T 1024, bfloat16, deterministic) killed with SIGKILL at a random step and resumed under torchrun with
#      a process group of one (NCCL with one rank: no collective communicates), and compiled, each against an
#      uninterrupted run; peak memory, reported;
#   3. (66 s, timeout 99 s) benchmarks/gpu_bench.py, bfloat16: the attention layer and core (padded SDPA, Triton,
#      standard, HF; T 2048 and 8192), training steps of the small preset, decode tokens/s at batch 1 and 8 with the
#      operations a step dispatches; then CUDA's attention method chosen from the numbers (METHOD line);
#   4. (320 s, timeout 480 s) with the time left and its corpus carried (data/shakespeare, data/sotu: `difftx data
#      fetch` here first, then carry both): a slice of the language-model study at GPU scale; it does not fit after
#      parts 1 to 3 and says SKIP with its command (STEPS=12 bash benchmarks/lm_gpu.sh, alone).
#
# --cpu: the rehearsal, on the CPU with the CUDA branch's code (DIFFTX_REHEARSE=cuda: padded SDPA, the PyTorch decode
# path, Triton in its interpreter, bfloat16 autocast, pinned host batches; gpu_check.py --cpu prints what only a GPU
# runs and what stands in for it), parts 2 and 3 at the sizes CPU_CHANGES and CPU_SIZES set, timeouts and budget
# CPU_SCALE times longer; make test runs it (tests/test_gpu_script.py). GPU_CHECKS="cache hf" runs only those checks
# of part 2. The exit status is 1 when any check or part failed.
set -uo pipefail
CPU=0
BUDGET=560
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
declare -A TIMEOUT
while IFS=$'\t' read -r name _ timeout; do TIMEOUT[$name]=$timeout; done < <("$PY" benchmarks/gpu_check.py --plan)

# part TITLE COMMAND...: run COMMAND with the timeout --plan gives TITLE (times SCALE) when it fits in what is left of
# the budget, else say SKIP with the command to run alone; print the time it took
part() {
  local title=$1 limit=$((${TIMEOUT[$1]} * SCALE)) start=$SECONDS
  shift
  if ((SECONDS + limit > BUDGET)); then
    echo "SKIP $title: ${SECONDS} s gone, its ${limit} s timeout would pass the ${BUDGET} s budget; alone: $*"
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
    echo "--cpu: the rehearsal, the CUDA branch's code on the CPU; what only a GPU runs is listed below"
  else
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  fi
  "$PY" - <<'PY'
import importlib, platform, torch
versions = {"python": platform.python_version(), "torch": torch.__version__}
for name in ("triton", "transformers", "pytest", "psutil"):
    try:
        versions[name] = importlib.import_module(name).__version__
    except ImportError:
        versions[name] = "not installed"
print("versions:", " ".join(f"{k} {v}" for k, v in versions.items()), "| cuda:", torch.version.cuda,
      "available" if torch.cuda.is_available() else "not available")
PY
  echo "plan (gpu_check.py --plan: part, predicted GPU seconds, timeout):"
  "$PY" benchmarks/gpu_check.py --plan | sed 's/^/  /'

  echo "== 1. the GPU tests that are not slow"
  if ((CPU)); then
    echo "SKIP GPU tests: needs CUDA (make test runs them on the CPU, the Triton kernels in the interpreter)"
  elif ! "$PY" -c "import pytest" 2>/dev/null; then
    echo "SKIP GPU tests: pytest is not installed here"
  else
    # only the modules that hold GPU tests are collected (another module's optional imports need not be here)
    part "GPU tests" "$PY" -m pytest -q -p no:cacheprovider -m "gpu and not slow" \
      $(grep -l "pytest.mark.gpu" tests/test_*.py)
  fi

  echo "== 2. checks: parity, cache, Hugging Face, training killed and resumed, compiled, peak memory"
  part "checks" "$PY" benchmarks/gpu_check.py --out "$WORK/check" $( ((CPU)) && echo --cpu) \
    ${GPU_CHECKS:+--only $GPU_CHECKS}

  echo "== 3. throughput, bfloat16, and CUDA's attention method"
  part "throughput" "$PY" benchmarks/gpu_bench.py --out "$OUT" $( ((CPU)) && echo --cpu)

  echo "== 4. language-model study, GPU scale, a slice: the learning-rate sweep at 12 steps, with the time left"
  if ((CPU)); then
    echo "SKIP study slice: needs CUDA"
  elif [[ -d data/shakespeare && -d data/sotu ]]; then
    part "study slice" "$PY" -m difftransformer repro lm --scale gpu --steps 12 --seeds 1 --part sweep \
      --out "$WORK/lm-gpu-slice" --corpora data/shakespeare data/sotu
    cp "$WORK/lm-gpu-slice/section.md" "$OUT/lm-gpu-slice.md" 2>/dev/null || true
    cp "$WORK/lm-gpu-slice/results.json" "$OUT/lm-gpu-slice.json" 2>/dev/null || true
  else
    echo "SKIP study slice: data/shakespeare and data/sotu were not carried; alone: STEPS=12 bash benchmarks/lm_gpu.sh"
  fi
  echo "gpu.sh: $( ((status)) && echo 'FAILED (see FAIL above)' || echo passed) in ${SECONDS} s"
  exit $status
) 2>&1 | tee "$OUT/gpu.log"
exit "${PIPESTATUS[0]}"
