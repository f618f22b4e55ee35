"""TransformerLM: a LLaMA-style pre-norm decoder around any of the attention variants (docs/paper.md section 2).

Weight initialisation (deliberate, see ``reset_parameters``):
- token embedding and every Linear: N(0, init_std), init_std = 0.02 as in DiffLlama and GPT-2;
- the two projections that write into the residual stream (attention ``out_proj`` and FFN ``down_proj``):
  N(0, init_std / sqrt(2 * n_layers)), so the residual stream's variance does not grow with depth;
- RMSNorm weights (``subln`` included): 1; DIFF's four lambda vectors: N(0, 0.1) (the paper);
- with tied embeddings the output head is the embedding matrix.
Two generators seeded from one draw of torch's global RNG (taken before any module is built) fill the
shared parts (embeddings, FFN, head) and the attention, so under the same ``torch.manual_seed`` the DIFF and
standard models of one config start from the same embedding, FFN and head weights.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from difftransformer.core.attention import ATTENTION, MultiheadDiffAttn
from difftransformer.core.attention.common import KVStore, expand_mask
from difftransformer.core.config import ModelConfig
from difftransformer.core.layers import RMSNorm, SwiGLU
from difftransformer.core.rotary import check_positions, rotary_angles
from difftransformer.errors import InputError


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + ffn(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = ATTENTION[cfg.attention].from_config(cfg, layer_idx)
        self.ffn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.ffn = SwiGLU(cfg.d_model, cfg.ffn_dim)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: KVStore | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``rotary``: the (cos, sin) of the tokens' positions, read once by the model for every block."""
        h = self.attn_norm(x)
        x = x + self.dropout(self.attn(h, mask=mask, cache=cache, rotary=rotary))
        return x + self.dropout(self.ffn(self.ffn_norm(x)))


