"""Activation bytes of the train benchmark's models, measured as `saved_activation_bytes` does after issue #15 (views of
parameters, such as a linear layer's saved weight.t(), excluded), on the code of another checkout:

    .venv/bin/python remeasure_activations.py CHECKOUT OUT.json

It imports difftransformer from CHECKOUT (ahead of this environment's editable install), so the "before" code's
models are measured with the corrected measure; step times are not measured.
"""

import json
import sys

root = sys.argv[1]
sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path.insert(0, root)

import torch  # noqa: E402

import difftransformer  # noqa: E402
from difftransformer.apps.bench import _lm_loss  # noqa: E402
from difftransformer.core.config import ModelConfig  # noqa: E402
from difftransformer.core.model import TransformerLM  # noqa: E402
from difftransformer.interop.hf import to_hf  # noqa: E402

assert difftransformer.__file__.startswith(root), difftransformer.__file__


def saved(step):
    storages = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter) and not isinstance(t._base, torch.nn.Parameter):
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    loss.backward()
    return sum(storages.values())


SHAPES = [("small", 256, 4), ("small", 1024, 4), ("small", 2048, 4), ("small", 4096, 1), ("medium", 256, 4),
          ("medium", 1024, 4), ("medium", 4096, 1)]  # fmt: skip
rows = []
for preset, t, batch in SHAPES:
    torch.manual_seed(0)
    models = {a: TransformerLM(ModelConfig.preset(preset, attention=a, max_seq_len=t)) for a in ("diff", "standard")}
    hf = to_hf(models["diff"]).train()
    hf.config._attn_implementation = "sdpa"
    models["hf-diffllama"] = hf
    x = torch.randint(0, models["diff"].config.vocab_size, (batch, t))
    mem = {n: saved(lambda m=m, x=x: _lm_loss(m, x)) for n, m in models.items()}
    rows.append(dict(preset=preset, seq=t, batch=batch, activation_bytes=mem))
    print(preset, t, batch, {n: round(v / 2**20, 1) for n, v in mem.items()}, flush=True)
with open(sys.argv[2], "w") as f:
    json.dump(rows, f, indent=1)
