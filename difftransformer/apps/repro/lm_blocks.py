"""What each block of a language model writes into its residual stream, and the gradients its attention gets: the
measurements behind the long study's explanation of the per-head norm (``difftx repro lm --part long``).

Per layer, over every position of some fixed windows:

- ``stream``: the RMS of the residual stream entering the block;
- ``core``: the RMS of the attention core's per-head output before the per-head norm (DIFF: ``A = (P1 - lambda P2)
  V``; standard and V2: their heads' output);
- ``heads``: the RMS of the heads as ``out_proj`` reads them: after the norm and its ``1 - lambda_init`` factor (DIFF),
  after the factor alone (DIFF without the norm), the core itself (standard, V2);
- ``attn`` and ``ffn``: the RMS of the attention and feed-forward blocks' outputs, what each adds to the stream;
- ``lambda``: the layer's lambda (V1 models; None otherwise);
- ``grad``: the gradient norm of each attention parameter (and ``ffn``: of the feed-forward block's) for the mean
  next-token loss on the same windows. The gradients are cleared afterwards: measuring does not change training.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from difftransformer.training.distributed import unwrap

STATS = ("stream", "core", "heads", "attn", "ffn")


def block_stats(model: torch.nn.Module, windows: torch.Tensor) -> list[dict]:
    """One record per layer of ``model`` (a TransformerLM) on ``windows`` ((N, T + 1) token ids, on the model's
    device): the RMS values of ``STATS``, lambda and the attention's gradient norms (see the module docstring)."""
    model = unwrap(model)
    sums: dict[tuple[int, str], list[torch.Tensor]] = {}

    def record(layer: int, name: str, x: torch.Tensor) -> None:
        x = x.detach().double()
        sums.setdefault((layer, name), []).append(torch.stack([x.square().sum(), torch.tensor(x.numel())]))

    hooks = []
    for i, block in enumerate(model.layers):
        attn = block.attn
        hooks += [
            block.register_forward_pre_hook(lambda m, args, i=i: record(i, "stream", args[0])),
            attn.register_forward_hook(lambda m, args, out, i=i: record(i, "attn", out)),
            block.ffn.register_forward_hook(lambda m, args, out, i=i: record(i, "ffn", out)),
            attn.out_proj.register_forward_pre_hook(lambda m, args, i=i: record(i, "heads", args[0])),
        ]
        if getattr(attn, "subln", None) is not None:  # the per-head norm's input is the core's output
            hooks.append(attn.subln.register_forward_pre_hook(lambda m, args, i=i: record(i, "core", args[0])))
    try:
        x, y = windows[:, :-1], windows[:, 1:]
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
    layers = []
    for i, block in enumerate(model.layers):
        rms = {name: _rms(sums[i, name]) for name in STATS if (i, name) in sums}
        attn = block.attn
        if "core" not in rms:  # no per-head norm: the heads are the core, scaled by 1 - lambda_init in DIFF
            rms["core"] = rms["heads"] / (1 - attn.lambda_init) if hasattr(attn, "lambda_init") else rms["heads"]
        lam = float(attn.lambda_full().detach()) if hasattr(attn, "lambda_init") else None
        grads = {name: _norm(p.grad) for name, p in attn.named_parameters() if p.grad is not None}
        grads = _grouped(grads)
        grads["ffn"] = _norm(torch.cat([p.grad.flatten() for p in block.ffn.parameters()]))
        layers.append({**{k: rms[k] for k in STATS}, "lambda": lam, "grad": grads})
    model.zero_grad(set_to_none=True)
    return layers


def _rms(parts: list[torch.Tensor]) -> float:
    total = torch.stack(parts).sum(0)
    return math.sqrt(float(total[0]) / float(total[1]))


def _norm(grad: torch.Tensor) -> float:
    return float(grad.detach().double().norm())


def _grouped(grads: dict[str, float]) -> dict[str, float]:
    """The four lambda vectors' gradient norms as one ("lambda"), ``subln.weight`` as "subln", projections by name."""
    out: dict[str, float] = {}
    lam = [v for k, v in grads.items() if k.startswith("lambda_") and k != "lambda_proj.weight"]
    for name, value in grads.items():
        if name.startswith("lambda_") and name != "lambda_proj.weight":
            continue
        out[name.removesuffix(".weight")] = value
    if lam:
        out["lambda"] = math.sqrt(sum(v * v for v in lam))
    return out
