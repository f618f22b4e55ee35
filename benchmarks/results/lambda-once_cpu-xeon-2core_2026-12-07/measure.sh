#!/bin/bash
# The decode and training-step ratios (DIFF against the standard model, measured side by side in one process by
# difftx bench) before and after lambda became one Python computation per generation: BEFORE is a checkout of the
# commit before the change, AFTER this one; every run a fresh process on 1 thread, the two sides alternating round
# by round, on an otherwise idle machine. Usage: measure.sh BEFORE_CHECKOUT AFTER_CHECKOUT OUT_DIR ROUNDS
set -euo pipefail
before=$1 after=$2 out=$3 rounds=$4
py=$(cd "$after" && pwd)/.venv/bin/python
for round in $(seq 1 "$rounds"); do
  for side in before after; do
    src=$(cd "${!side}" && pwd)
    for preset in tiny small; do
      (cd "$out" && PYTHONPATH=$src $py -m difftransformer bench decode --preset $preset --context 512 --tokens 64 \
        --repeats 5 --threads 1 --json "decode-$preset-$side-$round.json") > "$out/decode-$preset-$side-$round.txt" 2>&1
    done
    if [ "$round" -le 4 ]; then
      (cd "$out" && PYTHONPATH=$src $py -m difftransformer bench train --preset tiny --seq 256 --repeats 5 --threads 1 \
        --json "train-tiny-$side-$round.json") > "$out/train-tiny-$side-$round.txt" 2>&1
    fi
  done
done
