"""Exact attention kernels shared by the attention modules.

Shapes (PAPER.md section 1): ``H`` differential heads, ``Hkv`` key/value groups, ``rep = H // Hkv``,
half-head size ``d``.

    q: (B, H, 2, Tq, d)    component c of differential head h is q[:, h, c]
    k: (B, Hkv, 2, Tk, d)  query head h reads group h // rep, component c for map c
    v: (B, Hkv, Tk, 2d)    one 2d-wide value per group, shared by both maps

Masking: ``causal`` lets query i see key j when ``j <= i + (Tk - Tq)`` (queries are the last Tq
positions, as when decoding from a cache). ``mask`` is an optional boolean tensor broadcastable to
(B, 1, Tq, Tk), True where a query may attend. A query that may attend nothing (a left-padding
position) gets an all-zero row and output, never NaN, as PyTorch's SDPA does with a boolean mask.
Scores and softmax are computed in float32 (float64 for float64 inputs).

Three exact methods for differential attention, chosen by ``impl``:

- ``sdpa`` (the default on CPU): one fused ``scaled_dot_product_attention`` call over the 2H
  half-heads. Fused CPU kernels need equal query and value widths, so q and k are zero-padded from d
  to 2d (scores unchanged, scale passed explicitly) and each group's 2d-wide V serves both maps.
  It does twice the baseline's attention-core work, but inside a fused kernel; measured faster on
  CPU than the methods below (see README). Never materialises a (T, T) map.

- ``plain``: materialises both (Tq, Tk) softmax maps of every head in float32; used for analysis
  (``need_weights``) and as the readable reference.
- ``block``: processes query blocks with full key rows, so both softmax normalisers are known before
  touching V and ``(P1 - lambda P2) @ V`` is applied once (PAPER.md section 4: the attention core costs
  what the baseline's does, with no 1.5x penalty of two online-softmax passes). Keys are read once per
  group, not repeated for GQA. A custom backward recomputes each block from the saved log-sum-exp, so
  training never holds the whole (T, T) maps either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MASK_VALUE = torch.finfo(torch.float32).min
# Elements of one block's score tensor (B * 2H * block * Tk float32 values): 8M = 32 MiB.
BLOCK_ELEMENTS = 1 << 23
DIFF_IMPLS = ("auto", "sdpa", "block", "plain")


def attention_probs(
    q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, mask: torch.Tensor | None
) -> torch.Tensor:
    """softmax(q k^T * scale) in float32 with masking. q: (B, N, Tq, d), k: (B, N, Tk, d) -> (B, N, Tq, Tk)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).to(softmax_dtype(q)) * scale
    allowed = _full_allowed(q.shape[-2], k.shape[-2], causal, mask, q.device)
    if allowed is None:
        return torch.softmax(scores, dim=-1)
    probs = torch.softmax(scores.masked_fill(~allowed, MASK_VALUE), dim=-1)
    return probs.masked_fill(~allowed.any(-1, keepdim=True), 0.0)


