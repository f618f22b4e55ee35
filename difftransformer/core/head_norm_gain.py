"""The per-head norm's matched initial gain: ``ModelConfig(head_norm_gain="matched")`` (this library's rule, not the
paper's, which starts the norm's weight at 1).

A per-head RMSNorm writes each head's output at RMS 1 whatever its input, so an attention block with the norm starts
at a scale set by its norm's weight, not by its values: at weight 1 and the default ``init_std`` it writes 17 times
the standard model's attention output in the long study's width-64 model (``experiments/reports/lm``, measured), and
2.7 to 14 times, layer by layer, in the ``tiny`` preset (1 / its matched gains). The matched gain of layer ``l`` is the
norm weight at which the block's output has, at initialisation, the RMS of the standard model's attention block in
the same layer (the standard model of the same configuration, ``attention="standard"``). Derivation (docs/guide/
modules.md, "The per-head norm's initial gain"):

- At initialisation a head's output at position t averages the values of positions 0..t, weighted by the softmax
  of logits of variance ``(init_std^2 D)^2`` (nearly uniform weights in small models). Both blocks then write
  through ``out_proj`` (std ``s_o``) a D-wide vector of heads. A normed head writes RMS ``g`` per component, times
  ``1 - lambda_init`` in DIFF, so DIFF's block output has RMS ``g (1 - lambda_init) s_o sqrt(D)`` whatever the data.
- The standard block writes ``s_o sqrt(D)`` times the RMS of its averaged values, ``init_std sqrt(D) rho_l``, where
  ``rho_l`` is the RMS over positions of the causal mean of the layer's normalised inputs. So
  ``g_l = init_std sqrt(D) rho_l / (1 - lambda_init_l)`` (without the ``1 - lambda_init`` for the standard model
  with the norm).
- ``rho_l`` depends on how alike the layer's inputs are across positions. It is computed by propagating the
  position-by-position covariance of the standard model's residual stream through the layers (mean field: the
  weights' randomness averaged, the width taken large): the embeddings of tokens that coincide with probability
  ``collision``; each attention block adding its causal means; each SwiGLU feed-forward block adding the kernel of
  ``silu(u) v`` for Gaussian ``u, v``. Deeper layers see inputs more alike across positions (the causal means the
  blocks add are), so their gain grows with depth, towards and past 1 in deep models.
- ``collision``, the probability that two positions of a window hold the same token, is the one property of the data
  the rule needs. ``ModelConfig.head_norm_collision`` gives it (``token_collision`` measures it on token windows);
  left None, ``"matched"`` assumes text whose token frequencies follow Zipf's law over the vocabulary
  (``zipf_collision``: 0.044 for 257 byte tokens, 0.024 for 2048); uniformly random tokens have ``1 / vocab_size``.
  The built-in corpus has 0.07 as bytes and 0.01 as a 2048-token BPE, so the Zipf default is off by up to 1.3x
  in the first layers there (docs/guide/modules.md has the measurements).

``experiments/calibration/head_norm_gain.py`` measures the rule against real models; ``tests/test_head_norm_gain.py``
holds it within 0.8-1.25 at every preset.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import torch

from difftransformer.core.lambda_init import lambda_init_fn

KERNEL_GRID = 401  # correlations at which the feed-forward kernel is computed, then fitted
KERNEL_DEGREE = 10
HERMITE_NODES = 48
# the grids of the softmax's sum of squared weights (``_square_sums``): standard-normal points, and points of log t
# in the Laplace-transform integral; their quadrature error is below 1e-12 relative (finer grids agree to that)
NORMAL_POINTS = 801
LOG_T_POINTS = 1201


def token_collision(tokens: torch.Tensor) -> float:
    """The probability that two different positions of a window hold the same token: per window
    sum_k c_k (c_k - 1) / (T (T - 1)) over its token counts c_k, averaged over the windows. Give it to
    ``ModelConfig(head_norm_gain="matched", head_norm_collision=...)`` when your tokens are unlike Zipf's law.

    Args:
        tokens: (N, T) token ids, windows of the data the model will train on, T >= 2 (its context).

    Returns:
        The probability, in [0, 1].

    Examples:
        >>> import torch
        >>> token_collision(torch.tensor([[1, 1, 2, 3]]))  # 2 of the 12 ordered pairs of positions
        0.16666666666666666
    """
    if tokens.dim() != 2 or tokens.shape[1] < 2 or tokens.shape[0] < 1:
        raise ValueError(f"tokens are (windows, positions) with at least 2 positions; got shape {tuple(tokens.shape)}")
    t = tokens.shape[1]
    pairs = 0.0
    for row in tokens.long():
        counts = torch.bincount(row).double()
        pairs += float((counts * (counts - 1)).sum())
    return pairs / (tokens.shape[0] * t * (t - 1))


def zipf_collision(vocab_size: int) -> float:
    """The probability that two tokens drawn from Zipf's law (frequency of rank k proportional to 1 / k) over
    ``vocab_size`` tokens are the same: sum 1/k^2 / (sum 1/k)^2; the text that ``"matched"`` assumes by default.

    Args:
        vocab_size: the number of tokens.

    Returns:
        The probability, in (0, 1].

    Examples:
        >>> round(zipf_collision(2048), 4)
        0.0244
    """
    k = np.arange(1, vocab_size + 1, dtype=np.float64)
    return float((1 / k**2).sum() / (1 / k).sum() ** 2)


@functools.lru_cache(maxsize=32)
def _swiglu_kernel(variance: float) -> tuple[float, ...]:
    """The feed-forward kernel c E[silu(u) silu(u')] for ``u, u'`` normal with ``variance`` and correlation ``c`` (the
    hidden unit ``silu(gate) * up`` of two inputs with that correlation, per unit of ``up``'s variance), as power-
    series coefficients in ``c``: Gauss-Hermite quadrature on ``KERNEL_GRID`` correlations, fitted by a degree-
    ``KERNEL_DEGREE`` polynomial (its error is below 1e-6 of the kernel's range up to variance 1.6)."""
    x, w = np.polynomial.hermite_e.hermegauss(HERMITE_NODES)  # weight exp(-x^2 / 2)
    w = w / w.sum()
    s = math.sqrt(variance)
    corr = np.linspace(-1.0, 1.0, KERNEL_GRID)
    a = s * x[None, :, None]
    b = s * (corr[:, None, None] * x[None, :, None] + np.sqrt(1 - corr**2)[:, None, None] * x[None, None, :])
    silu = lambda u: u / (1 + np.exp(-u))  # noqa: E731
    values = corr * (w[None, :, None] * w[None, None, :] * silu(a) * silu(b)).sum(axis=(1, 2))
    fit = np.polynomial.chebyshev.Chebyshev.fit(corr, values, KERNEL_DEGREE, domain=[-1, 1])
    return tuple(float(v) for v in fit.convert(kind=np.polynomial.Polynomial).coef)


def _polyval(coef: tuple[float, ...], c: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(c, coef[-1])
    for a in reversed(coef[:-1]):
        out.mul_(c).add_(a)
    return out


@functools.lru_cache(maxsize=16)
def _square_sums(n_max: int, logit_var: float) -> torch.Tensor:
    """pi_n = E[sum_j w_j^2] for the softmax weights w of n independent normal logits of variance ``logit_var``, for
    n = 1..n_max (float64). With X_j = e^{s_j} and 1 / S^2 = int_0^inf t e^{-tS} dt over S = sum_j X_j,
    pi_n = n int_0^inf t E[X^2 e^{-tX}] E[e^{-tX}]^(n-1) dt: two one-dimensional expectations over the normal
    logit, on a grid, then one integral over log t. Exact up to the quadrature; the log-normal shortcut
    e^v / (n + e^v - 1) is right only when e^v << n and overstates pi_n up to 3 times at the 13.1b preset's
    v = 4.2 (n 64)."""
    s = math.sqrt(logit_var)
    x = torch.linspace(-12.0, 12.0, NORMAL_POINTS, dtype=torch.float64, device="cpu")
    density = torch.exp(-x * x / 2)
    density /= density.sum()
    big_x = torch.exp(s * x)
    u = torch.linspace(-12.0 * s - 25.0, 12.0 * s + 25.0, LOG_T_POINTS, dtype=torch.float64, device="cpu")  # log t
    t = torch.exp(u)
    decay = torch.exp(-t[:, None] * big_x[None, :])
    laplace = (decay * density).sum(1).clamp_min(1e-300).log()  # log E[e^{-tX}]
    weight = t * t * (decay * (big_x * big_x * density)).sum(1)  # t^2 E[X^2 e^{-tX}] (dt = t du)
    n = torch.arange(1, n_max + 1, dtype=torch.float64, device="cpu")
    out = torch.empty(n_max, dtype=torch.float64, device="cpu")
    for start in range(0, n_max, 512):  # 512 n at a time: at most 512 x LOG_T_POINTS values at once
        m = n[start : start + 512]
        out[start : start + 512] = m * torch.trapezoid(weight * torch.exp((m - 1)[:, None] * laplace), u, dim=1)
    return out


def _causal_means(c: torch.Tensor, logit_var: float) -> torch.Tensor:
    """Covariance of the attention outputs of a head whose position t weighs positions 0..t by the softmax of
    independent logits of variance ``logit_var`` (the uniform causal mean at 0), for values with covariance ``c``.
    Two positions' weights are independent, so off the diagonal the covariance is that of the uniform means; on it,
    with n = t + 1 weights whose squares sum to pi_n on average (``_square_sums``), it is (pi_n / n) sum_s c_ss +
    (1 - pi_n) / (n (n - 1)) sum_{s != s'} c_ss'."""
    n = torch.arange(1, c.shape[0] + 1, dtype=c.dtype, device=c.device)
    pairs = c.cumsum(0)
    torch.cumsum(pairs, 1, out=pairs)  # pairs[s, t] = sum over s' <= s, t' <= t
    same = c.diagonal().cumsum(0)
    whole = pairs.diagonal().clone()
    out = pairs.mul_((1 / n)[:, None]).mul_((1 / n)[None, :])
    if logit_var > 0:
        pi = _square_sums(c.shape[0], logit_var).to(c.device)
        others = (whole - same) / (n * (n - 1)).clamp(min=1)
        out.diagonal().copy_(pi / n * same + (1 - pi) * others)
    return out


def averaged_value_rms(
    config, collision: float, positions: int | None = None, layers: int | None = None
) -> list[float]:
    """Per layer, ``rho_l``: the RMS over positions of the causal mean of the normalised inputs of the standard
    model of ``config``'s shape, at initialisation (see the module docstring), for tokens that coincide with
    probability ``collision``, over ``positions`` (default ``config.max_seq_len``); the first ``layers`` layers only
    (default all: a layer's value depends only on the layers before it)."""
    t = positions or config.max_seq_len
    if layers is not None and not (isinstance(layers, int) and layers >= 1):
        raise ValueError(f"layers counts the first layers to compute, at least 1 (or None for all); got {layers!r}")
    n = config.n_layers if layers is None else min(layers, config.n_layers)
    return list(
        _rho(config.d_model, config.n_layers, config.ffn_dim, t, config.norm_eps, config.init_std, collision, n)
    )


@functools.lru_cache(maxsize=64)
def _rho(
    d: int, n_layers: int, ffn_dim: int, t: int, eps: float, std: float, collision: float, first: int
) -> tuple[float, ...]:
    out_var = std * std / (2 * n_layers)  # out_proj and down_proj (TransformerLM.reset_parameters)
    in_var = std * std * d  # one row of q/k/v/gate/up times a unit-RMS input
    kernel = _swiglu_kernel(in_var)
    eye = torch.eye(t, dtype=torch.float64, device="cpu")  # on the CPU whatever the default device (meta, CUDA)
    cov = std * std * ((1 - collision) * eye + collision)  # the embeddings

    def normalised(cov: torch.Tensor) -> torch.Tensor:  # RMSNorm (weight 1) divides each position by its RMS
        inv = (cov.diagonal() + eps).rsqrt()
        return (cov * inv[:, None]).mul_(inv[None, :])

    rho = []
    for _ in range(first):
        means = _causal_means(normalised(cov), in_var * in_var)  # logits q.k / sqrt(d): variance (std^2 D)^2
        rho.append(math.sqrt(means.diagonal().mean().item()))
        cov.add_(means, alpha=out_var * d * in_var)  # the attention block: out_proj(v_proj(causal means))
        del means
        c = normalised(cov)
        cov.add_(_polyval(kernel, c), alpha=out_var * ffn_dim * in_var)  # down(silu(gate) * up)
        del c
    return tuple(rho)


def matched_gains(config: Any, collision: float | None = None, layers: int | None = None) -> tuple[float, ...]:
    """The per-layer initial weight of the per-head norm that gives the attention blocks of ``config`` (``diff``,
    or ``standard`` with ``head_norm``) the standard model's output RMS at initialisation: what
    ``ModelConfig(head_norm_gain="matched")`` starts the norms at (the module docstring derives it).

    Args:
        config: the model's ModelConfig (its sizes, context, ``init_std``, ``lambda_init`` and attention).
        collision: the probability that two positions hold the same token (``token_collision``); None: the config's
            ``head_norm_collision``, else Zipf's law over the vocabulary (``zipf_collision``).
        layers: the first ``layers`` layers' gains only (default all); each layer's gain depends only on the layers
            before it, and the propagation costs a (context x context) covariance per layer.

    Returns:
        One gain per layer (of the first ``layers``).

    Examples:
        >>> from difftransformer import ModelConfig
        >>> [round(g, 3) for g in matched_gains(ModelConfig.preset("tiny", vocab_size=2048))]
        [0.061, 0.093, 0.137, 0.195, 0.265, 0.344]
    """
    if collision is None:
        collision = getattr(config, "head_norm_collision", None)
    p = zipf_collision(config.vocab_size) if collision is None else float(collision)
    if not 0 <= p <= 1:
        raise ValueError(f"collision is a probability in [0, 1], got {collision!r}")
    rho = averaged_value_rms(config, p, layers=layers)
    factor = math.sqrt(config.d_model) * config.init_std
    if config.attention != "diff":
        return tuple(factor * r for r in rho)
    lam = [lambda_init_fn(i) if config.lambda_init is None else config.lambda_init for i in range(len(rho))]
    return tuple(factor * r / (1 - x) for r, x in zip(rho, lam, strict=True))