class TransformerLM(nn.Module):
    """Decoder language model: token embedding -> n_layers blocks -> RMSNorm -> output head.

    Each block is pre-norm: RMSNorm, the attention ``config.attention`` names, RMSNorm, a SwiGLU feed-forward
    network; ``config.attention`` flips a DIFF model into its matched standard one.

    Args:
        config: the model's shape (a ModelConfig; ``ModelConfig.preset`` gives the paper's sizes).

    Examples:
        >>> import torch
        >>> model = TransformerLM(ModelConfig.preset("tiny", attention="diff"))
        >>> model(torch.randint(0, 256, (2, 16))).shape
        torch.Size([2, 16, 256])
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        init_seed = int(torch.randint(0, 2**62, (), device="cpu").item())
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self._rotary_tables()
        self.reset_parameters(init_seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Initialise every weight as the module docstring says; seed=None draws one from torch's RNG."""
        if seed is None:
            seed = int(torch.randint(0, 2**62, (), device="cpu").item())
        device = self.embed.weight.device
        if device.type == "meta":
            return
        shared = torch.Generator(device).manual_seed(seed)
        attention = torch.Generator(device).manual_seed(seed + 1)
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.n_layers)
        nn.init.normal_(self.embed.weight, mean=0.0, std=std, generator=shared)
        if not self.config.tie_embeddings:
            nn.init.normal_(self.lm_head.weight, mean=0.0, std=std, generator=shared)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.reset_parameters()
        for block in self.layers:
            block.attn.reset_head_norm()  # a per-head norm's initial gain (ModelConfig.head_norm_gain)
            for name, module in block.named_modules():
                if isinstance(module, nn.Linear):
                    gen = attention if name.startswith("attn.") else shared
                    is_residual = name.endswith(("out_proj", "down_proj"))
                    nn.init.normal_(module.weight, mean=0.0, std=residual_std if is_residual else std, generator=gen)
            if isinstance(block.attn, MultiheadDiffAttn):
                block.attn.reset_lambda(attention)

    def forward(
        self,
        tokens: torch.Tensor,
        mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        cache: KVStore | None = None,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens: (B, T) int64 -> logits (B, T, vocab_size). In eval mode an id outside the vocabulary is refused
        with a clear error; in training mode the ids are not read on the host (that would stall a GPU every step):
        the trainer checks its data once, when it opens them.

        mask: optional boolean (B, T) padding mask (True for real tokens) or (B, T, T) attention mask; with a cache
        they cover the cache's slots instead of T: (B, L) or (B, T, L).
        positions: optional (T,) or (B, T) positions for the rotary embedding (default 0..T-1, or the slots).
        cache: optional KVStore (difftransformer.inference.cache.KVCache): this pass's keys and values are written at
        ``slots`` (default: the next T after ``cache.length``, which then advances) and every slot is attended (a
        first pass without padding: its own slots, causally; KVCache.prepare).
        """
        auto_slots = cache is not None and slots is None
        self._check_tokens(tokens, cache.length if auto_slots else 0, cache)
        b, t = tokens.shape
        if cache is not None:
            if auto_slots:
                slots = torch.arange(cache.length, cache.length + t, device=tokens.device)
            cache.prepare(slots, mask, start=cache.length if auto_slots else None)  # one mask for every layer
            mask, positions = None, slots if positions is None else positions
        elif mask is not None:
            mask = expand_mask(mask, b, t, t)  # normalised once for every layer
        x = self.embed(tokens)
        rotary = self.rotary(positions, t)
        for block in self.layers:
            x = block(x, mask=mask, cache=cache, rotary=rotary)
        if auto_slots:
            cache.length += t
        return self.lm_head(self.norm(x))

    def rotary(self, positions: torch.Tensor | None, t: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos and sin of ``positions`` ((T,) or (B, T); default 0..T-1), read from the model's tables."""
        if self.rope_cos is None:
            return None
        if positions is None:
            return self.rope_cos[:t], self.rope_sin[:t]
        check_positions(positions, t)
        if not torch.compiler.is_compiling() and positions.device.type != "meta" and positions.numel():
            if positions.min() < 0 or positions.max() >= self.config.max_seq_len:
                raise InputError(
                    f"positions must lie in [0, {self.config.max_seq_len}) (the model's max_seq_len), got "
                    f"{int(positions.min())} to {int(positions.max())}"
                )
        return self.rope_cos[positions], self.rope_sin[positions]

    def _rotary_tables(self) -> None:
        """The rotary angles' cos and sin for every position up to max_seq_len, as (non-saved) buffers, in float32
        (float64 for a float64 model): kept at that precision whatever dtype the model is cast to."""
        cfg, like = self.config, self.embed.weight
        if cfg.rope_theta is None:
            self.rope_cos = self.rope_sin = None
            return
        positions = torch.arange(cfg.max_seq_len, device=like.device)
        dtype = torch.promote_types(like.dtype, torch.float32)
        cos, sin = rotary_angles(positions, cfg.attention_head_dim, cfg.rope_theta, dtype, cfg.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _apply(self, fn, recurse=True):
        self.rope_cos = self.rope_sin = None  # derived from the config: dropped, then rebuilt on the new device
        super()._apply(fn, recurse)
        self._rotary_tables()
        return self

    def _check_tokens(self, tokens: torch.Tensor, cached: int, cache: KVStore | None) -> None:
        if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise InputError(f"tokens must be a (batch, seq) integer tensor, got {tuple(tokens.shape)} {tokens.dtype}")
        t = tokens.shape[1] + cached
        if t > self.config.max_seq_len:
            raise InputError(
                f"sequence of {t} tokens is longer than the model's context max_seq_len={self.config.max_seq_len}; "
                "shorten the input or build the model with a larger max_seq_len"
            )
        if cache is not None and t > cache.max_len:
            raise InputError(f"the cache holds {cache.max_len} slots; {t} were asked for")
        if (  # a read of the ids on the host: in eval mode only (a training step would wait on it; the training
            # data are checked when opened), and not while torch.compile traces (no graph break)
            not self.training
            and not torch.compiler.is_compiling()
            and tokens.device.type != "meta"
            and tokens.numel()
            and (tokens.min() < 0 or tokens.max() >= self.config.vocab_size)
        ):
            raise InputError(
                f"token ids must lie in [0, {self.config.vocab_size}), got min {int(tokens.min())} and max "
                f"{int(tokens.max())}: the data and the model use different vocabularies"
            )

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of distinct parameters (a tied embedding counts once)."""
        params = {id(p): p for p in self.parameters()}
        if exclude_embeddings:
            params.pop(id(self.embed.weight), None)
            params.pop(id(self.lm_head.weight), None)
        return sum(p.numel() for p in params.values())


def count_parameters(config: ModelConfig, exclude_embeddings: bool = False) -> int:
    """Parameter count of ``TransformerLM(config)``, built on the meta device (no memory allocated).

    Args:
        config: the model's shape.
        exclude_embeddings: leave out the token embedding and the output head (the count scaling laws use).

    Returns:
        The number of parameters.

    Examples:
        >>> count_parameters(ModelConfig.preset("tiny"))
        1345728
        >>> count_parameters(ModelConfig.preset("tiny", attention="standard"))
        1345152
    """
    with torch.device("meta"):
        return TransformerLM(config).num_parameters(exclude_embeddings)
