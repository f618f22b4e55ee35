"""Differential attention as Triton kernels (forward and backward) for CUDA GPUs.

Optional: needs ``pip install 'difftransformer[triton]'``. Layouts are those of ``kernels.py``:
q (B, H, 2, Tq, d), k (B, Hkv, 2, Tk, d), v (B, Hkv, Tk, 2d); query head h reads group h // rep.

Forward: one program per (block of query rows, batch x head) streams each key/value block once and updates
both maps' online softmax (running max and sum per map) and two 2d-wide accumulators, so K and V are read once
for both maps. The output ``O1 - lambda O2`` is written with ``O2`` and both maps' log-sum-exp, which is all
that the backward needs: with ``dO``, ``delta_c = rowsum(dO * O_c)`` gives each map's softmax backward
without the maps. This is the flash-style cost of docs/paper.md section 4 (1.5x the baseline's attention-core
arithmetic); nothing of size (T, T) is ever stored.

Backward: one kernel per key block and key/value group accumulates dK1, dK2 and dV over the group's query
heads (no atomics, GQA included); a second kernel per query block computes dQ1 and dQ2.

Supported: no boolean mask (causal or full attention, with ``Tq <= Tk`` when causal, so every query row sees
at least one key), half-head size a power of two from 16 to 128, float32/float16/bfloat16. ``kernels.py``
routes anything else to the exact PyTorch paths. On a machine without a GPU, ``TRITON_INTERPRET=1`` (set
before this module is imported) runs the same kernels on CPU tensors; the test suite checks them that way.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Large and finite, so masked scores give exp2(...) == 0 without inf - inf; every row has a real key. A constexpr: a
# compiled kernel reads no plain Python global (only the interpreter does).
NEG: tl.constexpr = tl.constexpr(-1.0e30)


HEAD_DIMS = (16, 32, 64, 128)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def supported(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lambda_full: torch.Tensor,
    causal: bool,
    mask: torch.Tensor | None,
) -> bool:
    """Whether the kernels handle these inputs (else kernels.py uses a PyTorch path): no boolean mask, every query row
    with a key when causal, a head size the tiles cover, and q, k and v of one supported dtype with lambda, all on
    one device (a float32 KV cache read by bfloat16 queries under autocast falls back)."""
    return (
        mask is None
        and (not causal or q.shape[3] <= k.shape[3])
        and q.shape[-1] in HEAD_DIMS
        and q.dtype in DTYPES
        and k.dtype == v.dtype == q.dtype
        and lambda_full.is_floating_point()
        and lambda_full.numel() == 1
        and k.device == v.device == lambda_full.device == q.device
    )


@triton.jit
def _query_tile(Q, b, h, offs_m, offs_d, s_qb, s_qh, s_qc, s_qt, TQ):
    """Both query halves of a block of rows: (BLOCK_M, D) each, zeros past TQ."""
    ptr = Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qt + offs_d[None, :]
    ok = offs_m[:, None] < TQ
    return tl.load(ptr, mask=ok, other=0.0), tl.load(ptr + s_qc, mask=ok, other=0.0)


@triton.jit
def _key_tile(K, V, b, g, offs_n, offs_d, offs_v, s_kb, s_kh, s_kc, s_kt, s_vb, s_vh, s_vt, TK):
    """Both key halves and the 2d-wide value of a block of keys, transposed: (D, N), (D, N), (2D, N)."""
    ok = offs_n[None, :] < TK
    kt_ptr = K + b * s_kb + g * s_kh + offs_n[None, :] * s_kt + offs_d[:, None]
    vt_ptr = V + b * s_vb + g * s_vh + offs_n[None, :] * s_vt + offs_v[:, None]
    k1t = tl.load(kt_ptr, mask=ok, other=0.0)
    return k1t, tl.load(kt_ptr + s_kc, mask=ok, other=0.0), tl.load(vt_ptr, mask=ok, other=0.0)


@triton.jit
def _allowed(offs_m, offs_n, TQ, TK, CAUSAL: tl.constexpr):
    """(BLOCK_M, BLOCK_N) mask of real (query, key) pairs; causal: key j <= query i + (TK - TQ)."""
    ok = (offs_m[:, None] < TQ) & (offs_n[None, :] < TK)
    if CAUSAL:
        ok = ok & (offs_n[None, :] <= offs_m[:, None] + (TK - TQ))
    return ok


@triton.jit
def _row_stats(DO, LSE, DELTA, bh, offs_m, offs_v, TQ, D: tl.constexpr):
    """dO (BLOCK_M, 2D) and both maps' log-sum-exp and delta of a block of query rows."""
    ok = offs_m < TQ
    do = tl.load(DO + (bh * TQ + offs_m[:, None]) * (2 * D) + offs_v[None, :], mask=ok[:, None], other=0.0)
    stat = bh * 2 * TQ + offs_m
    lse1 = tl.load(LSE + stat, mask=ok, other=0.0)
    lse2 = tl.load(LSE + stat + TQ, mask=ok, other=0.0)
    delta1 = tl.load(DELTA + stat, mask=ok, other=0.0)
    delta2 = tl.load(DELTA + stat + TQ, mask=ok, other=0.0)
    return do, lse1, lse2, delta1, delta2


