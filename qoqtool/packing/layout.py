"""The kernel weight layout: the single source of truth (docs/format.md describes it).

The GEMM kernels compute out^T = W x^T on INT8 tensor cores with `mma.m16n8k32`
(and Hopper `wgmma` with A from registers, whose per-warp fragment is the same): the
*weights* are the A operand, so each lane holds rows of W in registers. Offline, the codes
are reordered so that each lane fetches all of its fragments of a 32x32 tile with one
128-bit load (QServe's compute-aware weight reordering), and the scales so that it fetches
the parameters of its four rows with one 32-bit load.

Tile (nt, kt) covers rows nt*32 .. nt*32+31 and input channels kt*32 .. kt*32+31. Inside
it, lane l = 4*g + t (g = l // 4 is the mma "groupID", t = l % 4 its "thread in group"):

    W4 (UINT4): 16 bytes per lane = 4 words; word i holds row 8*i + g:
        byte j, low nibble   k = 4*t + j          (mma register a0/a1 of its m16 block)
        byte j, high nibble  k = 16 + 4*t + j     (a2/a3)
      so `w & 0x0F0F0F0F` and `(w >> 4) & 0x0F0F0F0F` are two mma registers:
      two masks and a shift. Rows 0-15 (words 0, 1) are m16 block 0, rows 16-31 block 1:
        block b: a0 = lo(word 2b), a1 = lo(word 2b+1), a2 = hi(word 2b), a3 = hi(word 2b+1)

    W8 (INT8): 32 bytes per lane = 8 words; word 2*i + h holds row 8*i + g, k = 16*h + 4*t + j
      (byte j): block b: a0 = word 4b, a1 = word 4b+2, a2 = word 4b+1, a3 = word 4b+3.

Group parameters (one byte, or one fp16, per row and group) are stored per row tile and
group as [g (8), i (4)], so lane l reads its four rows (8*i + g) as one 32-bit word
(64-bit for fp16). Per-channel parameters are plain [N] vectors, read in the epilogue.

Shapes: N is padded to a multiple of 32 with rows whose codes equal their zero point, K
to a multiple of the group size (or of 32 for per-channel formats) likewise; padded
positions dequantize to exactly zero.

`PackedLayout` (second half of this file) applies these byte orders to each quantized
weight format: which tensors a packed linear holds, their shapes, and the padding values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qoqtool.quantizers.formats import Int8ChannelWeight, ProgressiveWeight, QuantizedWeight, UInt4Weight

TILE_N = 32  # output channels (rows) per tile
TILE_K = 32  # input channels per tile: one mma k-step
LANES = 32
W4_BYTES_PER_LANE = 16
W8_BYTES_PER_LANE = 32


def _check(codes: torch.Tensor, dtype: torch.dtype) -> tuple[int, int]:
    if codes.dtype != dtype or codes.dim() != 2:
        raise ValueError(f"expected a 2-D {dtype} tensor, got {codes.dtype} {tuple(codes.shape)}")
    n, k = codes.shape
    if n % TILE_N or k % TILE_K:
        raise ValueError(f"shape {n}x{k} is not a multiple of the {TILE_N}x{TILE_K} tile; pad it first")
    return n, k


def pack_w4(codes: torch.Tensor) -> torch.Tensor:
    """UINT4 codes [N, K] (one per byte, values 0..15) -> packed [N/32, K/32, 32 lanes, 16] uint8."""
    n, k = _check(codes, torch.uint8)
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError("UINT4 codes must lie in 0..15")
    # row = nt*32 + i*8 + g ; col = kt*32 + h*16 + t*4 + j
    v = codes.reshape(n // 32, 4, 8, k // 32, 2, 4, 4)  # [nt, i, g, kt, h, t, j]
    v = v.permute(0, 3, 2, 5, 1, 6, 4)  # [nt, kt, g, t, i, j, h]
    v = v.reshape(n // 32, k // 32, LANES, W4_BYTES_PER_LANE, 2)  # lane = g*4+t, byte = i*4+j
    return (v[..., 0] | (v[..., 1] << 4)).contiguous()


def unpack_w4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_w4: [N/32, K/32, 32, 16] uint8 -> codes [N, K] uint8."""
    nt, kt = packed.shape[:2]
    lo = packed & 0x0F
    hi = packed >> 4
    v = torch.stack([lo, hi], dim=-1)  # [nt, kt, lane, byte, h]
    v = v.reshape(nt, kt, 8, 4, 4, 4, 2)  # [nt, kt, g, t, i, j, h]
    v = v.permute(0, 4, 2, 1, 6, 3, 5)  # [nt, i, g, kt, h, t, j]
    return v.reshape(nt * 32, kt * 32).contiguous()


