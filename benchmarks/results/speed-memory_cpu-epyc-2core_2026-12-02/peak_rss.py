"""Peak resident memory of two training steps of one model, in a process of its own (ru_maxrss is per process):

    .venv/bin/python peak_rss.py CHECKOUT MODEL PRESET T BATCH     # MODEL: diff, standard or hf (DiffLlama, SDPA)

It imports difftransformer from CHECKOUT (ahead of this environment's editable install), builds the model as
`difftx bench train` does, and prints the process's peak RSS and its rise above the built model (activations,
gradients, AdamW state and transient buffers).

With `--timeline` after BATCH it prints instead what sets the peak (added 2026-12-03): torch's own account of every
CPU tensor of one step after a warm-up step, by the category torch.profiler's memory timeline gives it
(export_memory_timeline; a private module names them: parameters, optimizer state, inputs, activations, i.e. tensors
autograd holds between forward and backward, temporaries, gradients, autograd detail), at the step's allocator peak.
The profiler's own bookkeeping inflates RSS, so the two measurements are separate runs.
"""

import resource
import sys

root, name, preset, t, batch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
timeline = sys.argv[6:] == ["--timeline"]
sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path.insert(0, root)

import torch  # noqa: E402

import difftransformer  # noqa: E402
from difftransformer.apps.bench import _lm_loss  # noqa: E402
from difftransformer.core.config import ModelConfig  # noqa: E402
from difftransformer.core.model import TransformerLM  # noqa: E402

assert difftransformer.__file__.startswith(root), difftransformer.__file__
torch.set_num_threads(1)
torch.manual_seed(0)
model = TransformerLM(ModelConfig.preset(preset, attention="standard" if name == "standard" else "diff", max_seq_len=t))
if name == "hf":
    from difftransformer.interop.hf import to_hf

    model = to_hf(model).train()
    model.config._attn_implementation = "sdpa"
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
x = torch.randint(0, 256, (batch, t))


def _train_step(model, optimizer, x) -> None:
    """The step this record measured (bench train's before it took the trainer's step): a plain AdamW."""
    _lm_loss(model, x).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def print_timeline() -> None:
    import json
    import tempfile
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX

    _train_step(model, optimizer, x)  # the optimizer's state exists from here on
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        _train_step(model, optimizer, x)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "timeline.json"
        prof.export_memory_timeline(str(path), device="cpu")
        _, sizes = json.loads(path.read_text())  # sizes[i]: bytes per category after event i (column 0 unused)
    names = {index + 1: "other" if c is None else c.name.lower() for c, index in _CATEGORY_TO_INDEX.items()}
    totals = [sum(row) for row in sizes]
    peak = max(range(len(totals)), key=totals.__getitem__)
    parts = ", ".join(f"{names[j]} {b / 2**20:.1f}" for j, b in enumerate(sizes[peak]) if j in names and b)
    print(f"{name} {preset} T={t} b={batch}: allocator peak {totals[peak] / 2**20:.0f} MiB at event {peak} of "
          f"{len(totals)} ({parts} MiB)")  # fmt: skip


if timeline:
    print_timeline()
    sys.exit(0)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for _ in range(2):
    _train_step(model, optimizer, x)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
rise = (peak - base) / 1024
print(f"{name} {preset} T={t} b={batch}: peak RSS {peak / 1024:.0f} MiB, above the built model {rise:.0f} MiB")