@triton.jit
def _grads_of_scores(q1, q2, k1t, k2t, vt, do, lse1, lse2, delta1, delta2, lam, allowed, qk_scale, PREC: tl.constexpr):
    """Recompute both maps of a tile from the log-sum-exp; return them with dL/dscores of each map.

    Map 1 receives dP = dO V^T and map 2 receives -lambda dP; with delta_c = rowsum(dO * O_c), the softmax backward
    gives dS1 = P1 (dP - delta1) and dS2 = -lambda P2 (dP - delta2).
    """
    p1 = tl.where(allowed, tl.exp2(tl.dot(q1, k1t, input_precision=PREC) * qk_scale - lse1[:, None]), 0.0)
    p2 = tl.where(allowed, tl.exp2(tl.dot(q2, k2t, input_precision=PREC) * qk_scale - lse2[:, None]), 0.0)
    dp = tl.dot(do, vt, input_precision=PREC)
    return p1, p2, p1 * (dp - delta1[:, None]), -lam * p2 * (dp - delta2[:, None])


@triton.jit
def _fwd_kernel(
    Q, K, V, LAM, OUT, O2, LSE,
    s_qb, s_qh, s_qc, s_qt,
    s_kb, s_kh, s_kc, s_kt,
    s_vb, s_vh, s_vt,
    H, REP, TQ, TK, qk_scale,
    CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    g = h // REP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_v = tl.arange(0, 2 * D)
    q1, q2 = _query_tile(Q, b, h, offs_m, offs_d, s_qb, s_qh, s_qc, s_qt, TQ)
    m1 = tl.full([BLOCK_M], NEG, tl.float32)
    m2 = tl.full([BLOCK_M], NEG, tl.float32)
    l1 = tl.zeros([BLOCK_M], tl.float32)
    l2 = tl.zeros([BLOCK_M], tl.float32)
    acc1 = tl.zeros([BLOCK_M, 2 * D], tl.float32)
    acc2 = tl.zeros([BLOCK_M, 2 * D], tl.float32)
    hi = TK
    if CAUSAL:
        hi = tl.minimum(TK, (pid_m + 1) * BLOCK_M + TK - TQ)
    for start_n in range(0, hi, BLOCK_N):  # each key/value block is read once for both maps
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k1t, k2t, vt = _key_tile(K, V, b, g, offs_n, offs_d, offs_v, s_kb, s_kh, s_kc, s_kt, s_vb, s_vh, s_vt, TK)
        v = tl.trans(vt)
        allowed = _allowed(offs_m, offs_n, TQ, TK, CAUSAL)
        s1 = tl.where(allowed, tl.dot(q1, k1t, input_precision=PREC) * qk_scale, NEG)
        s2 = tl.where(allowed, tl.dot(q2, k2t, input_precision=PREC) * qk_scale, NEG)
        m1_new = tl.maximum(m1, tl.max(s1, 1))
        m2_new = tl.maximum(m2, tl.max(s2, 1))
        p1 = tl.exp2(s1 - m1_new[:, None])
        p2 = tl.exp2(s2 - m2_new[:, None])
        a1 = tl.exp2(m1 - m1_new)
        a2 = tl.exp2(m2 - m2_new)
        l1 = l1 * a1 + tl.sum(p1, 1)
        l2 = l2 * a2 + tl.sum(p2, 1)
        acc1 = acc1 * a1[:, None] + tl.dot(p1.to(v.dtype), v, input_precision=PREC)
        acc2 = acc2 * a2[:, None] + tl.dot(p2.to(v.dtype), v, input_precision=PREC)
        m1 = m1_new
        m2 = m2_new
    lam = tl.load(LAM)
    o2 = acc2 / l2[:, None]
    out = acc1 / l1[:, None] - lam * o2
    row_ok = offs_m < TQ
    o_off = (bh * TQ + offs_m[:, None]) * (2 * D) + offs_v[None, :]
    tl.store(OUT + o_off, out.to(OUT.dtype.element_ty), mask=row_ok[:, None])
    tl.store(O2 + o_off, o2.to(O2.dtype.element_ty), mask=row_ok[:, None])
    lse_off = bh * 2 * TQ + offs_m
    tl.store(LSE + lse_off, m1 + tl.log2(l1), mask=row_ok)
    tl.store(LSE + lse_off + TQ, m2 + tl.log2(l2), mask=row_ok)


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, LAM, DO, LSE, DELTA, DK, DV,
    s_qb, s_qh, s_qc, s_qt,
    s_kb, s_kh, s_kc, s_kt,
    s_vb, s_vh, s_vt,
    H, HKV, REP, TQ, TK, qk_scale,
    CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    bg = tl.program_id(1)
    b = bg // HKV
    g = bg % HKV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    offs_v = tl.arange(0, 2 * D)
    k1t, k2t, vt = _key_tile(K, V, b, g, offs_n, offs_d, offs_v, s_kb, s_kh, s_kc, s_kt, s_vb, s_vh, s_vt, TK)
    lam = tl.load(LAM)
    dk1 = tl.zeros([BLOCK_N, D], tl.float32)
    dk2 = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, 2 * D], tl.float32)
    lo = 0
    if CAUSAL:  # the first query block that sees this key block
        lo = tl.maximum(0, pid_n * BLOCK_N - (TK - TQ)) // BLOCK_M * BLOCK_M
    for r in range(0, REP):  # every query head of the group: dK and dV sum over them, no atomics
        h = g * REP + r
        bh = b * H + h
        for start_m in range(lo, TQ, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q1, q2 = _query_tile(Q, b, h, offs_m, offs_d, s_qb, s_qh, s_qc, s_qt, TQ)
            do, lse1, lse2, delta1, delta2 = _row_stats(DO, LSE, DELTA, bh, offs_m, offs_v, TQ, D)
            allowed = _allowed(offs_m, offs_n, TQ, TK, CAUSAL)
            p1, p2, ds1, ds2 = _grads_of_scores(
                q1, q2, k1t, k2t, vt, do, lse1, lse2, delta1, delta2, lam, allowed, qk_scale, PREC
            )
            dv += tl.dot(tl.trans(p1 - lam * p2).to(do.dtype), do, input_precision=PREC)
            dk1 += tl.dot(tl.trans(ds1).to(q1.dtype), q1, input_precision=PREC)
            dk2 += tl.dot(tl.trans(ds2).to(q2.dtype), q2, input_precision=PREC)
    sm_scale = qk_scale / 1.4426950408889634
    col_ok = offs_n[:, None] < TK
    dk_ptr = DK + (bg * 2 * TK + offs_n[:, None]) * D + offs_d[None, :]
    tl.store(dk_ptr, (dk1 * sm_scale).to(DK.dtype.element_ty), mask=col_ok)
    tl.store(dk_ptr + TK * D, (dk2 * sm_scale).to(DK.dtype.element_ty), mask=col_ok)
    dv_ptr = DV + (bg * TK + offs_n[:, None]) * (2 * D) + offs_v[None, :]
    tl.store(dv_ptr, dv.to(DV.dtype.element_ty), mask=col_ok)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, LAM, DO, LSE, DELTA, DQ,
    s_qb, s_qh, s_qc, s_qt,
    s_kb, s_kh, s_kc, s_kt,
    s_vb, s_vh, s_vt,
    H, REP, TQ, TK, qk_scale,
    CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    g = h // REP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_v = tl.arange(0, 2 * D)
    q1, q2 = _query_tile(Q, b, h, offs_m, offs_d, s_qb, s_qh, s_qc, s_qt, TQ)
    do, lse1, lse2, delta1, delta2 = _row_stats(DO, LSE, DELTA, bh, offs_m, offs_v, TQ, D)
    lam = tl.load(LAM)
    dq1 = tl.zeros([BLOCK_M, D], tl.float32)
    dq2 = tl.zeros([BLOCK_M, D], tl.float32)
    hi = TK
    if CAUSAL:
        hi = tl.minimum(TK, (pid_m + 1) * BLOCK_M + TK - TQ)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k1t, k2t, vt = _key_tile(K, V, b, g, offs_n, offs_d, offs_v, s_kb, s_kh, s_kc, s_kt, s_vb, s_vh, s_vt, TK)
        allowed = _allowed(offs_m, offs_n, TQ, TK, CAUSAL)
        _, _, ds1, ds2 = _grads_of_scores(
            q1, q2, k1t, k2t, vt, do, lse1, lse2, delta1, delta2, lam, allowed, qk_scale, PREC
        )
        dq1 += tl.dot(ds1.to(q1.dtype), tl.trans(k1t), input_precision=PREC)
        dq2 += tl.dot(ds2.to(q2.dtype), tl.trans(k2t), input_precision=PREC)
    sm_scale = qk_scale / 1.4426950408889634
    row_ok = offs_m[:, None] < TQ
    dq_ptr = DQ + (bh * 2 * TQ + offs_m[:, None]) * D + offs_d[None, :]
    tl.store(dq_ptr, (dq1 * sm_scale).to(DQ.dtype.element_ty), mask=row_ok)
    tl.store(dq_ptr + TQ * D, (dq2 * sm_scale).to(DQ.dtype.element_ty), mask=row_ok)


def _strides(q, k, v):
    return (*q.stride()[:4], *k.stride()[:4], *v.stride()[:3])


@dataclass(frozen=True)
class Tiles:
    """How one kernel is launched: query rows and keys per tile, warps per program, software-pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# the kernels by name: what the launch tiles and the compile check (tests/test_triton_compile.py) key on
KERNELS = {"forward": _fwd_kernel, "backward_dkdv": _bwd_dkdv_kernel, "backward_dq": _bwd_dq_kernel}
# (kernel, half-head size d, bytes per element) -> tiles. Chosen from ptxas's reports for sm_90a (H100, H200) and
# sm_80 (A100), compiled on a machine without a GPU, with the pinned Triton and the GPU machine's (make test-gpu-image;
# tests/test_triton_compile.py checks every entry): the largest
# tiles with no register spill and shared memory within both targets' limits; not tuned for speed, which only a GPU
# can measure. The forward holds two 2d-wide float32 accumulators per query row (one per map), the dK/dV kernel
# 4d float32 values per key, which is what limits the tiles at d = 128 and in float32.
_FP16, _FP32 = 2, 4
TILES: dict[tuple[str, int, int], Tiles] = {
    **{("forward", d, _FP16): Tiles(64, 64, 8, 2) for d in (16, 32, 64)},
    ("forward", 128, _FP16): Tiles(32, 32, 8, 2),
    **{("backward_dkdv", d, _FP16): Tiles(32, 32, 8, 2) for d in HEAD_DIMS},
    **{("backward_dq", d, _FP16): Tiles(32, 32, 4, 2) for d in (16, 32, 64)},
    ("backward_dq", 128, _FP16): Tiles(32, 32, 8, 2),
    # float32: tl.dot in IEEE precision (no tensor cores), whose unrolled products need smaller tiles
    **{("forward", d, _FP32): Tiles(32, 32, 8, 1) for d in (16, 32, 64)},
    ("forward", 128, _FP32): Tiles(32, 16, 8, 1),
    # (Triton 3.6, the GPU machine's, spills at d 16 with 4 warps and at d 64 in one stage: these compile without
    # spills in both 3.6 and the pinned 3.9)
    ("backward_dkdv", 16, _FP32): Tiles(16, 16, 8, 1),
    ("backward_dkdv", 32, _FP32): Tiles(16, 16, 4, 1),
    ("backward_dkdv", 64, _FP32): Tiles(16, 16, 4, 3),
    ("backward_dkdv", 128, _FP32): Tiles(16, 16, 4, 2),
    **{("backward_dq", d, _FP32): Tiles(16, 32, 8, 1) for d in (16, 32, 128)},
    ("backward_dq", 64, _FP32): Tiles(16, 32, 8, 2),
}
# The interpreter's cost grows with the tile size: small tiles there (which exercise the edge masks too); None runs
# the GPU's tiles in the interpreter (tests/test_triton.py does, at lengths that are not multiples of them).
INTERPRETER_TILES: Tiles | None = Tiles(16, 16, 4, 1)


def tiles(kernel: str, d: int, dtype: torch.dtype) -> Tiles:
    """The tiles ``kernel`` (one of KERNELS) is launched with on a GPU, for half-heads of size ``d`` in ``dtype``."""
    return TILES[kernel, d, torch.empty((), dtype=dtype).element_size()]


def _launch_tiles(kernel: str, d: int, dtype: torch.dtype) -> Tiles:
    if interpreting() and INTERPRETER_TILES is not None:
        return INTERPRETER_TILES
    return tiles(kernel, d, dtype)


def _on(device: torch.device):
    """The inputs' GPU as the current one while kernels launch (Triton launches on the current device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class TritonDiffAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, lambda_full, scale, causal):
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        b, h, _, tq, d = q.shape
        hkv, tk = k.shape[1], k.shape[3]
        lam = lambda_full.detach().to(torch.float32).reshape(1).contiguous()
        out = q.new_empty(b, h, tq, 2 * d)
        o2 = torch.empty_like(out)
        lse = torch.empty(b, h, 2, tq, dtype=torch.float32, device=q.device)
        fwd = _launch_tiles("forward", d, q.dtype)
        prec = "ieee" if q.dtype == torch.float32 else "tf32"
        with _on(q.device):
            _fwd_kernel[(triton.cdiv(tq, fwd.block_m), b * h)](
                q, k, v, lam, out, o2, lse, *_strides(q, k, v), h, h // hkv, tq, tk, scale * LOG2E,
                CAUSAL=causal, D=d, BLOCK_M=fwd.block_m, BLOCK_N=fwd.block_n, PREC=prec,
                num_warps=fwd.num_warps, num_stages=fwd.num_stages,
            )  # fmt: skip
        ctx.save_for_backward(q, k, v, lam, out, o2, lse)
        ctx.scale, ctx.causal, ctx.prec = scale, causal, prec
        ctx.lambda_meta = (lambda_full.dtype, lambda_full.shape)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, lam, out, o2, lse = ctx.saved_tensors
        b, h, _, tq, d = q.shape
        hkv, tk = k.shape[1], k.shape[3]
        do = grad_out.contiguous()
        dof = do.float()
        delta2 = (dof * o2.float()).sum(-1)  # rowsum(dO * O2)
        delta1 = (dof * out.float()).sum(-1) + lam * delta2  # O1 = out + lambda O2
        delta = torch.stack((delta1, delta2), dim=2).contiguous()  # (B, H, 2, Tq), like lse
        dlam = -delta2.sum()
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        strides, qk_scale = _strides(q, k, v), ctx.scale * LOG2E
        dkdv, dqt = _launch_tiles("backward_dkdv", d, q.dtype), _launch_tiles("backward_dq", d, q.dtype)
        with _on(q.device):
            _bwd_dkdv_kernel[(triton.cdiv(tk, dkdv.block_n), b * hkv)](
                q, k, v, lam, do, lse, delta, dk, dv, *strides, h, hkv, h // hkv, tq, tk, qk_scale,
                CAUSAL=ctx.causal, D=d, BLOCK_M=dkdv.block_m, BLOCK_N=dkdv.block_n, PREC=ctx.prec,
                num_warps=dkdv.num_warps, num_stages=dkdv.num_stages,
            )  # fmt: skip
            _bwd_dq_kernel[(triton.cdiv(tq, dqt.block_m), b * h)](
                q, k, v, lam, do, lse, delta, dq, *strides, h, h // hkv, tq, tk, qk_scale,
                CAUSAL=ctx.causal, D=d, BLOCK_M=dqt.block_m, BLOCK_N=dqt.block_n, PREC=ctx.prec,
                num_warps=dqt.num_warps, num_stages=dqt.num_stages,
            )  # fmt: skip
        dtype, shape = ctx.lambda_meta
        return dq, dk, dv, dlam.to(dtype).reshape(shape), None, None


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1 before Triton was imported)."""
    knobs = getattr(triton, "knobs", None)  # Triton 3.4 and newer; before, the environment alone said it
    return knobs.runtime.interpret if knobs is not None else os.environ.get("TRITON_INTERPRET") == "1"


def diff_attention_triton(q, k, v, lambda_full, scale: float, causal: bool) -> torch.Tensor:
    """(B, H, Tq, 2d) differential attention through the Triton kernels (see the module docstring)."""
    if q.device.type != "cuda" and not interpreting():
        raise RuntimeError(
            "the Triton differential-attention kernel runs on CUDA tensors; on CPU use impl 'block' or 'auto', "
            "or set TRITON_INTERPRET=1 before importing difftransformer to run it in Triton's interpreter"
        )
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return TritonDiffAttention.apply(q, k, v, lambda_full, scale, causal)
