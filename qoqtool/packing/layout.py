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
"""

from __future__ import annotations

import torch

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
