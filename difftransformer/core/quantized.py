"""The integer weight format of a quantized model: QuantizedLinear and the schemes (post-training quantization
itself, with calibration, is in ``difftransformer.inference.quantize``).

Schemes (symmetric, absmax scales, zero point 0):

- ``w8a16``: int8 weights with one scale per output channel; activations stay float.
- ``w4a16``: int4 weights (levels -7..7) with one scale per group of ``GROUP`` input features of each output
  channel (the whole row when the width is not a multiple of it), stored two per byte.
- ``w8a8``: int8 per-channel weights, and each linear layer's input rounded to int8 with one static scale.

What is quantized: every linear layer inside the blocks (the attention projections and the FFN). The embedding,
the norms, DIFF's lambda vectors and the output head stay float: they are small, or, for the head, tied to the
embedding or the most sensitive layer. On CPU the weights are dequantized once (the files stay integer) and w8a8
rounds each linear input to its int8 grid at run time: the numerics of integer inference, not its speed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from difftransformer.errors import InputError

SCHEMES = {"w8a16": (8, False), "w4a16": (4, False), "w8a8": (8, True)}  # weight bits, integer activations


GROUP = 32  # int4 group size along the input features


def levels(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def group_size(in_features: int, bits: int) -> int:
    """Input features per weight scale: the whole row at 8 bits; GROUP at 4 bits when it divides the row."""
    return GROUP if bits == 4 and in_features % GROUP == 0 else in_features


def quantize_weight(weight: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values in -L..L, float32 scales (out, in / group)) with ``weight ~ values * scale`` per group."""
    out_features, in_features = weight.shape
    if in_features % group:
        raise InputError(f"group size {group} does not divide the {in_features} input features")
    w = weight.detach().to(torch.float32).reshape(out_features, in_features // group, group)
    scale = w.abs().amax(-1) / levels(bits)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group: any scale, values 0
    values = torch.round(w / scale[..., None]).clamp_(-levels(bits), levels(bits)).to(torch.int8)
    return values.reshape(out_features, in_features), scale


def dequantize_weight(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out_features, in_features = values.shape
    groups = scale.shape[1]
    w = values.to(torch.float32).reshape(out_features, groups, in_features // groups) * scale[..., None]
    return w.reshape(out_features, in_features)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int8 values in -8..7, an even number per row -> uint8, two per byte (even index in the low nibble)."""
    if values.shape[-1] % 2:
        raise InputError(f"int4 packing needs an even row width, got {values.shape[-1]}")
    nibbles = (values.to(torch.int16) + 8).to(torch.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    low = (packed & 0x0F).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def fake_quantize(x: torch.Tensor, scale: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """x rounded to the signed ``bits``-bit grid of step ``scale`` (values beyond the range are clipped)."""
    return torch.round(x / scale).clamp(-levels(bits), levels(bits)) * scale


class QuantizedLinear(nn.Module):
    """A bias-free linear layer with integer weights (and optionally int8 inputs), dequantized once for CPU use.

    State: ``qweight`` (int8 (out, in), or for 4 bits uint8 (out, in / 2) with two values per byte),
    ``weight_scale`` (float32 (out, in / group)) and, for integer inputs, ``input_scale`` (float32 scalar).
    """

    def __init__(self, in_features: int, out_features: int, bits: int, act: bool) -> None:
        super().__init__()
        if bits not in (4, 8):
            raise InputError(f"weights quantize to 8 or 4 bits, got {bits}")
        self.in_features, self.out_features, self.bits = in_features, out_features, bits
        group = group_size(in_features, bits)
        width = in_features // 2 if bits == 4 else in_features
        storage = torch.uint8 if bits == 4 else torch.int8
        self.register_buffer("qweight", torch.zeros(out_features, width, dtype=storage))
        self.register_buffer("weight_scale", torch.ones(out_features, in_features // group))
        self.register_buffer("input_scale", torch.ones(()) if act else None)
        self._dequantized: torch.Tensor | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int, input_scale: float | None) -> QuantizedLinear:
        if linear.bias is not None:
            raise InputError("only bias-free linear layers are quantized")
        module = cls(linear.in_features, linear.out_features, bits, input_scale is not None)
        values, scale = quantize_weight(linear.weight, bits, group_size(linear.in_features, bits))
        module.qweight = pack_int4(values) if bits == 4 else values
        module.weight_scale = scale
        if input_scale is not None:
            module.input_scale = torch.tensor(input_scale, dtype=torch.float32)
        return module

    def values(self) -> torch.Tensor:
        """The integer weight values as int8 (out, in)."""
        return unpack_int4(self.qweight) if self.bits == 4 else self.qweight

    def dequantized(self) -> torch.Tensor:
        if self._dequantized is None or self._dequantized.device != self.qweight.device:
            self._dequantized = dequantize_weight(self.values(), self.weight_scale)
        return self._dequantized

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        self._dequantized = None
        super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn, recurse=True):
        self._dequantized = None
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale is not None:
            x = fake_quantize(x.float(), self.input_scale).to(x.dtype)
        return F.linear(x, self.dequantized().to(x.dtype))

    def extra_repr(self) -> str:
        act = "int8" if self.input_scale is not None else "float"
        return f"in={self.in_features}, out={self.out_features}, weights int{self.bits}, inputs {act}"


def target_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The linear layers that a scheme quantizes: every nn.Linear inside the blocks."""
    return {
        f"layers.{i}.{name}": module
        for i, block in enumerate(model.layers)
        for name, module in block.named_modules()
        if isinstance(module, nn.Linear)
    }


def replace_linears(model: nn.Module, scheme: str, input_scales: dict[str, float] | None = None) -> nn.Module:
    """Swap the target linear layers of ``model`` for QuantizedLinear, quantizing their weights; a scheme with
    integer inputs needs every layer's input scale (from ``calibrate``)."""
    bits, act = SCHEMES[scheme]
    if act and input_scales is None:
        raise InputError(f"scheme {scheme} quantizes the linear layers' inputs: calibrate their scales first")
    for name, linear in target_linears(model).items():
        module = QuantizedLinear.from_linear(linear, bits, input_scales[name] if act else None)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, module)
    return model


def quantized_shell(model: nn.Module, scheme: str) -> nn.Module:
    """``model`` (on any device, meta included) with empty QuantizedLinear layers of ``scheme`` to load into."""
    bits, act = SCHEMES[scheme]
    for name, linear in target_linears(model).items():
        parent_name, _, child = name.rpartition(".")
        with torch.device(linear.weight.device):
            shell = QuantizedLinear(linear.in_features, linear.out_features, bits, act)
        setattr(model.get_submodule(parent_name), child, shell)
    return model


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, QuantizedLinear) for m in model.modules())
