"""Conversion to and from Hugging Face ``transformers``: DiffLlama for DIFF models, Llama for standard ones.

Layouts (docs/paper.md section 1). Ours keeps the reference code's: q_proj rows (H, 2, d) with half-head
(h, c) = component c of head h, k_proj/v_proj rows (Hkv, 2, d), interleaved (GPT-J) rotary pairs, and a
learnable ``subln.weight``. DiffLlama counts 2H half-heads with contiguous halves, rows (2, H, d): query
half-head c*H + h is component c of head h, key/value head c*Hkv + g is component c of group g, and
value head c*Hkv + g is the c-th d-wide half of group g's value. It uses rotate-half rotary pairs, and
its per-head RMSNorm has no weight, so ``subln.weight`` is folded into the o_proj columns. The
conversion is an exact permutation of rows (plus that folding); tests check it against transformers.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from difftransformer.core.attention.gqa_layout import own_layout
from difftransformer.core.config import ModelConfig
from difftransformer.core.model import TransformerLM

if TYPE_CHECKING:
    from transformers import PreTrainedModel
from difftransformer.core.rotary import ROPE_SCALINGS, rope_scaling_problem
from difftransformer.errors import InputError

# ModelConfig's fields and the Llama and DiffLlama configs' names for them (the rest are converted one by one)
SAME_FIELDS = (
    ("vocab_size", "vocab_size"),
    ("d_model", "hidden_size"),
    ("n_layers", "num_hidden_layers"),
    ("n_heads", "num_attention_heads"),
    ("n_kv_heads", "num_key_value_heads"),
    ("ffn_dim", "intermediate_size"),
    ("max_seq_len", "max_position_embeddings"),
    ("norm_eps", "rms_norm_eps"),
)


def _transformers():
    try:
        import transformers
    except ImportError as err:
        raise ImportError("difftransformer.interop.hf needs `transformers`: pip install 'transformers>=4.48'") from err
    return transformers


def _rope_perm(d: int) -> torch.Tensor:
    """Row order that turns interleaved rotary pairs (2i, 2i+1) into rotate-half pairs (i, i + d/2)."""
    return torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2)))


def _diff_rows_to_hf(w: torch.Tensor, groups: int, d: int, rope: bool) -> torch.Tensor:
    """(groups, 2, d, D) rows, ours -> (2, groups, d, D), DiffLlama's."""
    w = w.view(groups, 2, d, -1)
    if rope:
        w = w[:, :, _rope_perm(d)]
    return w.transpose(0, 1).reshape(2 * groups * d, -1)


def _diff_rows_from_hf(w: torch.Tensor, groups: int, d: int, rope: bool) -> torch.Tensor:
    w = w.view(2, groups, d, -1).transpose(0, 1)
    if rope:
        w = w[:, :, torch.argsort(_rope_perm(d))]
    return w.reshape(2 * groups * d, -1)


