#!/usr/bin/env bash
# The CPU benchmarks of the speed-and-memory work (issue #15), one thread, float32, for the checkout on PYTHONPATH
# (default: this one): `bash benchmarks/cpu.sh OUTDIR [LABEL]`. Run it alone on the machine (about 15 minutes on a
# 2-core EPYC); to compare two commits, run it once per checkout with PYTHONPATH pointing at each, one after the other.
set -euo pipefail
out=${1:?usage: benchmarks/cpu.sh OUTDIR [LABEL]}
label=${2:-run}
mkdir -p "$out"
py=${PYTHON:-.venv/bin/python}
export PYTHONPATH=${PYTHONPATH:-$PWD}
bench() { "$py" -m difftransformer bench "$@" --threads 1; }
{
  date -u; echo "label $label, code $(git -C "$PYTHONPATH" rev-parse --short HEAD 2>/dev/null || echo '?')"
  bench attention --seq 1024 2048 4096 --repeats 3 --json "$out/attention_$label.json"
  bench train --preset small --seq 256 1024 2048 --batch 4 --repeats 2 --json "$out/train-small_$label.json"
  bench train --preset small --seq 4096 --batch 1 --repeats 1 --json "$out/train-small-T4096_$label.json"
  bench train --preset medium --seq 256 1024 --batch 4 --repeats 2 --json "$out/train-medium_$label.json"
  bench train --preset medium --seq 4096 --batch 1 --repeats 1 --json "$out/train-medium-T4096_$label.json"
  bench decode --preset small --context 512 2048 --repeats 2 --json "$out/decode-small_$label.json"
} 2>&1 | tee "$out/$label.log"