def pack_w8(codes: torch.Tensor) -> torch.Tensor:
    """INT8 codes [N, K] -> packed [N/32, K/32, 32 lanes, 32] int8."""
    n, k = _check(codes, torch.int8)
    v = codes.reshape(n // 32, 4, 8, k // 32, 2, 4, 4)  # [nt, i, g, kt, h, t, j]
    v = v.permute(0, 3, 2, 5, 1, 4, 6)  # [nt, kt, g, t, i, h, j]
    return v.reshape(n // 32, k // 32, LANES, W8_BYTES_PER_LANE).contiguous()


def unpack_w8(packed: torch.Tensor) -> torch.Tensor:
    nt, kt = packed.shape[:2]
    v = packed.reshape(nt, kt, 8, 4, 4, 2, 4)  # [nt, kt, g, t, i, h, j]
    v = v.permute(0, 4, 2, 1, 5, 3, 6)  # [nt, i, g, kt, h, t, j]
    return v.reshape(nt * 32, kt * 32).contiguous()


def pack_group_params(p: torch.Tensor) -> torch.Tensor:
    """Per (row, group) parameters [N, G] -> [N/32, G, 32] ordered [g (8), i (4)] per row tile."""
    n, groups = p.shape
    if n % TILE_N:
        raise ValueError(f"{n} rows is not a multiple of {TILE_N}; pad first")
    v = p.reshape(n // 32, 4, 8, groups)  # [nt, i, g, G]
    return v.permute(0, 3, 2, 1).reshape(n // 32, groups, 32).contiguous()


def unpack_group_params(packed: torch.Tensor) -> torch.Tensor:
    nt, groups, _ = packed.shape
    v = packed.reshape(nt, groups, 8, 4).permute(0, 3, 2, 1)  # [nt, i, g, G]
    return v.reshape(nt * 32, groups).contiguous()


def pad_rows(x: torch.Tensor, n_padded: int, value=0) -> torch.Tensor:
    if x.shape[0] == n_padded:
        return x
    pad = torch.full((n_padded - x.shape[0], *x.shape[1:]), value, dtype=x.dtype, device=x.device)
    return torch.cat([x, pad])


def padded_rows(n: int) -> int:
    return -(-n // TILE_N) * TILE_N


def lane_fragment_coords(lane: int, word: int, byte: int, nibble: int) -> tuple[int, int]:
    """(row, col) inside a 32x32 W4 tile of one stored nibble: the layout in one function.

    Used by tests to check the vectorised pack against the definition, and handy when
    reading the kernel: lane l, word i, byte j, nibble h -> row 8i + l//4, col 16h + 4(l%4) + j.
    """
    return 8 * word + lane // 4, 16 * nibble + 4 * (lane % 4) + byte


# ----------------------------------------------------------------------------------------
# Per-format packed tensors: what one quantized linear becomes (docs/format.md, "Linears").
#
#   kind          group_size  buffers (Np = N padded to 32, Kp = K padded, G = Kp / group size)
#   progressive   g           qweight u8 [Np/32, Kp/32, 32, 16]  scale0 f16 [Np]
#                             scale1 u8 [Np/32, G, 32]           zero_x_scale1 u8 [Np/32, G, 32]
#   uint4         None        qweight u8 (as above)              scale f16 [Np], zero u8 [Np]
#   uint4         g           qweight u8 (as above)              scale f16 [Np/32, G, 32], zero u8 [Np/32, G, 32]
#   int8_channel  None        qweight i8 [Np/32, Kp/32, 32, 32]  scale f16 [Np]
#
# Padded rows are neutral: codes 0 with zero point 0 (so they dequantize to 0), scales 1.

NEUTRAL_SCALE = 1.0
KINDS = ("progressive", "uint4", "int8_channel")


def padded_to(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _pad_codes(codes: torch.Tensor, n_padded: int, k_padded: int, fill: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] -> [Np, Kp]: new columns take each row's zero point `fill` [N, 1], new rows 0."""
    n, k = codes.shape
    if k < k_padded:
        codes = torch.cat([codes, fill.to(codes.dtype).expand(n, k_padded - k)], dim=1)
    return pad_rows(codes, n_padded, 0)


def check_progressive_params(scale1: torch.Tensor, zero_x_scale1: torch.Tensor) -> None:
    """ValueError unless the progressive group parameters are what the kernels assume
    (docs/format.md): 1 <= s1 <= 16, so that q * s1 <= 240 never carries into the next byte,
    and z * s1 a multiple of s1 and at most 128, so that the biased byte q * s1 + 128 - z * s1
    stays in [0, 255]. The quantizer keeps both; a folder that breaks them was not written by it."""
    s1, zs1 = scale1.to(torch.int16), zero_x_scale1.to(torch.int16)
    if s1.numel() == 0:
        return
    if int(s1.min()) < 1 or int(s1.max()) > 16:
        raise ValueError(f"scale1 holds {int(s1.min())}..{int(s1.max())}, outside the kernels' 1..16")
    if int(zs1.max()) > 128:
        raise ValueError(f"zero_x_scale1 reaches {int(zs1.max())}, above the kernels' 128")
    if (zs1 % s1).any():
        raise ValueError("zero_x_scale1 is not a multiple of scale1: the packed tensors are inconsistent")


@dataclass(frozen=True)
class PackedLayout:
    """How one linear is packed: its format, logical shape [N, K] and group size.

    group_size is None for the per-channel formats (uint4 with one group spanning the
    row, int8_channel). `pack` and `unpack` are exact inverses on the quantized formats.
    """

    kind: str
    out_features: int  # N
    in_features: int  # K
    group_size: int | None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown packed format {self.kind!r}; known: {', '.join(KINDS)}")
        if self.kind == "progressive" and self.group_size is None:
            raise ValueError("progressive weights are per group; give their group size")
        if self.kind == "int8_channel" and self.group_size is not None:
            raise ValueError("int8_channel weights are per channel; their group size is None")
        if self.group_size is not None and (self.group_size <= 0 or self.group_size % TILE_K):
            raise ValueError(f"group size {self.group_size} is not a multiple of {TILE_K}: a group must cover whole k-tiles")

    @classmethod
    def of(cls, weight: QuantizedWeight) -> "PackedLayout":
        n, k = weight.shape
        if isinstance(weight, UInt4Weight) and weight.group_size == k:
            return cls("uint4", n, k, None)  # one group spanning the row: the per-channel variant
        return cls(weight.kind, n, k, getattr(weight, "group_size", None))

    @classmethod
    def from_meta(cls, meta: dict) -> "PackedLayout":
        n, k = meta["shape"]
        return cls(meta["kind"], int(n), int(k), meta.get("group_size"))

    def meta(self) -> dict:
        return {
            "kind": self.kind,
            "shape": [self.out_features, self.in_features],
            "group_size": self.group_size,
            "n_padded": self.n_padded,
            "k_padded": self.k_padded,
        }

    @property
    def n_padded(self) -> int:
        return padded_to(self.out_features, TILE_N)

    @property
    def k_padded(self) -> int:
        return padded_to(self.in_features, self.group_size or TILE_K)

    @property
    def groups(self) -> int:
        return self.k_padded // self.group_size if self.group_size else 1

    def spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of every packed tensor, in the order of the table above."""
        nt, kt, np_ = self.n_padded // TILE_N, self.k_padded // TILE_K, self.n_padded
        if self.kind == "int8_channel":
            return {"qweight": ((nt, kt, LANES, W8_BYTES_PER_LANE), torch.int8), "scale": ((np_,), torch.float16)}
        grouped = (nt, self.groups, TILE_N)
        spec = {"qweight": ((nt, kt, LANES, W4_BYTES_PER_LANE), torch.uint8)}
        if self.kind == "progressive":
            spec["scale0"] = ((np_,), torch.float16)
            spec["scale1"] = (grouped, torch.uint8)
            spec["zero_x_scale1"] = (grouped, torch.uint8)
        elif self.group_size is None:
            spec["scale"] = ((np_,), torch.float16)
            spec["zero"] = ((np_,), torch.uint8)
        else:
            spec["scale"] = (grouped, torch.float16)
            spec["zero"] = (grouped, torch.uint8)
        return spec

    def check(self, tensors: dict[str, torch.Tensor]) -> None:
        """Raise ValueError unless `tensors` holds exactly this layout's tensors."""
        for name, (shape, dtype) in self.spec().items():
            t = tensors.get(name)
            if t is None:
                raise ValueError(f"missing packed tensor {name!r}")
            if tuple(t.shape) != shape or t.dtype != dtype:
                got = f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
                raise ValueError(f"packed tensor {name!r} is {got}, expected {str(dtype).removeprefix('torch.')}{list(shape)}")
        if self.kind == "progressive" and tensors["scale1"].device.type != "meta":  # (empty modules: checked when filled)
            check_progressive_params(tensors["scale1"], tensors["zero_x_scale1"])

    # -- pack ---------------------------------------------------------------------------
    def pack(self, weight: QuantizedWeight) -> dict[str, torch.Tensor]:
        if PackedLayout.of(weight) != self:
            raise ValueError(f"a {PackedLayout.of(weight)} weight does not fit the layout {self}")
        np_, kp = self.n_padded, self.k_padded
        if self.kind == "int8_channel":
            codes = _pad_codes(weight.codes, np_, kp, torch.zeros(1, 1))
            return {"qweight": pack_w8(codes), "scale": pad_rows(weight.scale, np_, NEUTRAL_SCALE)}
        if self.kind == "uint4" and self.group_size is None:
            codes = _pad_codes(weight.codes, np_, kp, weight.zero)
            return {
                "qweight": pack_w4(codes),
                "scale": pad_rows(weight.scale[:, 0], np_, NEUTRAL_SCALE),
                "zero": pad_rows(weight.zero[:, 0], np_, 0),
            }
        if weight.codes.shape[1] != kp:
            raise ValueError(f"grouped codes are {weight.codes.shape[1]} wide, expected K padded to the group: {kp}")
        packed = {"qweight": pack_w4(pad_rows(weight.codes, np_, 0))}
        if self.kind == "uint4":
            packed["scale"] = pack_group_params(pad_rows(weight.scale, np_, NEUTRAL_SCALE))
            packed["zero"] = pack_group_params(pad_rows(weight.zero, np_, 0))
            return packed
        s1 = pad_rows(weight.scale1, np_, 1)
        zs1 = pad_rows(weight.zero, np_, 0).to(torch.int16) * s1.to(torch.int16)  # what the kernel subtracts
        packed["scale0"] = pad_rows(weight.scale0, np_, NEUTRAL_SCALE)
        packed["scale1"] = pack_group_params(s1)
        packed["zero_x_scale1"] = pack_group_params(zs1.clamp(max=255).to(torch.uint8))
        check_progressive_params(packed["scale1"], packed["zero_x_scale1"])
        return packed

    # -- unpack -------------------------------------------------------------------------
    def unpack(self, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        """The quantized weight exactly as `qoqtool quantize` stored it (padding dropped)."""
        self.check(tensors)
        n, k, g = self.out_features, self.in_features, self.group_size
        if self.kind == "int8_channel":
            codes = unpack_w8(tensors["qweight"])[:n, :k].contiguous()
            return Int8ChannelWeight(codes, tensors["scale"][:n].contiguous(), k)
        codes = unpack_w4(tensors["qweight"])[:n]
        if self.kind == "uint4" and g is None:
            scale, zero = tensors["scale"][:n, None], tensors["zero"][:n, None]
            return UInt4Weight(codes[:, :k].contiguous(), scale.contiguous(), zero.contiguous(), k, k)
        if self.kind == "uint4":
            scale = unpack_group_params(tensors["scale"])[:n]
            return UInt4Weight(codes, scale, unpack_group_params(tensors["zero"])[:n], g, k)
        s1 = unpack_group_params(tensors["scale1"])[:n].to(torch.int16)
        zero = (unpack_group_params(tensors["zero_x_scale1"])[:n].to(torch.int16) // s1).to(torch.uint8)  # (checked: exact)
        return ProgressiveWeight(codes, tensors["scale0"][:n].contiguous(), s1.to(torch.uint8), zero, g, k)
