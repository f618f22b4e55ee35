"""Peak resident memory of two training steps of one model, in a process of its own (ru_maxrss is per process):

    .venv/bin/python peak_rss.py CHECKOUT MODEL PRESET T BATCH     # MODEL: diff, standard or hf (DiffLlama, SDPA)

It imports difftransformer from CHECKOUT (ahead of this environment's editable install), builds the model as
`difftx bench train` does, and prints the process's peak RSS and its rise above the built model (activations,
gradients, AdamW state and transient buffers).
"""

import resource
import sys

root, name, preset, t, batch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path.insert(0, root)

import torch  # noqa: E402

import difftransformer  # noqa: E402
from difftransformer.apps.bench import _train_step  # noqa: E402
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
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for _ in range(2):
    _train_step(model, optimizer, x)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
rise = (peak - base) / 1024
print(f"{name} {preset} T={t} b={batch}: peak RSS {peak / 1024:.0f} MiB, above the built model {rise:.0f} MiB")
