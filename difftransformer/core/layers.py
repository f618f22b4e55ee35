"""Building blocks of the LLaMA-style decoder: RMSNorm and the SwiGLU feed-forward network.

Both are memory-lean in training: what is cheap to recompute is recomputed in backward instead of saved. The
RMSNorm saves its input and the per-row 1/rms (not the normalised copy that PyTorch's composite rms_norm keeps);
the SwiGLU saves the gate and up projections' outputs only (not ``silu(gate)`` or the product that feeds
``down_proj``), recomputing both in backward. The forward values are those of the plain expressions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in float32 (or float64), optional weight."""

    def __init__(self, dim: int, eps: float = 1e-5, elementwise_affine: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if elementwise_affine else None

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """``x / sqrt(mean(x^2) + eps) * weight * scale``; a constant ``scale`` is folded into the weight, which
        saves a pass over x (the per-head norm of differential attention scales by 1 - lambda_init)."""
        return _LeanRMSNorm.apply(x, self.scaled_weight(scale, x), self.eps)

    def scaled_weight(self, scale: float, x: torch.Tensor) -> torch.Tensor | None:
        """weight * scale in float32 (float64 for float64 x); None when there is neither."""
        acc = torch.promote_types(x.dtype, torch.float32)
        if self.weight is None:
            return None if scale == 1.0 else torch.full((x.shape[-1],), scale, dtype=acc, device=x.device)
        return (self.weight * scale if scale != 1.0 else self.weight).to(acc)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{None if self.weight is None else self.weight.shape[0]}, eps={self.eps}"


class _LeanRMSNorm(torch.autograd.Function):
    """RMSNorm saving x and 1/rms per row; backward recomputes x / rms. weight: float32 (float64) or None."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = _rms_forward(x, weight, eps)
        ctx.save_for_backward(x, rstd, weight)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        return *_rms_backward(grad, x, rstd, weight, ctx.needs_input_grad[1]), None


def bypassable(*modules: nn.Module) -> bool:
    """Whether a lean training path may use these modules' weights without calling them: plain bias-free
    ``nn.Linear`` layers (or this file's RMSNorm) with no hooks of their own and no global module hooks. Anything
    else (a quantized or LoRA-wrapped layer, a monitoring hook) takes the plain path, which calls the modules."""
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return False
    for m in modules:
        plain = (type(m) is nn.Linear and m.bias is None) or type(m) is RMSNorm
        if not plain or m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            return False
    return True


def head_norm_project(x: torch.Tensor, norm: RMSNorm, scale: float, proj: nn.Module) -> torch.Tensor:
    """``proj(concat_h norm(x_h, scale))`` for per-head outputs x (B, H, T, e) -> (B, T, D). In training with a plain
    ``proj`` it saves only x and the per-row 1/rms: the normalised heads that ``proj`` reads are recomputed in
    backward (an attention layer then saves no more than its core's output)."""
    b, h, t, e = x.shape
    if torch.is_grad_enabled() and bypassable(norm, proj):
        return _LeanHeadNormProject.apply(x, norm.scaled_weight(scale, x), norm.eps, proj.weight)
    return proj(norm(x, scale=scale).transpose(1, 2).reshape(b, t, h * e))


def _rms_forward(x, weight, eps):
    """(x / rms(x) * weight in x's dtype, 1/rms in float32 or float64)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True).add_(eps))
    return _normalised(x, rstd, weight), rstd


def _normalised(x, rstd, weight):
    y = x.to(rstd.dtype) * rstd
    if weight is not None:
        y = y * weight
    # neither an in-place product nor a .to() that returns y itself: torch 2.11's torch.compile, tracing an
    # autograd.Function whose forward returns a tensor so made, dropped the gradient of its other inputs (the norms'
    # weights got none; tests/test_compile.py)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def _rms_backward(grad, x, rstd, weight, weight_grad: bool):
    """(dx, dweight) of ``_rms_forward`` from its input and 1/rms: x / rms is recomputed."""
    xhat = x.to(rstd.dtype) * rstd
    g = grad.to(rstd.dtype)
    dweight = (g * xhat).flatten(0, -2).sum(0) if weight is not None and weight_grad else None
    gw = g * weight if weight is not None else g
    dx = (gw - xhat * (gw * xhat).mean(-1, keepdim=True)).mul_(rstd)  # d/dx of x * rstd(x)
    return dx.to(x.dtype), dweight


class _LeanHeadNormProject(torch.autograd.Function):
    """head_norm_project's training path: saves x, 1/rms and the weights; recomputes the normalised heads."""

    @staticmethod
    def forward(ctx, x, weight, eps, proj_weight):
        b, h, t, e = x.shape
        y, rstd = _rms_forward(x, weight, eps)
        ctx.save_for_backward(x, rstd, weight, proj_weight)
        flat = y.transpose(1, 2).reshape(b, t, h * e)  # a view when x is token-major storage
        return F.linear(flat, proj_weight)  # under autocast F.linear casts, as out_proj would

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight, proj_weight = ctx.saved_tensors
        b, h, t, e = x.shape
        dproj = None
        if ctx.needs_input_grad[3]:
            flat = _normalised(x, rstd, weight).transpose(1, 2).reshape(b * t, h * e).to(grad.dtype)
            dproj = (grad.reshape(b * t, -1).t() @ flat).to(proj_weight.dtype)
        dflat = grad @ proj_weight.to(grad.dtype)  # (B, T, H * e)
        dy = dflat.view(b, t, h, e).transpose(1, 2)
        dx, dweight = _rms_backward(dy, x, rstd, weight, ctx.needs_input_grad[1])
        return dx, dweight, None, dproj


class SwiGLU(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``, no biases (docs/paper.md section 2)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if torch.is_grad_enabled() and bypassable(self.down_proj):
            return _LeanSwiGLUDown.apply(gate, up, self.down_proj.weight)
        return self.down_proj(F.silu(gate) * up)


class _LeanSwiGLUDown(torch.autograd.Function):
    """``(silu(gate) * up) @ weight^T`` saving gate and up; backward recomputes silu(gate) and the product (in the
    gradient's dtype, bf16 under autocast, as ``down_proj``'s backward would)."""

    @staticmethod
    def forward(ctx, gate, up, weight):
        hidden = F.silu(gate) * up
        ctx.save_for_backward(gate, up, weight)
        return F.linear(hidden, weight)  # under autocast F.linear casts, as down_proj would

    @staticmethod
    def backward(ctx, grad):
        gate, up, weight = ctx.saved_tensors
        sig = torch.sigmoid(gate)
        silu = gate * sig
        w = weight.to(grad.dtype)
        dweight = None
        if ctx.needs_input_grad[2]:
            hidden = silu * up
            dweight = (grad.flatten(0, -2).t() @ hidden.flatten(0, -2)).to(weight.dtype)
        dhidden = grad @ w
        dup = dhidden * silu
        dgate = dhidden.mul_(up).mul_(sig * (1 + gate * (1 - sig)))  # silu'(g) = s (1 + g (1 - s))
        return dgate, dup, dweight
