#!/bin/bash
# A standard tiny model trained as make demo trains it, converted to DIFF (lambda -1, and lambda 0 for comparison),
# then trained 100 steps from the conversion; validation loss (nats per byte token) on the corpus's validation split.
set -euo pipefail
R=$1
export OMP_NUM_THREADS=2
difftx() { .venv/bin/difftx "$@"; }
difftx data prepare --out "$R/data"
difftx train --config configs/demo-standard.toml --data "$R/data" --out "$R/standard" --quiet
difftx convert --run "$R/standard" --to hf --out "$R/hf-standard"
difftx convert --from-hf "$R/hf-standard" --attention diff --out "$R/diff-from-standard"
.venv/bin/python - "$R" <<'PY'
import sys
from difftransformer import load_run
from difftransformer.interop.convert import _calibration_tokens
from difftransformer.interop.hf import calibrate_subln, diff_from_standard
from difftransformer.training.config import TrainConfig
from difftransformer.training.evaluate import loss_and_bits_per_byte
from difftransformer.training.loop import Trainer
R = sys.argv[1]
t = Trainer(TrainConfig(data=f"{R}/data", out=f"{R}/diff-tuned", init_from=f"{R}/diff-from-standard", max_steps=100,
                        lr=1e-3, batch_size=16, seq_len=256, eval_interval=100, warmup_steps=10, seed=0))
standard, tok = load_run(f"{R}/standard")
standard.eval()
def loss(model):
    model.eval()
    return loss_and_bits_per_byte(model, t.val_windows, t.token_bytes, amp=t.amp, device=t.world.device)[0]
print(f"standard (trained as make demo): {loss(standard):.4f}")
print(f"converted to DIFF, lambda -1 (difftx convert): {loss(t.model):.4f}")
zero = diff_from_standard(standard, lambda_start=0.0)
calibrate_subln(zero, standard, _calibration_tokens(tok, zero.config.max_seq_len))
print(f"converted to DIFF, lambda 0: {loss(zero):.4f}")
t.model.train()
t.fit()
print(f"converted to DIFF, lambda -1, after 100 steps at lr 1e-3: {t.validate()[0]:.4f}")
PY
