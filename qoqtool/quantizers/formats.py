"""The quantized weight formats, unpacked: integer codes in natural [N, K] order plus the
parameters that turn them back into numbers.

Each format owns three things: how it dequantizes, how it multiplies INT8 activations
*exactly* (the integer accumulations the kernels compute, then the scales), and the named
tensors it is saved as. `qoqtool.packing` turns these into the kernels' byte layout.

    Int8ChannelWeight   W8:  w = s[n] * q,                  q in [-127, 127]
    UInt4Weight         W4:  w = s[n, g] * (q - z[n, g]),   q, z in [0, 15]
                        (one group per row = the per-channel variant)
    ProgressiveWeight   QoQ: w = s0[n] * ((q - z[n, g]) * s1[n, g]),  s1 UINT8,
                        (q - z) * s1 in [-128, 127], so the level-0 value is INT8 exactly

Group quantization zero-pads K up to a multiple of the group size (SmolLM2: K = 576 with
g = 128 becomes 640). Padded columns carry code q = z (they dequantize to exactly zero) and
meet zero-padded activations, so they never change a result; they are stored, and counted
in bits per stored weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from qoqtool.runtime.intmath import int8_matmul


def padded_size(k: int, group_size: int | None) -> int:
    if not group_size:
        return k
    return -(-k // group_size) * group_size


def pad_columns(x: torch.Tensor, k_padded: int, value: float = 0) -> torch.Tensor:
    k = x.shape[-1]
    if k == k_padded:
        return x
    return torch.nn.functional.pad(x, (0, k_padded - k), value=value)


class QuantizedWeight:
    """Base class: codes [N, K_padded] plus parameters; see the module docstring."""

    kind: ClassVar[str]
    codes: torch.Tensor
    in_features: int

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 [N, K] (padding dropped)."""
        raise NotImplementedError

    def int8_operand(self) -> torch.Tensor:
        """The INT8 matrix the tensor cores multiply, [N, K_padded] (formats with one scale per row)."""
        raise NotImplementedError

    def linear_int8(self, xq: torch.Tensor, sx: torch.Tensor, operand: torch.Tensor | None = None) -> torch.Tensor:
        """Exact W x A8: xq [M, K] int8 codes, sx [M] float32 per-token scales -> [M, N] float32."""
        operand = self.int8_operand() if operand is None else operand
        acc = int8_matmul(pad_columns(xq, operand.shape[1]), operand)
        return acc.float() * sx[:, None] * self.row_scale()[None, :]

    def row_scale(self) -> torch.Tensor:
        raise NotImplementedError

    def tensors(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def meta(self) -> dict:
        return {"kind": self.kind, "shape": list(self.shape)}

    def to(self, device) -> "QuantizedWeight":
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(device))
        return self

    @staticmethod
    def from_tensors(meta: dict, tensors: dict[str, torch.Tensor]) -> "QuantizedWeight":
        cls = FORMATS[meta["kind"]]
        return cls._from_tensors(meta, tensors)


@dataclass
class Int8ChannelWeight(QuantizedWeight):
    codes: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N] float16
    in_features: int
    kind: ClassVar[str] = "int8_channel"

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scale.float()[:, None]

    def int8_operand(self) -> torch.Tensor:
        return self.codes

    def row_scale(self) -> torch.Tensor:
        return self.scale.float()

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "scale": self.scale}

    @classmethod
    def _from_tensors(cls, meta, t):
        return cls(t["codes"], t["scale"], meta["shape"][1])

    def bits(self) -> int:
        return 8


@dataclass
class UInt4Weight(QuantizedWeight):
    codes: torch.Tensor  # [N, K_padded] uint8 in [0, 15]
    scale: torch.Tensor  # [N, G] float16
    zero: torch.Tensor  # [N, G] uint8 in [0, 15]
    group_size: int  # == in_features for the per-channel variant
    in_features: int
    kind: ClassVar[str] = "uint4"

    @property
    def per_channel(self) -> bool:
        return self.scale.shape[1] == 1

    def _expand(self, per_group: torch.Tensor) -> torch.Tensor:
        return per_group.repeat_interleave(self.group_size, dim=1)[:, : self.codes.shape[1]]

    def dequantize(self) -> torch.Tensor:
        q = self.codes.float() - self._expand(self.zero.float())
        return (q * self._expand(self.scale.float()))[:, : self.in_features]

    def int8_operand(self) -> torch.Tensor:
        """(q - z) as INT8, [N, K_padded]; each group still needs its own float scale."""
        return (self.codes.to(torch.int16) - self._expand(self.zero.to(torch.int16))).to(torch.int8)

    def linear_int8(self, xq, sx, operand=None):
        # One INT32 accumulation per group, then the float group scales: what a kernel with
        # float per-group scales must do. For the per-channel variant (one group) this is
        # acc = xq @ q^T - z * rowsum(xq), the form the per-channel kernel computes.
        operand = self.int8_operand() if operand is None else operand
        xq = pad_columns(xq, operand.shape[1])
        g = self.group_size
        out = None
        for i in range(self.scale.shape[1]):
            acc = int8_matmul(xq[:, i * g : (i + 1) * g], operand[:, i * g : (i + 1) * g])
            term = acc.float() * self.scale[:, i].float()[None, :]
            out = term if out is None else out + term
        return out * sx[:, None]

    def tensors(self):
        return {"codes": self.codes, "scale": self.scale, "zero": self.zero}

    def meta(self):
        return {**super().meta(), "group_size": self.group_size}

    @classmethod
    def _from_tensors(cls, meta, t):
        return cls(t["codes"], t["scale"], t["zero"], meta["group_size"], meta["shape"][1])

    def bits(self) -> int:
        return 4


@dataclass
class ProgressiveWeight(QuantizedWeight):
    codes: torch.Tensor  # [N, K_padded] uint8 in [0, 15]
    scale0: torch.Tensor  # [N] float16: level 0, per output channel
    scale1: torch.Tensor  # [N, G] uint8: level 1, per group
    zero: torch.Tensor  # [N, G] uint8 in [0, 15]
    group_size: int
    in_features: int
    kind: ClassVar[str] = "progressive"

    def _expand(self, per_group: torch.Tensor) -> torch.Tensor:
        return per_group.repeat_interleave(self.group_size, dim=1)[:, : self.codes.shape[1]]

    def int8_operand(self) -> torch.Tensor:
        """The level-0 INT8 weight (q - z) * s1, [N, K_padded]; exact by construction."""
        q = self.codes.to(torch.int16) - self._expand(self.zero.to(torch.int16))
        w8 = q * self._expand(self.scale1.to(torch.int16))
        if w8.numel() and (w8.min() < -128 or w8.max() > 127):
            raise ValueError("progressive weight leaves the INT8 range; the quantizer must clamp codes")
        return w8.to(torch.int8)

    def dequantize(self) -> torch.Tensor:
        return (self.int8_operand().float() * self.scale0.float()[:, None])[:, : self.in_features]

    def row_scale(self) -> torch.Tensor:
        return self.scale0.float()

    def tensors(self):
        return {"codes": self.codes, "scale0": self.scale0, "scale1": self.scale1, "zero": self.zero}

    def meta(self):
        return {**super().meta(), "group_size": self.group_size}

    @classmethod
    def _from_tensors(cls, meta, t):
        return cls(t["codes"], t["scale0"], t["scale1"], t["zero"], meta["group_size"], meta["shape"][1])

    def bits(self) -> int:
        return 4


FORMATS: dict[str, type[QuantizedWeight]] = {
    cls.kind: cls for cls in (Int8ChannelWeight, UInt4Weight, ProgressiveWeight)
}
