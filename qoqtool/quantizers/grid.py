"""Affine integer grids: the one primitive every weight quantizer is built from.

A grid maps a row-block of weights to integer codes and back:

    q  = clamp(round(w / scale) + zero, lo, hi)
    w' = (q - zero) * scale

with one (scale, zero, lo, hi) per output row. RTN, progressive group quantization and
GPTQ all work on grids: RTN fits one per group and rounds, GPTQ fits one per group and
rounds column by column with error feedback, the progressive quantizer fits grids whose
scale is a product of a per-channel FP16 scale and a per-group UINT8 scale.

Scales are rounded to the precision they are stored in (FP16) *before* codes are
computed, so the codes always agree with the stored scale.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Grid:
    scale: torch.Tensor  # [N, 1] float32, the effective step of each row
    zero: torch.Tensor  # [N, 1] float32 holding integers
    lo: torch.Tensor  # [N, 1] smallest allowed code
    hi: torch.Tensor  # [N, 1] largest allowed code
    # The values a format stores for this grid (e.g. an FP16 scale, a UINT8 group scale).
    stored: dict[str, torch.Tensor] = field(default_factory=dict)

    def quantize(self, w: torch.Tensor) -> torch.Tensor:
        q = torch.round(w.float() / self.scale) + self.zero
        return torch.minimum(torch.maximum(q, self.lo), self.hi)

    def dequantize(self, q: torch.Tensor) -> torch.Tensor:
        return (q - self.zero) * self.scale

    def fake(self, w: torch.Tensor) -> torch.Tensor:
        return self.dequantize(self.quantize(w))


def to_fp16_exact(x: torch.Tensor, min_value: float = 2.0**-24) -> torch.Tensor:
    """Round a positive scale to the nearest FP16 value (kept as float32), never to zero."""
    return x.clamp(min=min_value).to(torch.float16).float().clamp(min=min_value)


def asymmetric_grid(w: torch.Tensor, bits: int = 4, clip: torch.Tensor | float = 1.0) -> Grid:
    """Min-max asymmetric grid per row of w [N, g], with zero kept inside the range.

    Stores the FP16 scale and the integer zero point. `clip` shrinks the range (per row
    or scalar) for clipping searches.
    """
    qmax = 2**bits - 1
    w = w.float()
    mn = (w.amin(dim=1, keepdim=True) * clip).clamp(max=0)
    mx = (w.amax(dim=1, keepdim=True) * clip).clamp(min=0)
    scale = to_fp16_exact((mx - mn) / qmax)
    zero = torch.round(-mn / scale).clamp(0, qmax)
    lo = torch.zeros_like(zero)
    return Grid(scale, zero, lo, lo + qmax, {"scale": scale, "zero": zero})


def symmetric_grid(w: torch.Tensor, bits: int = 8, clip: torch.Tensor | float = 1.0) -> Grid:
    """Symmetric per-row grid, codes in [-(2^(b-1)-1), 2^(b-1)-1]; stores the FP16 scale."""
    qmax = 2 ** (bits - 1) - 1
    amax = w.float().abs().amax(dim=1, keepdim=True) * clip
    scale = to_fp16_exact(amax / qmax)
    zero = torch.zeros_like(scale)
    return Grid(scale, zero, zero - qmax, zero + qmax, {"scale": scale})
