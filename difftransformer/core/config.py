"""ModelConfig: the decoder's shape, validated, with named presets and a JSON round trip."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from difftransformer.core.rotary import rope_scaling_problem
from difftransformer.errors import ConfigError, Fields, InputError
from difftransformer.fsutil import parse_json_object, read_text

ATTENTION_KINDS = ("diff", "diff_v2", "standard")
DIFF_HEADS = ("half", "all")
# Exact methods of differential attention V1 (difftransformer.core.attention.kernels says what each does).
DIFF_IMPLS = ("auto", "sdpa", "block", "plain", "triton")
FFN_MULTIPLE = 64


def default_ffn_dim(d_model: int) -> int:
    """8/3 * d_model (SwiGLU with the parameters of a 4x MLP), rounded up to a multiple of 64."""
    return FFN_MULTIPLE * math.ceil(8 * d_model / 3 / FFN_MULTIPLE)


@dataclass
class ModelConfig:
    """Shape of a TransformerLM.

    ``n_heads`` and ``n_kv_heads`` count the heads of the matched *standard* Transformer: with
    ``attention="diff"`` the model uses ``n_heads // 2`` differential heads and ``n_kv_heads // 2`` key/value
    groups of the same head size ``d_model // n_heads``, so flipping ``attention`` gives the paper's matched
    pair (docs/paper.md section 2). ``diff_v2`` keeps ``n_heads`` output heads and doubles the query heads.
    The counts of the heads as built are ``attention_heads`` and ``attention_kv_heads``; an attention module takes
    them as ``num_heads`` and ``num_kv_heads`` (the paper code's names). So ``n_*`` always counts the standard
    model's heads and ``num_*`` the module's own, and no third name exists.

    Three options change the attention for the paper's ablations (Table 6) and leave everything else as it is:
    ``head_norm`` (the per-head RMSNorm: None is each kind's own choice, on for ``diff``, off for ``standard`` and
    ``diff_v2``; False removes it from ``diff``, keeping the 1 - lambda_init factor; True adds it to ``standard``),
    ``lambda_init`` (``diff`` only: None is the schedule 0.8 - 0.6 exp(-0.3 layer_idx), a number in [0, 1) is used
    in every layer) and ``diff_heads`` (``diff`` only: "half" is the paper's n_heads // 2 heads of size
    d_model / n_heads; "all" uses n_heads differential heads of half that size, as many heads as the standard
    model, with the same parameter count).

    One option changes only the initialisation, and is this library's, not the paper's: ``head_norm_gain``, the
    initial weight of the per-head norm (``diff`` with its norm, or ``standard`` with ``head_norm=True``). None or 1.0
    start it at 1, as the paper does; a positive number starts every layer's there; ``"matched"`` starts each layer at
    the gain that gives its attention block the standard model's output RMS at initialisation, computed from this
    configuration for text (``difftransformer.core.head_norm_gain``; docs/guide/modules.md) whose tokens coincide
    with probability ``head_norm_collision`` (None: Zipf's law over the vocabulary). The architecture, the
    parameter count and the Hugging Face form are the paper's. ``head_norm_gain_fixed=True`` instead keeps the
    weight at 1 and multiplies the norm's output by the gain as a constant (the same initial scale, not learned: a
    control for the study of ``difftx repro lm --part norm``; an architecture change, so it does not convert).

    Examples:
        >>> cfg = ModelConfig.preset("small")  # the paper's matched pair: flip `attention`
        >>> standard = ModelConfig.preset("small", attention="standard")
        >>> cfg.d_model, cfg.n_layers, cfg.attention_heads, standard.attention_heads
        (256, 8, 4, 8)
        >>> ModelConfig(d_model=100, n_heads=8)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        difftransformer.errors.ConfigError: ModelConfig.d_model 100 is not divisible by n_heads 8; the head size ...
    """

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 6
    n_heads: int = 8
    n_kv_heads: int | None = None
    ffn_dim: int | None = None
    max_seq_len: int = 256
    rope_theta: float | None = 10000.0
    rope_scaling: dict[str, Any] | None = (
        None  # see difftransformer.core.rotary: linear or llama3, as in Llama checkpoints
    )
    norm_eps: float = 1e-5
    attention: str = "diff"
    attn_impl: str = "auto"
    tie_embeddings: bool = False
    init_std: float = 0.02
    dropout: float = 0.0
    head_norm: bool | None = None
    lambda_init: float | None = None
    diff_heads: str = "half"
    head_norm_gain: float | str | None = None
    head_norm_gain_fixed: bool = False
    head_norm_collision: float | None = None

    def __post_init__(self) -> None:
        if self.rope_scaling is not None and isinstance(self.rope_scaling, dict):
            self.rope_scaling = dict(self.rope_scaling)
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.ffn_dim is None:
            self.ffn_dim = default_ffn_dim(self.d_model)
        self._validate()

    def _validate(self) -> None:
        check = Fields(self)
        check.integer("vocab_size", 1, 1 << 24)
        check.integer("d_model", 1, 1 << 16)
        check.integer("n_layers", 1, 1024)
        check.integer("n_heads", 1, self.d_model)
        check.integer("n_kv_heads", 1, self.n_heads)
        check.integer("ffn_dim", 1, 1 << 20)
        check.integer("max_seq_len", 1, 1 << 22)
        check.number("rope_theta", 0, low_open=True, optional=True)
        if (problem := rope_scaling_problem(self.rope_scaling)) is not None:
            check.fail("rope_scaling", problem)
        if self.rope_scaling is not None and self.rope_theta is None:
            check.fail("rope_scaling", "needs a rotary embedding, but `rope_theta` is None")
        check.number("norm_eps", 0, 1, low_open=True, high_open=True)
        check.number("init_std", 0, 1, low_open=True)
        check.number("dropout", 0, 1, high_open=True)
        check.choice("attention", ATTENTION_KINDS)
        check.choice("attn_impl", DIFF_IMPLS)
        if self.attn_impl != "auto" and self.attention != "diff":
            check.fail(
                "attn_impl",
                f"chooses among the methods of 'diff' attention; {self.attention!r} has one method, so leave it 'auto'",
            )
        check.boolean("tie_embeddings")
        self._validate_ablations(check)
        if self.d_model % self.n_heads:
            check.fail(
                "d_model",
                f"{self.d_model} is not divisible by `n_heads` {self.n_heads}; the head size is d_model / n_heads, "
                "so pick n_heads among the divisors of d_model",
            )
        if self.n_heads % self.n_kv_heads:
            check.fail(
                "n_kv_heads",
                f"{self.n_kv_heads} does not divide `n_heads` {self.n_heads}; pick n_kv_heads among the divisors of "
                f"{self.n_heads}",
            )
        if self.attention == "diff" and self.diff_heads == "half" and (self.n_heads % 2 or self.n_kv_heads % 2):
            check.fail(
                "attention",
                f"'diff' uses n_heads // 2 differential heads and n_kv_heads // 2 groups, so both must be even; got "
                f"`n_heads` {self.n_heads} and `n_kv_heads` {self.n_kv_heads}",
            )
        if self.rope_theta is not None and self.attention_head_dim % 2:
            check.fail(
                "rope_theta",
                f"(rotary embedding) needs an even head size; the attention's head size is {self.attention_head_dim}. "
                "Change `d_model` or `n_heads`, or set rope_theta to None",
            )

    def _validate_ablations(self, check: Fields) -> None:
        check.boolean("head_norm", optional=True)
        check.number("lambda_init", 0, 1, high_open=True, optional=True)
        check.choice("diff_heads", DIFF_HEADS)
        if self.head_norm is not None and self.attention == "diff_v2":
            check.fail("head_norm", "is for 'diff' and 'standard' attention; 'diff_v2' has no per-head norm")
        for name, default in (("lambda_init", None), ("diff_heads", "half")):
            if getattr(self, name) != default and self.attention != "diff":
                check.fail(name, f"applies to attention 'diff' only (this model has {self.attention!r})")
        if self.head_norm_gain != "matched":
            check.number("head_norm_gain", 0, 1e3, low_open=True, optional=True, hint=" or 'matched'")
        normed = self.head_norm is not False if self.attention == "diff" else self.head_norm is True
        if self.head_norm_gain is not None and not normed:
            check.fail(
                "head_norm_gain",
                "is the initial weight of the per-head norm, but this model has none ("
                + (f"attention {self.attention!r}" if self.attention != "diff" else "head_norm False")
                + "); use 'diff', or 'standard' with head_norm True",
            )
        check.boolean("head_norm_gain_fixed")
        check.number("head_norm_collision", 0, 1, optional=True)
        if self.head_norm_collision is not None and self.head_norm_gain != "matched":
            check.fail(
                "head_norm_collision", "is the token statistic of head_norm_gain 'matched'; set that too, or drop it"
            )
        if self.head_norm_gain_fixed and self.head_norm_gain is None:
            check.fail("head_norm_gain_fixed", "makes `head_norm_gain` a constant factor, so it needs a head_norm_gain")
        if self.attention == "diff" and self.diff_heads == "all" and (self.d_model // self.n_heads) % 2:
            check.fail(
                "diff_heads",
                f"'all' splits each head of size d_model / n_heads = {self.d_model // self.n_heads} into two halves, "
                "so that size must be even; change `d_model` or `n_heads`",
            )

    @property
    def head_dim(self) -> int:
        """Head size of the matched standard Transformer, which is also DIFF's half-head size d."""
        return self.d_model // self.n_heads

    @property
    def attention_heads(self) -> int:
        """Heads of the attention module as built: n_heads // 2 differential heads for 'diff' (n_heads with
        diff_heads='all'), n_heads for 'standard' and 'diff_v2'."""
        return self.n_heads // 2 if self._halves_heads else self.n_heads

    @property
    def attention_kv_heads(self) -> int:
        """Key/value heads of the attention module as built (halved with the heads for 'diff')."""
        return self.n_kv_heads // 2 if self._halves_heads else self.n_kv_heads

    @property
    def attention_head_dim(self) -> int:
        """The size of one query/key head as the attention uses it: head_dim, or half of it with diff_heads='all'
        (each 'diff' head has two query/key halves of this size and a value of twice it)."""
        split = self.attention == "diff" and self.diff_heads == "all"
        return self.head_dim // 2 if split else self.head_dim

    @property
    def _halves_heads(self) -> bool:
        return self.attention == "diff" and self.diff_heads == "half"

    @property
    def is_ablation(self) -> bool:
        """Whether an ablation option departs from the paper's architecture."""
        return (
            self.head_norm is not None
            or self.lambda_init is not None
            or self.diff_heads != "half"
            or self.head_norm_gain_fixed
        )

    def head_norm_gains(self) -> tuple[float, ...] | None:
        """The per-layer gain of the per-head norm (``head_norm_gain`` resolved; ``"matched"`` computed by
        ``head_norm_gain.matched_gains``), or None when the norm starts at 1 (None or no norm)."""
        if self.head_norm_gain is None:
            return None
        if self.head_norm_gain == "matched":
            from difftransformer.core.head_norm_gain import matched_gains

            return matched_gains(self)
        return (float(self.head_norm_gain),) * self.n_layers

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A named configuration (see PRESETS), with fields overridden by keyword."""
        if name not in PRESETS:
            raise ConfigError("ModelConfig", "preset", f"{name!r} is unknown; choose one of {', '.join(PRESETS)}")
        return cls.from_dict({**PRESETS[name], **overrides})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = [f.name for f in dataclasses.fields(cls)]
        for name in data:
            if name not in known:
                raise ConfigError("ModelConfig", str(name), f"is not a ModelConfig field; known: {', '.join(known)}")
        return cls(**data)

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, source: str | Path) -> ModelConfig:
        """From a JSON string or a path to a JSON file."""
        text, where = str(source), "model config"
        if not text.lstrip().startswith("{"):
            path = Path(source)
            if not path.is_file():
                raise FileNotFoundError(f"model config {path} does not exist")
            text, where = read_text(path), str(path)
        data = parse_json_object(text, where)
        try:
            return cls.from_dict(data)
        except ConfigError as err:
            if where == "model config":
                raise
            raise InputError(f"{where}: {err}") from None


# The paper's sizes (docs/paper.md section 2) tie the input and output embeddings: counted so, the parameter
# counts reproduce the size names (the paper does not say whether it tied them). The scaling models'
# vocabulary is taken to be the 3B model's cl100k (100,288), which the paper states only for the 3B model.
_PAPER = dict(vocab_size=100288, max_seq_len=2048, tie_embeddings=True)
PRESETS: dict[str, dict[str, Any]] = {
    # For tests and the CPU demo: about 1.3M parameters, 8 standard heads (4 differential) of size 16.
    "tiny": dict(d_model=128, n_layers=6, n_heads=8, max_seq_len=256),
    # CPU-trainable sizes.
    "small": dict(d_model=256, n_layers=8, n_heads=8, max_seq_len=512),
    "medium": dict(d_model=384, n_layers=12, n_heads=12, max_seq_len=1024),
    "large": dict(d_model=768, n_layers=12, n_heads=12, max_seq_len=1024),
    "830m": dict(_PAPER, d_model=1536, n_layers=24, n_heads=16),
    "1.4b": dict(_PAPER, d_model=2048, n_layers=24, n_heads=16),
    "2.8b": dict(_PAPER, d_model=2560, n_layers=32, n_heads=20),
    "6.8b": dict(_PAPER, d_model=4096, n_layers=32, n_heads=32),
    "13.1b": dict(_PAPER, d_model=5120, n_layers=40, n_heads=40),
    "3b": dict(_PAPER, d_model=3072, n_layers=28, n_heads=24, ffn_dim=8192, max_seq_len=4096),
}
