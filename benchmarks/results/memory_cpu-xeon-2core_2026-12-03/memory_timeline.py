"""What sets the peak of a training step: torch's own account of every CPU tensor of one step (after a warm-up step),
by the category the profiler gives it, at the step's allocator peak.

    .venv/bin/python memory_timeline.py MODEL PRESET T BATCH     # MODEL: diff, standard or hf (DiffLlama, SDPA)

It builds the model as `difftx bench train` does (and as ../speed-memory_cpu-epyc-2core_2026-12-02/peak_rss.py,
which measures the process's peak RSS without the profiler, whose own bookkeeping inflates RSS). The categories are
torch.profiler's memory timeline (export_memory_timeline; a private module names them): parameters, optimizer state,
inputs, activations (tensors autograd holds between forward and backward), temporaries, gradients, autograd detail.
"""

import json
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX

from difftransformer.apps.bench import _train_step
from difftransformer.core.config import ModelConfig
from difftransformer.core.model import TransformerLM

name, preset, t, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(1)
torch.manual_seed(0)
model = TransformerLM(ModelConfig.preset(preset, attention="standard" if name == "standard" else "diff", max_seq_len=t))
if name == "hf":
    from difftransformer.interop.hf import to_hf

    model = to_hf(model).train()
    model.config._attn_implementation = "sdpa"
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
x = torch.randint(0, 256, (batch, t))
_train_step(model, optimizer, x)  # the optimizer's state exists from here on
with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
    _train_step(model, optimizer, x)
with tempfile.TemporaryDirectory() as tmp:
    path = Path(tmp) / "timeline.json"
    prof.export_memory_timeline(str(path), device="cpu")
    times, sizes = json.loads(path.read_text())  # sizes[i]: bytes per category after event i (column 0 unused)
names = {index + 1: "other" if c is None else c.name.lower() for c, index in _CATEGORY_TO_INDEX.items()}
totals = [sum(row) for row in sizes]
peak = max(range(len(totals)), key=totals.__getitem__)
parts = ", ".join(f"{names[j]} {b / 2**20:.1f}" for j, b in enumerate(sizes[peak]) if j in names and b)
print(f"{name} {preset} T={t} b={batch}: allocator peak {totals[peak] / 2**20:.0f} MiB at event {peak} of "
      f"{len(totals)} ({parts} MiB)")  # fmt: skip