def softmax_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for half and single precision inputs, float64 for float64 (the exactness tests)."""
    return torch.promote_types(x.dtype, torch.float32)


def _full_allowed(tq, tk, causal, mask, device):
    allowed = None
    if causal:
        allowed = torch.ones(tq, tk, dtype=torch.bool, device=device).tril(tk - tq)
    if mask is not None:
        allowed = mask if allowed is None else allowed & mask
    return allowed


def diff_attention_plain(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lambda_full: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differential attention with materialised maps. Returns (out (B, H, Tq, 2d), map (B, H, Tq, Tk))."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)  # (B, H, 2, Tk, d): head h reads group h // rep
    v = v.repeat_interleave(rep, dim=1)  # (B, H, Tk, 2d)
    probs = attention_probs(q, k, scale, causal, None if mask is None else mask[:, :, None])
    diff_map = probs[:, :, 0] - lambda_full * probs[:, :, 1]  # (B, H, Tq, Tk)
    return torch.matmul(diff_map.to(v.dtype), v), diff_map


class _BlockDiffAttention(torch.autograd.Function):
    """Block-exact differential attention: full key rows per query block, recomputed in backward."""

    @staticmethod
    def forward(ctx, q, k, v, lambda_full, scale, causal, mask, block):
        b, h, _, tq, d = q.shape
        hkv, tk = k.shape[1], k.shape[3]
        rep = h // hkv
        qg = q.view(b, hkv, rep, 2, tq, d).transpose(2, 3)  # (B, Hkv, 2, rep, Tq, d)
        lam = lambda_full.to(softmax_dtype(q))
        out = v.new_empty(b, hkv, rep, tq, v.shape[-1])
        lse = q.new_empty(b, hkv, 2, rep, tq, dtype=lam.dtype)
        for i0, i1, kend, allowed, q_blk in _blocks(qg, tk, causal, mask, block):
            scores = _block_scores(q_blk, k[:, :, :, :kend], scale, allowed)
            lse_blk = torch.logsumexp(scores, dim=-1, keepdim=True)  # (B, Hkv, 2, rep, bq, 1)
            if mask is not None:  # rows that may attend nothing: lse = inf makes their probabilities 0
                lse_blk = lse_blk.masked_fill(~allowed.any(-1, keepdim=True), float("inf"))
            probs = torch.exp(scores - lse_blk)
            diff = probs[:, :, 0] - lam * probs[:, :, 1]  # (B, Hkv, rep, bq, kend)
            out[:, :, :, i0:i1] = torch.matmul(diff.flatten(2, 3).to(v.dtype), v[:, :, :kend]).view_as(
                out[:, :, :, i0:i1]
            )
            lse[..., i0:i1] = lse_blk.squeeze(-1)
        ctx.save_for_backward(q, k, v, lam, lse, mask)
        ctx.scale, ctx.causal, ctx.block = scale, causal, block
        return out.view(b, h, tq, v.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, lam, lse, mask = ctx.saved_tensors
        b, h, _, tq, d = q.shape
        hkv = k.shape[1]
        rep = h // hkv
        qg = q.view(b, hkv, rep, 2, tq, d).transpose(2, 3)
        dout = grad_out.reshape(b, hkv, rep, tq, v.shape[-1])
        acc = lam.dtype  # gradients accumulate in float32 (float64 for float64 inputs)
        dq = torch.zeros(qg.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        dlam = torch.zeros((), dtype=acc, device=q.device)
        for i0, i1, kend, allowed, q_blk in _blocks(qg, k.shape[3], ctx.causal, mask, ctx.block):
            scores = _block_scores(q_blk, k[:, :, :, :kend], ctx.scale, allowed)
            probs = torch.exp(scores - lse[..., i0:i1, None])  # (B, Hkv, 2, rep, bq, kend)
            do = dout[:, :, :, i0:i1].flatten(2, 3)  # (B, Hkv, rep*bq, 2d)
            v_blk = v[:, :, :kend]
            dpv = torch.matmul(do, v_blk.transpose(-1, -2)).to(acc).view(probs[:, :, 0].shape)
            diff = probs[:, :, 0] - lam * probs[:, :, 1]
            dv[:, :, :kend] += torch.matmul(diff.flatten(2, 3).transpose(-1, -2).to(do.dtype), do).to(acc)
            # d(map_c) = +dpv for c = 0 and -lambda * dpv for c = 1; softmax backward per map.
            rowdot = (probs * dpv[:, :, None]).sum(-1, keepdim=True)  # (B, Hkv, 2, rep, bq, 1)
            dlam -= rowdot[:, :, 1].sum()
            sign = torch.stack((torch.ones_like(lam), -lam)).view(1, 1, 2, 1, 1, 1)
            dscores = probs * (dpv[:, :, None] - rowdot) * (sign * ctx.scale)
            ds = dscores.flatten(3, 4).to(q.dtype)  # (B, Hkv, 2, rep*bq, kend)
            dq[:, :, :, :, i0:i1] = torch.matmul(ds, k[:, :, :, :kend]).to(acc).view_as(dq[:, :, :, :, i0:i1])
            dk[:, :, :, :kend] += torch.matmul(ds.transpose(-1, -2), q_blk.flatten(3, 4)).to(acc)
        dq = dq.transpose(2, 3).reshape(q.shape).to(q.dtype)
        return dq, dk.to(k.dtype), dv.to(v.dtype), dlam, None, None, None, None


def _blocks(qg, tk, causal, mask, block):
    """Yield (i0, i1, kend, allowed, q_blk) for each query block of the grouped queries qg."""
    tq = qg.shape[-2]
    offset = tk - tq
    for i0 in range(0, tq, block):
        i1 = min(tq, i0 + block)
        kend = min(tk, i1 + offset) if causal else tk
        allowed = None
        if causal:
            rows = torch.arange(i0 + offset, i1 + offset, device=qg.device)[:, None]
            allowed = torch.arange(kend, device=qg.device)[None, :] <= rows  # (bq, kend)
        if mask is not None:
            m = mask[:, :, None, None, i0:i1, :kend]  # (B|1, 1, 1, 1, bq, kend)
            allowed = m if allowed is None else allowed & m
        yield i0, i1, kend, allowed, qg[..., i0:i1, :]


def _block_scores(q_blk, k_blk, scale, allowed):
    """Scores of one query block, float32: (B, Hkv, 2, rep, bq, kend)."""
    b, hkv, _, rep, bq, d = q_blk.shape
    scores = torch.matmul(q_blk.reshape(b, hkv, 2, rep * bq, d), k_blk.transpose(-1, -2))
    scores = scores.to(softmax_dtype(q_blk)).view(b, hkv, 2, rep, bq, -1) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, MASK_VALUE)
    return scores


def block_size(batch: int, heads: int, tq: int, tk: int) -> int:
    """Query rows per block so that one block's two score maps hold about BLOCK_ELEMENTS values."""
    rows = BLOCK_ELEMENTS // max(1, batch * 2 * heads * tk)
    return max(16, min(tq, rows))