def _heads_to_hf(w: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    return w.view(heads, d, -1)[:, _rope_perm(d)].reshape(heads * d, -1)


def _heads_from_hf(w: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    return w.view(heads, d, -1)[:, torch.argsort(_rope_perm(d))].reshape(heads * d, -1)


def _same_weights(n_layers: int, include_out_proj: bool):
    """(our name, Hugging Face name) of the weights that are copied unchanged in both directions."""
    yield "embed.weight", "model.embed_tokens.weight"
    yield "norm.weight", "model.norm.weight"
    for i in range(n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        yield ours + "attn_norm.weight", theirs + "input_layernorm.weight"
        yield ours + "ffn_norm.weight", theirs + "post_attention_layernorm.weight"
        for name in ("gate_proj", "up_proj", "down_proj"):
            yield ours + f"ffn.{name}.weight", theirs + f"mlp.{name}.weight"
        if include_out_proj:
            yield ours + "attn.out_proj.weight", theirs + "self_attn.o_proj.weight"


def _major() -> int:
    return int(_transformers().__version__.split(".")[0])


def rope_entries(theta: float, scaling: dict | None) -> dict:
    """The rotary settings in both of transformers' spellings: ``rope_theta`` and ``rope_scaling`` (4.x) and
    ``rope_parameters`` (5.x). A config.json that holds both loads the same in every version (5.x reads the 4.x
    keys first, 4.x ignores ``rope_parameters``)."""
    rope_type = "default" if scaling is None else scaling["rope_type"]
    return {
        "rope_theta": theta,
        "rope_scaling": None if scaling is None else dict(scaling),
        "rope_parameters": {**(scaling or {}), "rope_type": rope_type, "rope_theta": theta},
    }


def _rope_kwargs(theta: float, scaling: dict | None) -> dict:
    """Config arguments for the installed transformers."""
    entries = rope_entries(theta, scaling)
    if _major() >= 5:
        return {"rope_parameters": entries["rope_parameters"]}
    return {"rope_theta": theta, "rope_scaling": entries["rope_scaling"]}


def _rope_of(hf_config) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) of a Llama-family config from any transformers version; scalings other than
    linear and llama3 are refused."""
    params = getattr(hf_config, "rope_parameters", None)
    if not params:  # transformers 4.x
        params = {**(getattr(hf_config, "rope_scaling", None) or {}), "rope_theta": hf_config.rope_theta}
    params = dict(params)
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    theta = float(params.pop("rope_theta", 10000.0))
    if rope_type == "default":
        return theta, None
    if rope_type not in ROPE_SCALINGS:
        raise InputError(
            f"rotary scaling {rope_type!r} is not supported; supported: default, {', '.join(ROPE_SCALINGS)}"
        )
    if params.get("attention_factor", 1.0) != 1.0:
        raise InputError(
            f"rotary scaling {rope_type!r} with attention_factor {params['attention_factor']} is not supported"
        )
    scaling = {"rope_type": rope_type, **{key: params.get(key) for key in ROPE_SCALINGS[rope_type]}}
    if (problem := rope_scaling_problem(scaling)) is not None:
        raise InputError(f"rope scaling of the Hugging Face config {problem}")
    return theta, scaling


def to_hf(
    model: TransformerLM,
    eos_token_id: int | list[int] | None = None,
    bos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> PreTrainedModel:
    """A transformers ``DiffLlamaForCausalLM`` (attention="diff") or ``LlamaForCausalLM`` (attention="standard") with
    this model's weights, computing the same logits.

    Args:
        model: a TransformerLM of the paper's architecture (not an ablation, which DiffLlama cannot express).
        eos_token_id: the end token(s) ``generate()`` stops at (a list for several); None leaves it unset.
        bos_token_id: the begin-of-text token, if the model has one.
        pad_token_id: the padding token.

    Returns:
        The transformers model, in eval mode.

    Examples:
        >>> import torch
        >>> from difftransformer import ModelConfig, TransformerLM
        >>> model = TransformerLM(ModelConfig.preset("tiny")).eval()
        >>> hf = to_hf(model, eos_token_id=256)
        >>> type(hf).__name__
        'DiffLlamaForCausalLM'
        >>> tokens = torch.randint(0, 256, (1, 12))
        >>> with torch.no_grad():
        ...     torch.allclose(hf(tokens).logits, model(tokens), atol=1e-4)
        True
    """
    tf = _transformers()
    cfg = model.config
    if cfg.attention == "diff_v2":
        raise InputError("attention='diff_v2' has no Hugging Face architecture; convert a 'diff' or 'standard' model")
    if cfg.rope_theta is None:
        raise InputError("Hugging Face Llama models always use rotary embedding; this model has rope_theta=None")
    from difftransformer.core.quantized import is_quantized

    if is_quantized(model):
        raise InputError("this model is quantized (difftx quantize): convert its float source run instead")
    if cfg.is_ablation:
        raise InputError(
            "this model uses an ablation option (head_norm, lambda_init or diff_heads) that DiffLlama and Llama cannot "
            "represent; only the paper's architecture converts"
        )
    d = cfg.head_dim
    common = dict(
        **{theirs: getattr(cfg, ours) for ours, theirs in SAME_FIELDS},
        head_dim=d,
        tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std,
        hidden_act="silu",
        attention_bias=False,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        **_rope_kwargs(cfg.rope_theta, cfg.rope_scaling),
    )
    diff = cfg.attention == "diff"
    hf_cls = tf.DiffLlamaForCausalLM if diff else tf.LlamaForCausalLM
    hf_config = tf.DiffLlamaConfig(**common) if diff else tf.LlamaConfig(mlp_bias=False, **common)
    ours = model.state_dict()
    sd = {theirs: ours[name] for name, theirs in _same_weights(cfg.n_layers, include_out_proj=not diff)}
    sd["lm_head.weight"] = model.lm_head.weight
    for i, block in enumerate(model.layers):
        p, a = f"model.layers.{i}.", block.attn
        if diff:
            h, hkv = a.num_heads, a.num_kv_heads
            sd[p + "self_attn.q_proj.weight"] = _diff_rows_to_hf(a.q_proj.weight, h, d, rope=True)
            sd[p + "self_attn.k_proj.weight"] = _diff_rows_to_hf(a.k_proj.weight, hkv, d, rope=True)
            sd[p + "self_attn.v_proj.weight"] = _diff_rows_to_hf(a.v_proj.weight, hkv, d, rope=False)
            sd[p + "self_attn.o_proj.weight"] = a.out_proj.weight * a.subln.weight.repeat(h)
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                sd[p + f"self_attn.{name}"] = getattr(a, name)
        else:
            sd[p + "self_attn.q_proj.weight"] = _heads_to_hf(a.q_proj.weight, a.num_heads, d)
            sd[p + "self_attn.k_proj.weight"] = _heads_to_hf(a.k_proj.weight, a.num_kv_heads, d)
            sd[p + "self_attn.v_proj.weight"] = a.v_proj.weight
    hf_model = hf_cls(hf_config)
    hf_model.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=True)
    return hf_model.to(model.embed.weight.dtype).eval()


def from_hf(hf_model: PreTrainedModel) -> TransformerLM:
    """A TransformerLM with the weights of a ``DiffLlamaForCausalLM`` or ``LlamaForCausalLM``.

    Args:
        hf_model: the transformers model (its rotary scaling ``linear`` or ``llama3``, or none).

    Returns:
        The TransformerLM, computing the same logits.

    Examples:
        >>> import torch
        >>> from difftransformer import ModelConfig, TransformerLM
        >>> model = TransformerLM(ModelConfig.preset("tiny")).eval()
        >>> back = from_hf(to_hf(model)).eval()
        >>> tokens = torch.randint(0, 256, (1, 12))
        >>> with torch.no_grad():
        ...     torch.allclose(back(tokens), model(tokens), atol=1e-5)
        True
    """
    hc = hf_model.config
    arch = type(hf_model).__name__
    if arch not in ("DiffLlamaForCausalLM", "LlamaForCausalLM"):
        raise InputError(f"cannot convert {arch}; from_hf takes DiffLlamaForCausalLM or LlamaForCausalLM")
    d = getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads
    if d * hc.num_attention_heads != hc.hidden_size:
        raise InputError(
            f"head_dim {d} * num_attention_heads {hc.num_attention_heads} != hidden_size {hc.hidden_size}: "
            "TransformerLM needs head size = d_model / n_heads"
        )
    if hc.hidden_act != "silu":
        raise InputError(f"hidden_act is {hc.hidden_act!r}: only SiLU-gated MLPs can be converted (hidden_act='silu')")
    for flag, what in (("attention_bias", "the attention projections"), ("mlp_bias", "the MLP")):
        if getattr(hc, flag, False):
            raise InputError(f"{flag} is true: {what} have biases, which TransformerLM has not (the paper's "
                             "LLaMA-style model has none); only models without biases can be converted")  # fmt: skip
    diff = arch == "DiffLlamaForCausalLM"
    theta, scaling = _rope_of(hc)
    cfg = ModelConfig(
        **{ours: getattr(hc, theirs) for ours, theirs in SAME_FIELDS},
        rope_theta=theta,
        rope_scaling=scaling,
        attention="diff" if diff else "standard",
        tie_embeddings=_tied(hf_model),
        init_std=getattr(hc, "initializer_range", 0.02),
    )
    src = {k: v.detach() for k, v in hf_model.state_dict().items()}
    model = TransformerLM(cfg).to(src["model.embed_tokens.weight"].dtype)
    sd = {name: src[theirs] for name, theirs in _same_weights(cfg.n_layers, include_out_proj=True)}
    sd["lm_head.weight"] = src.get("lm_head.weight", src["model.embed_tokens.weight"])
    for i, block in enumerate(model.layers):
        p, q, a = f"model.layers.{i}.", f"layers.{i}.", block.attn
        if diff:
            h, hkv = a.num_heads, a.num_kv_heads
            sd[q + "attn.q_proj.weight"] = _diff_rows_from_hf(src[p + "self_attn.q_proj.weight"], h, d, rope=True)
            sd[q + "attn.k_proj.weight"] = _diff_rows_from_hf(src[p + "self_attn.k_proj.weight"], hkv, d, rope=True)
            sd[q + "attn.v_proj.weight"] = _diff_rows_from_hf(src[p + "self_attn.v_proj.weight"], hkv, d, rope=False)
            sd[q + "attn.subln.weight"] = torch.ones(2 * d, dtype=src[p + "self_attn.o_proj.weight"].dtype)
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                sd[q + f"attn.{name}"] = src[p + f"self_attn.{name}"].float()
        else:
            sd[q + "attn.q_proj.weight"] = _heads_from_hf(src[p + "self_attn.q_proj.weight"], a.num_heads, d)
            sd[q + "attn.k_proj.weight"] = _heads_from_hf(src[p + "self_attn.k_proj.weight"], a.num_kv_heads, d)
            sd[q + "attn.v_proj.weight"] = src[p + "self_attn.v_proj.weight"]
    with own_layout():  # DiffLlama's head pairing is known (module docstring)
        model.load_state_dict(sd, strict=True)
    return model.eval()


def _tied(hf_model: PreTrainedModel) -> bool:
    """Whether the model's output head is its embedding, as the loaded model computes: ``tie_word_embeddings`` in
    its config, and one weight for both. A file with a head of its own under a tied config is kept apart by some
    transformers versions (whose logits then use that head) and tied by others: the loaded model says which."""
    if not getattr(hf_model.config, "tie_word_embeddings", False):
        return False
    head, embed = hf_model.get_output_embeddings().weight, hf_model.get_input_embeddings().weight
    return head is embed or head.data_ptr() == embed.data_ptr() or torch.equal(head, embed)


def diff_from_standard(base: TransformerLM, lambda_start: float = -1.0) -> TransformerLM:
    """A DIFF TransformerLM initialised from a standard one, e.g. ``from_hf(a LlamaForCausalLM)`` (docs/paper.md
    sections 1 and 2), to be trained further (``difftx train --init-from``).

    Head mapping: within each key/value head pair (2g, 2g+1), query heads (2g) * rep + r and (2g + 1) * rep + r
    become the two components of DIFF head g * rep + r, so each component keeps its own keys; group g's 2d-wide value
    is the concatenation of value heads 2g and 2g+1, and the output columns follow. No setting reproduces the
    original exactly (a DIFF head applies one combined map to both halves of its value).

    Args:
        base: the standard model; its key/value heads must come in pairs.
        lambda_start: the lambda every layer starts at (its lambda vectors set to give it); -1 adds the two maps,
            which measured closest to the original.

    Returns:
        The DIFF model.

    Examples:
        >>> from difftransformer import ModelConfig, TransformerLM
        >>> diff = diff_from_standard(TransformerLM(ModelConfig.preset("tiny", attention="standard")))
        >>> diff.config.attention, round(diff.layers[0].attn.lambda_full().item(), 4)
        ('diff', -1.0)
    """
    cfg = base.config
    if cfg.attention != "standard" or cfg.n_heads % 2 or cfg.n_kv_heads % 2 or cfg.is_ablation:
        raise InputError(
            "diff_from_standard takes a standard model (no ablation option) with even numbers of query and key/value "
            f"heads, got {cfg.attention} with {cfg.n_heads} and {cfg.n_kv_heads}"
        )
    diff = TransformerLM(ModelConfig.from_dict({**cfg.to_dict(), "attention": "diff"}))
    groups, d = diff.config.attention_kv_heads, cfg.head_dim
    rep = diff.config.attention_heads // groups
    sd = {k: v for k, v in base.state_dict().items() if ".attn." not in k}
    small = math.sqrt(0.01 / d)  # lambda_q1 . lambda_k1 = 0.01, small but trainable
    for i, (src, dst) in enumerate(zip(base.layers, diff.layers, strict=True)):
        a, p = src.attn, f"layers.{i}.attn."
        q = a.q_proj.weight.view(groups, 2, rep, d, -1)  # (group, component, r, d, D)
        sd[p + "q_proj.weight"] = q.transpose(1, 2).reshape(-1, cfg.d_model)  # rows (g, r, component, d)
        sd[p + "k_proj.weight"] = a.k_proj.weight  # kv head 2g + c is component c of group g
        sd[p + "v_proj.weight"] = a.v_proj.weight  # group g's value: heads 2g and 2g + 1
        out = a.out_proj.weight.view(cfg.d_model, groups, 2, rep, d)
        sd[p + "out_proj.weight"] = out.transpose(2, 3).reshape(cfg.d_model, -1)
        lambda_init = dst.attn.lambda_init
        second = math.sqrt(max(math.log(math.exp(0.01) + lambda_init - lambda_start), 1e-6) / d)
        for name, value in (("lambda_q1", small), ("lambda_k1", small), ("lambda_q2", second), ("lambda_k2", second)):
            sd[p + name] = torch.full((d,), value)
        sd[p + "subln.weight"] = torch.full((2 * d,), 1.0 / (1.0 - lambda_init))
    with own_layout():
        diff.load_state_dict(sd, strict=True)
    return diff.eval()


@torch.no_grad()
def calibrate_subln(diff: TransformerLM, reference: TransformerLM, tokens: torch.Tensor) -> None:
    """Scale each layer's ``subln.weight`` so that the DIFF heads' outputs have the RMS that the reference
    (standard) model's heads have on ``tokens``, layer by layer (both models see the reference's hidden states).

    Args:
        diff: the DIFF model made by ``diff_from_standard`` (changed in place).
        reference: the standard model it was made from.
        tokens: a batch of token windows, (B, T).

    Examples:
        >>> import torch
        >>> from difftransformer import ModelConfig, TransformerLM
        >>> standard = TransformerLM(ModelConfig.preset("tiny", attention="standard"))
        >>> diff = diff_from_standard(standard)
        >>> calibrate_subln(diff, standard, torch.randint(0, 256, (2, 64)))
        >>> diff.layers[0].attn.subln.weight.shape
        torch.Size([32])
    """
    captured: dict[str, torch.Tensor] = {}

    def keep(name: str):  # a pre-hook that records the heads' concatenated output (out_proj's input)
        return lambda _module, args: captured.__setitem__(name, args[0])

    x = reference.embed(tokens)
    for src, dst in zip(reference.layers, diff.layers, strict=True):
        h = src.attn_norm(x)
        hooks = [
            src.attn.out_proj.register_forward_pre_hook(keep("std")),
            dst.attn.out_proj.register_forward_pre_hook(keep("diff")),
        ]
        src.attn(h)
        dst.attn(h)
        for hook in hooks:
            hook.remove()
        target = captured["std"].pow(2).mean().sqrt()
        current = captured["diff"].pow(2).mean().sqrt()
        dst.attn.subln.weight.mul_(target / current)
        x = src(x)
