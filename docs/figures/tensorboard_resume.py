"""Makes tensorboard_resume.png: a tiny DIFF run logged with `--log-to jsonl,tensorboard`, stopped after step 70 (its
checkpoint is at step 50), resumed to step 120, and plotted from its TensorBoard event files alone (read with
TensorBoard's EventAccumulator). The resumed run is one curve: steps 51 to 70 appear once, with the values of the
resume. Run from the repository root: .venv/bin/python docs/figures/tensorboard_resume.py (about a minute on 2 cores).
"""

import itertools
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator  # noqa: E402

from difftransformer.store import corpus  # noqa: E402
from difftransformer.store.data import prepare  # noqa: E402
from difftransformer.store.tokenizer import ByteTokenizer  # noqa: E402
from difftransformer.training.config import TrainConfig, resume_config  # noqa: E402
from difftransformer.training.loop import Trainer  # noqa: E402

OUT = Path(__file__).with_suffix(".png")
STOP, CHECKPOINT, STEPS = 70, 50, 120

with tempfile.TemporaryDirectory() as tmp:
    data, run = Path(tmp) / "data", Path(tmp) / "run"
    prepare(itertools.islice(corpus.pydocs_documents(), 400), ByteTokenizer(), data)
    cfg = TrainConfig(
        data=str(data), out=str(run), preset="tiny", attention="diff", seq_len=128, batch_size=8, max_steps=STEPS,
        lr=3e-3, eval_interval=10, eval_tokens=1 << 14, log_interval=2, ckpt_interval=CHECKPOINT, threads=1,
        log_to="jsonl,tensorboard",
    )  # fmt: skip
    trainer = Trainer(cfg, quiet=True)
    trainer.fit(until=STOP)  # as if stopped here: steps 51-70 were logged, then trained again by the resume
    trainer.close()
    trainer = Trainer(resume_config(run), resume=True, quiet=True)
    trainer.fit()
    trainer.close()
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={SCALARS: 0})
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}

steps = [s for s, _ in scalars["train/loss"]]
assert steps == sorted(set(steps)), "a step appears twice"
fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6), constrained_layout=True)
left.plot(*zip(*scalars["train/loss"], strict=True), color="tab:red", lw=1.2, label="train/loss")
left.plot(*zip(*scalars["val/loss"], strict=True), "o-", color="black", ms=3, lw=1, label="val/loss")
for ax in (left, right):
    ax.axvline(CHECKPOINT, color="grey", ls="--", lw=1)
    ax.axvspan(CHECKPOINT, STOP, color="grey", alpha=0.12, lw=0)
    ax.set_xlabel("step")
note = f" resumed from step {CHECKPOINT};\n steps {CHECKPOINT + 1}-{STOP} trained again"
left.text(CHECKPOINT + 1, left.get_ylim()[1], note, va="top", fontsize=8)
left.set_ylabel("loss (nats per token)")
left.legend(loc="center right", fontsize=8)
left.set_title("one run, stopped at step 70 and resumed", fontsize=10)
layers = sorted(tag for tag in scalars if tag.startswith("lambda/"))
for i, tag in enumerate(layers):
    right.plot(*zip(*scalars[tag], strict=True), lw=1.2, color=plt.cm.Reds(0.35 + 0.6 * i / max(1, len(layers) - 1)),
               label=tag)  # fmt: skip
right.set_ylabel("lambda")
right.legend(fontsize=7, ncol=2)
right.set_title("lambda per layer (from the same event files)", fontsize=10)
fig.savefig(OUT, dpi=110)
print(f"wrote {OUT.name}: {len(steps)} training points, one per logged step")
