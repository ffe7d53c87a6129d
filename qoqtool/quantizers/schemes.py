"""Weight quantization schemes: how to fit a grid to a group of weights, and how to turn
codes plus fitted grids into a stored format.

RTN (`quantize`) and GPTQ (`qoqtool.quantizers.gptq`) share these schemes: RTN fits every
group of the finished weight and rounds it, GPTQ fits each group as its sweep reaches it.

    asymmetric   UINT4, FP16 scale + UINT4 zero per group or per channel (RTN, QoQ per-channel)
    symmetric8   INT8, FP16 scale per channel (W8A8)
    progressive  QoQ's two-level group quantization: level 0 per-channel symmetric INT8 in the
                 protective range [-119, 119] with an FP16 scale, level 1 per-group UINT4 on the
                 INT8 values with a UINT8 scale and UINT4 zero
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qoqtool.quantizers.formats import (
    Int8ChannelWeight,
    ProgressiveWeight,
    QuantizedWeight,
    UInt4Weight,
    pad_columns,
    padded_size,
)
from qoqtool.quantizers.grid import Grid, asymmetric_grid, symmetric_grid, to_fp16_exact

# Level-0 values live in [-119, 119] so that level 1, whose step s1 is at most 16, can only
# round them to within s1/2 <= 8 of themselves: (q - z) * s1 never leaves [-128, 127] and the
# kernel dequantizes with byte-wise arithmetic, no saturation (QServe, Sec. 4.1).
PROTECTIVE_RANGE = 119


@dataclass
class WeightQuantConfig:
    bits: int = 4
    group_size: int | None = 128  # None: one group per output channel
    scheme: str = "asymmetric"  # asymmetric | symmetric | progressive

    def __post_init__(self):
        if self.scheme not in ("asymmetric", "symmetric", "progressive"):
            raise ValueError(f"unknown weight scheme {self.scheme!r}")
        if self.scheme == "progressive" and (self.bits != 4 or not self.group_size):
            raise ValueError("progressive quantization is 4-bit and per-group")
        if self.scheme == "symmetric" and (self.bits != 8 or self.group_size):
            raise ValueError("symmetric weights are 8-bit per-channel (W8A8)")
        if self.scheme == "asymmetric" and self.bits != 4:
            raise ValueError("asymmetric weights are 4-bit")

    def describe(self) -> str:
        gran = f"g{self.group_size}" if self.group_size else "per-channel"
        return f"w{self.bits} {self.scheme} {gran}"


class WeightScheme:
    """Fits grids group by group and assembles the stored format."""

    def __init__(self, config: WeightQuantConfig):
        self.config = config
        self.level0: torch.Tensor | None = None  # progressive: FP16 per-channel scale [N, 1]

    # -- shapes -------------------------------------------------------------------------
    def group_size_for(self, k: int) -> int:
        return self.config.group_size or k

    def padded(self, k: int) -> int:
        return padded_size(k, self.config.group_size)

    # -- fitting ------------------------------------------------------------------------
    def prepare(self, w: torch.Tensor) -> None:
        """Per-row state fitted on the whole weight before any group (progressive level 0)."""
        if self.config.scheme == "progressive":
            amax = w.float().abs().amax(dim=1, keepdim=True)
            self.level0 = to_fp16_exact(amax / PROTECTIVE_RANGE)

    def fit(self, w: torch.Tensor, clip: torch.Tensor | float = 1.0, level0: torch.Tensor | None = None) -> Grid:
        """A grid for one group of columns w [N, g] (the whole row for per-channel).

        level0: the progressive level-0 scale of each row of w, when the rows of w are not
        the rows `prepare` saw (the vectorised RTN below fits [N * G, g] blocks at once)."""
        scheme = self.config.scheme
        if scheme == "asymmetric":
            return asymmetric_grid(w, self.config.bits, clip)
        if scheme == "symmetric":
            return symmetric_grid(w, self.config.bits, clip)
        return self._fit_progressive(w, clip, self.level0 if level0 is None else level0)

    def _fit_progressive(self, w: torch.Tensor, clip, s0: torch.Tensor) -> Grid:
        w8 = torch.round(w.float() / s0).clamp(-PROTECTIVE_RANGE, PROTECTIVE_RANGE)
        mn = (w8.amin(dim=1, keepdim=True) * clip).clamp(max=0)
        mx = (w8.amax(dim=1, keepdim=True) * clip).clamp(min=0)
        s1 = torch.round((mx - mn) / 15).clamp(1, 16)
        z = torch.round(-mn / s1).clamp(0, 15)
        # Codes whose level-0 value (q - z) * s1 would leave INT8 are never emitted.
        lo = (z - torch.floor(128 / s1)).clamp(min=0)
        hi = (z + torch.floor(127 / s1)).clamp(max=15)
        return Grid(s0 * s1, z, lo, hi, {"scale1": s1, "zero": z})

    # -- assembling ---------------------------------------------------------------------
    def assemble(self, codes: torch.Tensor, grids: list[Grid], in_features: int) -> QuantizedWeight:
        """Build the stored format from codes [N, K_padded] (float holding integers) and the
        grids of the groups, in order."""
        stored = {key: torch.cat([g.stored[key] for g in grids], dim=1) for key in grids[0].stored}
        return self._build(codes, stored, in_features)

    def _build(self, codes: torch.Tensor, stored: dict[str, torch.Tensor], in_features: int) -> QuantizedWeight:
        """The stored format from codes and the per-group stored values, each [N, G]."""
        cfg = self.config
        if cfg.scheme == "symmetric":
            return Int8ChannelWeight(codes.to(torch.int8), stored["scale"][:, 0].half(), in_features)
        if cfg.scheme == "asymmetric":
            return UInt4Weight(
                codes.to(torch.uint8),
                stored["scale"].half(),
                stored["zero"].to(torch.uint8),
                self.group_size_for(in_features),
                in_features,
            )
        return ProgressiveWeight(
            codes.to(torch.uint8),
            self.level0[:, 0].half(),
            stored["scale1"].to(torch.uint8),
            stored["zero"].to(torch.uint8),
            cfg.group_size,
            in_features,
        )

    # -- round to nearest ---------------------------------------------------------------
    def _fit_all(self, w: torch.Tensor, clip: torch.Tensor | None) -> tuple[torch.Tensor, Grid, int]:
        """Fit every group of w [N, K] at once: the padded weight viewed as N * G rows of g,
        which is exactly what the per-row grid functions fit. Returns (blocks, grid, G)."""
        n, k = w.shape
        w = pad_columns(w.float(), self.padded(k))
        self.prepare(w)
        groups = w.shape[1] // self.group_size_for(k)
        blocks = w.reshape(n * groups, -1)  # row n * G + i = group i of row n
        level0 = None if self.level0 is None else self.level0.repeat_interleave(groups, dim=0)
        grid = self.fit(blocks, 1.0 if clip is None else clip.reshape(n * groups, 1).to(w.device), level0)
        return blocks, grid, groups

    def fake_quantize(self, w: torch.Tensor, clip: torch.Tensor | None = None) -> torch.Tensor:
        """What RTN would dequantize to, [N, K] float32, without building the stored format
        (the inner loop of clip and smoothing searches)."""
        n, k = w.shape
        blocks, grid, _ = self._fit_all(w, clip)
        return grid.fake(blocks).reshape(n, -1)[:, :k]

    def quantize(self, w: torch.Tensor, clip: torch.Tensor | None = None) -> QuantizedWeight:
        """Round-to-nearest: fit each group of w [N, K] and round. clip: [N, G] ratios or None."""
        n, k = w.shape
        blocks, grid, groups = self._fit_all(w, clip)
        codes = grid.quantize(blocks).reshape(n, -1)
        if codes.shape[1] != k:  # padded columns: their zero point, so they dequantize to exactly 0
            codes[:, k:] = grid.zero.reshape(n, groups)[:, -1:]
        stored = {key: value.reshape(n, groups) for key, value in grid.stored.items()}
        return self._build(codes, stored, k)


def _neutral_padding(codes: torch.Tensor, grids: list[Grid], g: int, k: int) -> torch.Tensor:
    """Set codes of padded columns to the zero point, so they dequantize to exactly 0."""
    if codes.shape[1] == k:
        return codes
    codes = codes.clone()
    codes[:, k:] = grids[-1].zero
    return codes
