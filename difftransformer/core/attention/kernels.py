"""Exact attention kernels shared by the attention modules.

Shapes (docs/paper.md section 1): ``H`` differential heads, ``Hkv`` key/value groups, ``rep = H // Hkv``,
half-head size ``d``.

    q: (B, H, 2, Tq, d)    component c of differential head h is q[:, h, c]
    k: (B, Hkv, 2, Tk, d)  query head h reads group h // rep, component c for map c
    v: (B, Hkv, Tk, 2d)    one 2d-wide value per group, shared by both maps

Masking: ``causal`` lets query i see key j when ``j <= i + (Tk - Tq)`` (queries are the last Tq
positions, as when decoding from a cache). ``mask`` is an optional boolean tensor broadcastable to
(B, 1, Tq, Tk), True where a query may attend. A query that may attend nothing (a left-padding
position) gets an all-zero row and output, never NaN, as PyTorch's SDPA does with a boolean mask.
Scores and softmax are computed in float32 (float64 for float64 inputs).

Exact methods for differential attention, chosen by ``impl``:

- ``sdpa`` (``auto`` on GPUs, and on CPU for half-heads under 64 and fewer than 64 queries, 128 without the fused
  CPU kernel): one fused ``scaled_dot_product_attention`` call over the 2H half-heads. Fused kernels need equal
  query and value widths, so q and k are zero-padded from d to 2d (scores unchanged, scale passed explicitly) and
  each group's 2d-wide V serves both maps: twice the baseline's attention-core work, inside a fused kernel.
  Never materialises a (T, T) map.
- ``plain``: materialises both (Tq, Tk) softmax maps of every head in float32: ``diff.differential_attention``,
  the readable method, used for analysis (``need_weights``) and under a logit probe.
- ``block`` (``auto`` on CPU for half-heads of 64 or more, or 64 queries or more with the fused kernel, 128
  without): processes blocks of 64 query rows with full key rows, so both softmax normalisers are known before
  touching V and ``(P1 - lambda P2) @ V`` is applied once (docs/paper.md section 4: the attention core does the
  baseline's arithmetic, with no 1.5x penalty of two online-softmax passes). Keys and values are read once per
  group, not repeated for GQA. A custom backward recomputes each block's softmax rows from q and k, so
  training never holds the whole (T, T) maps either. On CPU in float32 or float64 it runs as one fused C++
  kernel (``cpu_kernel.py``, built from source at first use), which also returns A token-major so that the
  per-head norm and out_proj read it without a transposed copy; otherwise (no compiler, other dtypes, under
  torch.compile, other devices) as the PyTorch operations of ``_BlockDiffAttention``.
- ``triton`` (opt-in, CUDA, ``pip install 'difftransformer[triton]'``): forward and backward Triton kernels that
  read K and V once for both maps (``triton_diff.py``). Inputs the kernels do not handle (a boolean mask,
  other head sizes or dtypes) take the ``auto`` path. Not chosen by ``auto``: no measurement on a GPU shows it
  faster yet.

Which method ``auto`` takes is the device's choice (``devices.choices``: ``attention`` and ``decode``), so that the GPU
rehearsal runs the CUDA branch's methods on CPU tensors.

Decoding (``auto``, at most DECODE_ROWS queries, no gradient) computes the full rows directly: on CPU in float32 or
float64 through the fused decode kernel (``cpu_kernel.fused_decode``, eager and under torch.compile), which reads
each cached key and value once per key/value group for both maps and every query head of the group, and only up to
each row's last visible slot.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from difftransformer.core.attention import cpu_kernel
from difftransformer.core.attention.logits import active_probe
from difftransformer.devices import choices
from difftransformer.errors import InputError, install_hint

MASK_VALUE = torch.finfo(torch.float32).min
# Query rows per block of the block method (64 measured fastest on a 2-core CPU, forward and backward),
# fewer when one block's score tensor (B * 2H * rows * Tk float32 values) would exceed 8M values = 32 MiB.
BLOCK_ROWS = 64
BLOCK_ELEMENTS = 1 << 23
# On CPU the block method beats the fused sdpa path (which does 2x the arithmetic) from 128 query rows on, at every
# head size: training steps of the small preset (half-heads of 16), batch 4, block/sdpa 0.85 at T = 256 and 0.76 at
# T = 512; tiny preset at T = 256 0.91; at T = 64 the two tie (1.00 at d = 16, 1.04 at d = 8), so sdpa stays below.
# The fused kernel (cpu_kernel.py) moves the crossing to 64 rows (attention core, forward and backward, batch 8,
# block/sdpa 0.54 at T = 64 with d = 16 and 0.56 with d = 32; at T = 32, batch 16, 1.67: its per-head matrix
# products are too small there).
BLOCK_MIN_HEAD_DIM = 64
BLOCK_MIN_ROWS = 128
KERNEL_MIN_ROWS = 64
# Without gradients and with at most this many query rows (decoding from a KV cache), ``auto`` computes full
# rows directly: each group's keys and its 2d-wide values are read once per token for both maps.
DECODE_ROWS = 16


def attention_probs(
    q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, mask: torch.Tensor | None
) -> torch.Tensor:
    """softmax(q k^T * scale) in float32 with masking. q: (B, N, Tq, d), k: (B, N, Tk, d) -> (B, N, Tq, Tk).

    Inside a ``logit_probe`` context the probe sees (and may replace) the scores before the softmax."""
    scores = torch.matmul(q, k.transpose(-1, -2)).to(softmax_dtype(q)) * scale
    allowed = _full_allowed(q.shape[-2], k.shape[-2], causal, mask, q.device)
    probe = active_probe()
    if probe is not None:
        scores = probe(scores, allowed)
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


class _BlockDiffAttention(torch.autograd.Function):
    """Block-exact differential attention: full key rows per query block, recomputed in backward.

    q is pre-scaled once, the causal mask touches only each block's diagonal square, and the big
    per-block tensors are updated in place: on CPU the elementwise passes over (rows, T) cost more than
    the matrix products, so each one saved counts.
    """

    @staticmethod
    def forward(ctx, q, k, v, lambda_full, scale, causal, mask, block):
        b, h, _, tq, d = q.shape
        hkv, tk = k.shape[1], k.shape[3]
        rep = h // hkv
        qg = (q * scale).view(b, hkv, rep, 2, tq, d).transpose(2, 3).contiguous()  # (B, Hkv, 2, rep, Tq, d), scaled
        lam = lambda_full.to(softmax_dtype(q))
        out = v.new_empty(b, hkv, rep, tq, v.shape[-1])
        for i0, i1, kend in _blocks(tq, tk, causal, block):
            probs = _block_probs(qg[..., i0:i1, :], k[:, :, :, :kend], causal, mask, i0, tk - tq)
            diff = torch.addcmul(probs[:, :, 0], probs[:, :, 1], lam, value=-1)  # (B, Hkv, rep, bq, kend)
            out[:, :, :, i0:i1] = torch.matmul(diff.flatten(2, 3).to(v.dtype), v[:, :, :kend]).view_as(
                out[:, :, :, i0:i1]
            )
        ctx.save_for_backward(qg, k, v, lam, mask)
        ctx.scale, ctx.causal, ctx.block, ctx.q_shape = scale, causal, block, q.shape
        return out.view(b, h, tq, v.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        qg, k, v, lam, mask = ctx.saved_tensors
        b, hkv, _, rep, tq, d = qg.shape
        tk = k.shape[3]
        dout = grad_out.reshape(b, hkv, rep, tq, v.shape[-1])
        acc = lam.dtype  # gradients accumulate in float32 (float64 for float64 inputs)
        dq = torch.empty(qg.shape, dtype=acc, device=qg.device)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        dlam = torch.zeros((), dtype=acc, device=qg.device)
        for i0, i1, kend in _blocks(tq, tk, ctx.causal, ctx.block):
            q_blk = qg[..., i0:i1, :]
            probs = _block_probs(q_blk, k[:, :, :, :kend], ctx.causal, mask, i0, tk - tq)  # recomputed
            do = dout[:, :, :, i0:i1].flatten(2, 3)  # (B, Hkv, rep*bq, 2d)
            v_blk = v[:, :, :kend]
            diff = torch.addcmul(probs[:, :, 0], probs[:, :, 1], lam, value=-1).flatten(2, 3)
            dv[:, :, :kend] += torch.matmul(diff.transpose(-1, -2).to(do.dtype), do).to(acc)
            dpv = torch.matmul(do, v_blk.transpose(-1, -2)).to(acc).view(probs[:, :, 0].shape)
            # map 1 receives dpv and map 2 receives -lambda * dpv; softmax backward of each map:
            dscores = probs * dpv[:, :, None]  # P_c dP, then minus P_c rowsum(P_c dP), in place
            rowdot = dscores.sum(-1, keepdim=True)  # (B, Hkv, 2, rep, bq, 1)
            dlam -= rowdot[:, :, 1].sum()
            dscores.addcmul_(probs, rowdot, value=-1)
            dscores[:, :, 1].mul_(-lam)
            ds = dscores.flatten(3, 4).to(qg.dtype)  # (B, Hkv, 2, rep*bq, kend)
            dq[..., i0:i1, :] = torch.matmul(ds, k[:, :, :, :kend]).to(acc).view_as(q_blk) * ctx.scale
            dk[:, :, :, :kend] += torch.matmul(ds.transpose(-1, -2), q_blk.flatten(3, 4)).to(acc)
        dq = dq.transpose(2, 3).reshape(ctx.q_shape).to(qg.dtype)
        return dq, dk.to(k.dtype), dv.to(v.dtype), dlam, None, None, None, None


def _blocks(tq, tk, causal, block):
    """Yield (i0, i1, kend): query rows i0:i1 and the keys 0:kend they can reach."""
    offset = tk - tq
    for i0 in range(0, tq, block):
        i1 = min(tq, i0 + block)
        yield i0, i1, (min(tk, i1 + offset) if causal else tk)


def _block_probs(q_blk, k_blk, causal, mask, i0, offset):
    """Both maps' softmax rows of one block: (B, Hkv, 2, rep, bq, kend), zero rows where nothing may be attended.

    One fused softmax per block (on CPU cheaper than log-sum-exp, subtract and exp as separate passes), so the
    backward recomputes the rows from q and k alone, with nothing saved per row.
    """
    scores, empty = _block_scores(q_blk, k_blk, causal, mask, i0, offset)
    probs = torch.softmax(scores, dim=-1)
    return probs if empty is None else probs.masked_fill_(empty, 0.0)


def _block_scores(q_blk, k_blk, causal, mask, i0, offset):
    """Masked scores of one block of (pre-scaled) queries, float32: (B, Hkv, 2, rep, bq, kend).

    Also returns, when a mask is given, which rows may attend nothing ((B|1, 1, 1, 1, bq, 1) bool).
    """
    b, hkv, _, rep, bq, d = q_blk.shape
    kend = k_blk.shape[-2]
    scores = torch.matmul(q_blk.reshape(b, hkv, 2, rep * bq, d), k_blk.transpose(-1, -2))
    scores = scores.to(softmax_dtype(q_blk)).view(b, hkv, 2, rep, bq, kend)
    empty = None
    if mask is not None:
        allowed = mask[:, :, None, None, i0 : i0 + bq, :kend]  # (B|1, 1, 1, 1, bq, kend)
        if causal:
            rows = torch.arange(i0 + offset, i0 + offset + bq, device=scores.device)[:, None]
            allowed = allowed & (torch.arange(kend, device=scores.device)[None, :] <= rows)
        scores.masked_fill_(~allowed, MASK_VALUE)
        empty = ~allowed.any(-1, keepdim=True)
    elif causal:  # only the diagonal square [i0 + offset, kend) has keys after some query of the block
        start = max(0, i0 + offset)
        future = torch.ones(bq, kend - start, dtype=torch.bool, device=scores.device).triu(i0 + offset - start + 1)
        scores[..., start:].masked_fill_(future, MASK_VALUE)
    return scores, empty


def block_size(batch: int, heads: int, tq: int, tk: int) -> int:
    """Query rows per block: BLOCK_ROWS (measured fastest on CPU), fewer when one block's two score maps
    would exceed BLOCK_ELEMENTS values."""
    rows = BLOCK_ELEMENTS // max(1, batch * 2 * heads * tk)
    return max(16, min(tq, BLOCK_ROWS, rows))


def diff_method(impl: str) -> Callable[..., torch.Tensor]:
    """The exact method ``impl`` (auto, sdpa, block or triton) as a function ``(q, k, v, lambda_full, *, scale,
    causal, mask) -> A``; the modules choose it once, when they are built (``plain``, the materialised method, is
    ``diff.differential_attention``)."""
    if impl not in METHODS:
        raise InputError(f"unknown fast differential attention method {impl!r}; choose one of {tuple(METHODS)}")
    return METHODS[impl]


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
    """Exact differential attention ``(softmax(q1 k1^T) - lambda softmax(q2 k2^T)) v`` by a fast method, without
    holding the (T, T) maps (see the module docstring for the methods).

    Args:
        q: the queries, (B, H, 2, Tq, d).
        k: the keys, (B, Hkv, 2, Tk, d).
        v: the values, (B, Hkv, Tk, 2d).
        lambda_full: the layer's lambda, a scalar tensor.
        scale: the logits' factor, 1 / sqrt(d) in the paper.
        causal: a query attends only to keys at or before its position.
        mask: boolean (B, Tk) or (B, Tq, Tk), True where attention is allowed.
        impl: ``auto``, ``block``, ``sdpa`` or ``triton``; all give the same result.

    Returns:
        A, (B, H, Tq, 2d).

    Examples:
        >>> import torch
        >>> q, k, v = torch.randn(1, 2, 2, 5, 8), torch.randn(1, 2, 2, 5, 8), torch.randn(1, 2, 5, 16)
        >>> block = diff_attention(q, k, v, torch.tensor(0.5), scale=8**-0.5, impl="block")
        >>> sdpa = diff_attention(q, k, v, torch.tensor(0.5), scale=8**-0.5, impl="sdpa")
        >>> block.shape, torch.allclose(block, sdpa, atol=1e-5)
        (torch.Size([1, 2, 5, 16]), True)
    """
    return diff_method(impl)(q, k, v, lambda_full, scale=scale, causal=causal, mask=mask)


def _auto(q, k, v, lambda_full, *, scale, causal=True, mask=None):
    """Decoding rows without gradient read K and V once; on CPU the block method from BLOCK_MIN_HEAD_DIM or
    BLOCK_MIN_ROWS on (KERNEL_MIN_ROWS with the fused kernel); otherwise the fused sdpa path."""
    if q.shape[3] <= DECODE_ROWS and not torch.is_grad_enabled():
        return _diff_decode(q, k, v, lambda_full, scale, causal, mask)
    attention = choices(q.device).attention
    if attention == "triton" and _triton_applies(q, k, v, lambda_full, causal, mask):
        from . import triton_diff

        return triton_diff.diff_attention_triton(q, k, v, lambda_full, scale, causal)
    if attention in ("sdpa", "triton"):
        return _sdpa(q, k, v, lambda_full, scale=scale, causal=causal, mask=mask)
    min_rows = KERNEL_MIN_ROWS if cpu_kernel.supported(q, k, v) else BLOCK_MIN_ROWS
    method = _block if q.shape[-1] >= BLOCK_MIN_HEAD_DIM or q.shape[3] >= min_rows else _sdpa
    return method(q, k, v, lambda_full, scale=scale, causal=causal, mask=mask)


def _block(q, k, v, lambda_full, *, scale, causal=True, mask=None):
    """The fused CPU kernel where it is built and applies (``cpu_kernel.py``), else the same method in PyTorch."""
    if mask is not None:  # both read the mask by query rows: a broadcast query axis is expanded (a view)
        mask = mask.expand(mask.shape[0], 1, q.shape[3], k.shape[3])
    if cpu_kernel.supported(q, k, v):
        return cpu_kernel.fused_block(q, k, v, lambda_full, scale, causal, mask, BLOCK_ROWS)
    return _block_torch(q, k, v, lambda_full, scale=scale, causal=causal, mask=mask)


def _block_torch(q, k, v, lambda_full, *, scale, causal=True, mask=None):
    block = block_size(q.shape[0], q.shape[1], q.shape[3], k.shape[3])
    return _BlockDiffAttention.apply(q, k, v, lambda_full, scale, causal, mask, block)


def _sdpa(q, k, v, lambda_full, *, scale, causal=True, mask=None):
    return _diff_attention_sdpa(q, k, v, lambda_full, scale, causal, mask)


def _triton(q, k, v, lambda_full, *, scale, causal=True, mask=None):
    """The Triton kernels where they apply; other inputs (a boolean mask, other head sizes or dtypes) take ``auto``."""
    try:  # optional dependency, imported on first use
        from . import triton_diff
    except ImportError as err:
        raise ImportError(
            f"attention impl 'triton' needs Triton: {install_hint('triton')} (or use impl 'auto')"
        ) from err
    if triton_diff.supported(q, k, v, lambda_full, causal, mask):
        return triton_diff.diff_attention_triton(q, k, v, lambda_full, scale, causal)
    return _auto(q, k, v, lambda_full, scale=scale, causal=causal, mask=mask)


def _triton_applies(q, k, v, lambda_full, causal, mask) -> bool:
    """Whether the Triton kernels are installed and handle these inputs (``triton_diff.supported``)."""
    try:
        from . import triton_diff
    except ImportError:
        return False
    return triton_diff.supported(q, k, v, lambda_full, causal, mask)


METHODS = {"auto": _auto, "sdpa": _sdpa, "block": _block, "triton": _triton}


def _diff_decode(q, k, v, lambda_full, scale, causal, mask):
    """A few query rows (decoding from a cache), no gradient: the fused decode kernel on CPU (``cpu_kernel.py``: one
    pass over the cache per group, each key and value read once), else full rows in PyTorch, keys and values read
    once per group."""
    if choices(q.device).decode == "kernel" and cpu_kernel.decode_supported(q, k, v):
        return cpu_kernel.fused_decode(q, k, v, lambda_full, scale, causal, mask)
    return _diff_decode_torch(q, k, v, lambda_full, scale, causal, mask)


def _diff_decode_torch(q, k, v, lambda_full, scale, causal, mask):
    """``_diff_decode`` in PyTorch operations (no kernel, other dtypes or devices)."""
    b, h, _, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[3]
    rep = h // hkv
    qg = (q * scale).view(b, hkv, rep, 2, tq, d).transpose(2, 3)  # (B, Hkv, 2, rep, Tq, d)
    probs = _block_probs(qg, k, causal, mask, 0, tk - tq)
    diff = torch.addcmul(probs[:, :, 0], probs[:, :, 1], lambda_full.to(probs.dtype), value=-1)  # (B, Hkv, rep, Tq, Tk)
    return torch.matmul(diff.flatten(2, 3).to(v.dtype), v).view(b, h, tq, v.shape[-1])


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
    """Softmax attention with grouped keys: the standard model's core. The maps are materialised when asked for
    them, or inside a ``logit_probe`` context (returned only when asked).

    Args:
        q: the queries, (B, N, Tq, d).
        k: the keys, (B, Nkv, Tk, d); head n reads group n // (N / Nkv).
        v: the values, (B, Nkv, Tk, dv).
        scale: the logits' factor, 1 / sqrt(d).
        causal: a query attends only to keys at or before its position.
        mask: boolean (B, Tk) or (B, Tq, Tk), True where attention is allowed.
        need_weights: also return the attention maps.

    Returns:
        (output (B, N, Tq, dv), the maps (B, N, Tq, Tk) or None).

    Examples:
        >>> import torch
        >>> out, maps = standard_attention(torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8),
        ...                                scale=8**-0.5, need_weights=True)
        >>> out.shape, torch.allclose(maps.sum(-1), torch.ones(1, 4, 5))
        (torch.Size([1, 4, 5, 8]), True)
    """
    if need_weights or active_probe() is not None:
        rep = q.shape[1] // k.shape[1]
        probs = attention_probs(q, k.repeat_interleave(rep, 1), scale, causal, mask)
        return torch.matmul(probs.to(v.dtype), v.repeat_interleave(rep, 1)), (probs if need_weights else None)
    tq, tk = q.shape[-2], k.shape[-2]
    if mask is None and (not causal or tq == tk):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    else:
        allowed = _full_allowed(tq, tk, causal, mask, q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=True)
    return out, None