def diff_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lambda_full: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    mask: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Exact differential attention ``(softmax(q1 k1^T) - lambda softmax(q2 k2^T)) v`` -> (B, H, Tq, 2d)."""
    if impl not in DIFF_IMPLS:
        raise ValueError(f"unknown differential attention impl {impl!r}; choose one of {DIFF_IMPLS}")
    if impl == "plain":
        return diff_attention_plain(q, k, v, lambda_full, scale=scale, causal=causal, mask=mask)[0]
    if impl == "block":
        block = block_size(q.shape[0], q.shape[1], q.shape[3], k.shape[3])
        return _BlockDiffAttention.apply(q, k, v, lambda_full, scale, causal, mask, block)
    return _diff_attention_sdpa(q, k, v, lambda_full, scale, causal, mask)


def _diff_attention_sdpa(q, k, v, lambda_full, scale, causal, mask):
    b, h, _, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[3]
    # Half-heads ordered (component, head) so that SDPA's GQA maps query c*H + h to key c*Hkv + h // rep.
    q2 = F.pad(q.transpose(1, 2), (0, d)).reshape(b, 2 * h, tq, 2 * d)
    k2 = F.pad(k.transpose(1, 2), (0, d)).reshape(b, 2 * hkv, tk, 2 * d)
    v2 = v[:, None].expand(b, 2, hkv, tk, 2 * d).reshape(b, 2 * hkv, tk, 2 * d)
    out, _ = standard_attention(q2, k2, v2, scale=scale, causal=causal, mask=mask)
    out = out.view(b, 2, h, tq, 2 * d)
    return out[:, 0] - lambda_full.to(out.dtype) * out[:, 1]  # (B, H, Tq, 2d)


def standard_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    mask: torch.Tensor | None = None,
    need_weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax attention with grouped keys. q: (B, N, Tq, d), k/v: (B, Nkv, Tk, dv) -> (B, N, Tq, dv)."""
    if need_weights:
        rep = q.shape[1] // k.shape[1]
        probs = attention_probs(q, k.repeat_interleave(rep, 1), scale, causal, mask)
        return torch.matmul(probs.to(v.dtype), v.repeat_interleave(rep, 1)), probs
    tq, tk = q.shape[-2], k.shape[-2]
    if mask is None and (not causal or tq == tk):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    else:
        allowed = _full_allowed(tq, tk, causal, mask, q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=True)
    return out, None
