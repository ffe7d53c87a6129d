"""The CUDA GEMM and fused quantization kernels as torch custom ops, and the packed-linear
forward pass that uses them.

    qoqtool::w4a8_gemm_per_group    INT8 x [M, Kp] * progressive (QoQ) W4 -> fp16 [M, N] (+ optionally
                                    the row sums of x, which make the wgmma kernel cheaper)
    qoqtool::w4a8_gemm_per_channel  INT8 x * per-channel UINT4 W4 (+ the row sums of x)
    qoqtool::w8a8_gemm              INT8 x * per-channel INT8 W8
    qoqtool::w4a8_sparse_dense_gemm_per_group / _per_channel
                                    the two W4A8 GEMMs fused with the linear's fp16 outliers
                                    in Tile-COO (docs/tile-coo.md), stream kernel only
    qoqtool::w4a16_gemm             fp16 x [M, Kp] * UINT4 W4 with fp16 group scales (small M)
    qoqtool::w4a16_sparse_dense_gemm
                                    the same fused with the linear's Tile-COO outliers
    qoqtool::quantize_per_token     fp16 x [M, K] -> (x_q [M, Kp] int8, x_scale [M] fp16, x_rowsum [M] int32)
    qoqtool::rmsnorm_quantize       RMSNorm(x) * weight, then the same
    qoqtool::add_rmsnorm_quantize   h = x + delta (returned), then the same for RMSNorm(h) * weight
    qoqtool::rmsnorm, add_rmsnorm   RMSNorm(x) * weight (of h = x + delta) in fp16, not quantized
    qoqtool::silu_mul_quantize      silu(gate) * up, then the same
    qoqtool::silu_mul_rotate_quantize
                                    silu(gate) * up, rotated by the online down_proj rotation, then the same
    qoqtool::silu_mul_rotate_quantize_bits
                                    the same for a rotation's large second factor (tensor cores)
    qoqtool::qk_norm_rope           queries and keys from the q/k projections to what attention reads:
                                    per-head RMSNorm (Qwen3), RoPE, key rotation, key shift

The kernels (kernels/*.cu) have a plain C ABI and are called through ctypes on the current
stream, so the ops work under CUDA-graph capture. Every op checks dtypes, shapes, devices,
contiguity and alignment here and raises ValueError before anything is launched: bad
input never reaches a kernel. Importing this module needs neither a GPU nor nvcc; the
library is built (or found in its cache) at the first call.

Operand layouts are those of qoqtool.packing.layout (weights, group parameters) and
qoqtool.quantizers.activations (per-token INT8 activations); the kernels' exact semantics
are documented in kernels/w4a8_gemm.cu, kernels/w8a8_gemm.cu, kernels/fused_ops.cu and
kernels/qk_rope.cu.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from qoqtool.runtime import kernel_library as kl

# -- the library's entry points -------------------------------------------------------------
_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    # kernel, tile, splits, x, x_scale, qweight, scale0, scale1, zxs1, out, out_i32, M, N, Kp, group_shift, ws, counters, stream
    "qoq_w4a8_gemm_per_group": [_I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _P, _P, _P],
    # kernel, tile, splits, x, x_scale, x_rowsum, qweight, scale0, scale1, zxs1, out, out_i32, M, N, Kp, group_shift,
    # ws, counters, stream
    "qoq_w4a8_gemm_per_group_rowsum": [_I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _P, _P, _P],
    # kernel, tile, splits, x, x_scale, x_rowsum, qweight, scale, zero, out, out_i32, M, N, Kp, ws, counters, stream
    "qoq_w4a8_gemm_per_channel": [_I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _P, _P, _P],
    # kernel, tile, splits, x, x_scale, qweight, scale, out, out_i32, M, N, Kp, ws, counters, stream
    "qoq_w8a8_gemm": [_I, _I, _I, _P, _P, _P, _P, _P, _I, _I, _I, _I, _P, _P, _P],
    # kernel, tile, splits, x, x_scale, qweight, scale0, scale1, zxs1, tc_entries, tc_start, tc_count, out, M, N,
    # Kp, group_shift, ws, sparse_ws, counters, stream
    "qoq_w4a8_sparse_dense_gemm_per_group": [_I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _P,
                                             _P, _P, _P],
    # kernel, tile, splits, x, x_scale, x_rowsum, qweight, scale, zero, tc_entries, tc_start, tc_count, out, M, N,
    # Kp, ws, sparse_ws, counters, stream
    "qoq_w4a8_sparse_dense_gemm_per_channel": [_I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _P,
                                               _P, _P, _P],
    # tile, splits, x, qweight, scale, zero, out, M, N, Kp, group_shift, ws, float_ws, counters, stream
    "qoq_w4a16_gemm": [_I, _I, _P, _P, _P, _P, _P, _I, _I, _I, _I, _P, _P, _P, _P],
    # tile, splits, x, qweight, scale, zero, tc_entries, tc_start, tc_count, out, M, N, Kp, group_shift, ws,
    # float_ws, counters, stream
    "qoq_w4a16_sparse_dense_gemm": [_I, _I, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _P, _P, _P, _P],
    # enabled
    "qoq_gemm_set_dependent_launch": [_I],
    # enabled
    "qoq_fused_set_dependent_launch": [_I],
    # enabled
    "qoq_gemm_set_stage_activations": [_I],
    # mode (FUSED_STAGING_*)
    "qoq_gemm_set_fused_staging": [_I],
    # trace buffer (or NULL)
    "qoq_gemm_set_trace": [_P],
    # x, M, K, Kp, x_q, x_scale, x_rowsum, stream
    "qoq_quantize_per_token": [_P, _I, _I, _I, _P, _P, _P, _P],
    # x, weight, eps, M, K, Kp, x_q, x_scale, x_rowsum, stream
    "qoq_rmsnorm_quantize": [_P, _P, _F, _I, _I, _I, _P, _P, _P, _P],
    # x, delta, weight, eps, M, K, Kp, sum, x_q, x_scale, x_rowsum, stream
    "qoq_add_rmsnorm_quantize": [_P, _P, _P, _F, _I, _I, _I, _P, _P, _P, _P, _P],
    # x, delta, weight, eps, M, K, sum, out, stream
    "qoq_add_rmsnorm": [_P, _P, _P, _F, _I, _I, _P, _P, _P],
    # gate, up, M, K, Kp, x_q, x_scale, x_rowsum, stream
    "qoq_silu_mul_quantize": [_P, _P, _I, _I, _I, _P, _P, _P, _P],
    # gate, up, factor, signs, M, K, Kp, a, m, x_q, x_scale, x_rowsum, stream
    "qoq_silu_mul_rotate_quantize": [_P, _P, _P, _P, _I, _I, _I, _I, _I, _P, _P, _P, _P],
    # gate, up, sign bits, signs, M, K, Kp, a, m, x_q, x_scale, x_rowsum, stream
    "qoq_silu_mul_rotate_quantize_bits": [_P, _P, _P, _P, _I, _I, _I, _I, _I, _P, _P, _P, _P],
    # q, k, q_stride, k_stride, cos, sin, q_weight, k_weight, eps, rotation, shift, rows, Hq, Hkv, D, q_out, k_out, stream
    "qoq_qk_norm_rope": [_P, _P, ctypes.c_longlong, ctypes.c_longlong, _P, _P, _P, _P, _F, _P, _P, _I, _I, _I, _I, _P,
                         _P, _P],
}


# Entry points that libraries built before they existed lack (benchmarks/library_ab.py times
# such builds through this module): the ops fall back to what those libraries have.
_NEWER_ENTRIES = {"qoq_w4a8_gemm_per_group_rowsum",  # 2026-12-02: its absence means the x_rowsum-free call
                  "qoq_silu_mul_rotate_quantize",  # 2026-12-06
                  "qoq_silu_mul_rotate_quantize_bits",  # 2026-12-06
                  "qoq_qk_norm_rope", "qoq_add_rmsnorm_quantize", "qoq_add_rmsnorm",
                  "qoq_fused_set_dependent_launch"}  # 2026-12-07


@functools.lru_cache(maxsize=None)
def _load(path: str | None) -> ctypes.CDLL:
    """The kernel library built from this checkout (path None) or the one at `path`, with the
    entry points' signatures declared."""
    lib = kl.library() if path is None else ctypes.CDLL(path)
    for name, argtypes in _SIGNATURES.items():
        if name in _NEWER_ENTRIES and not hasattr(lib, name):
            continue
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    return lib


_library_path: str | None = None


def use_library(path: str | None) -> None:
    """Run the GEMM ops on the kernel library at `path` (a libqoqkernels.so built from other
    sources) instead of this checkout's; None: this checkout's again. Each library keeps its own
    settings and defaults (set_dependent_launch and the like apply to the one in use) if it was
    built with -fno-gnu-unique (kernels/build.py, since 2026-12-01 13:00 UTC); of two older
    builds in one process, both used the settings of the one loaded first. For
    benchmarks/library_ab.py, which times two builds in one process."""
    global _library_path
    _library_path = None if path is None else str(path)


def _lib() -> ctypes.CDLL:
    return _load(_library_path)


def _call(name: str, *args) -> None:
    kl.check(getattr(_lib(), name)(*args), name)


# -- tile configuration by M ------------------------------------------------------------------
STREAM, WGMMA, STREAM_1X16, STREAM_2X8, WGMMA_K2, WGMMA_K2_T64, WGMMA_M64 = 0, 1, 2, 3, 4, 5, 6  # kernel ids (KernelId of kernels/gemm_kernels.cuh)
KERNEL_NAMES = {STREAM: "stream", WGMMA: "wgmma", STREAM_1X16: "stream1x16", STREAM_2X8: "stream2x8", WGMMA_K2: "wgmma_k2",
                WGMMA_K2_T64: "wgmma_k2t64", WGMMA_M64: "wgmma_m64"}
# The Hopper-only kernels (sm_90a). WGMMA_K2: one 128-row tile, two halves of warpgroups taking
# alternate stages (and in each half one warpgroup per m16 block); WGMMA_K2_T64 the same with 64
# tokens per CTA instead of 128; WGMMA_M64: `tile` warpgroups of 64 rows each (one m16 block per
# warp), 192-row CTAs with tile 3.
WGMMA_KERNELS = (WGMMA, WGMMA_K2, WGMMA_K2_T64, WGMMA_M64)
# The stream kernel's CTA shapes: (row tiles, k-slice warps) by kernel id (launch_stream_shape).
_STREAM_SHAPES = {STREAM: (2, 4), STREAM_1X16: (1, 16), STREAM_2X8: (2, 8)}

# The stream kernel's shape (mirrors launch_stream in gemm_kernels.cuh): 2 row tiles x 4
# k-slice warps per CTA; U k-tiles in flight per warp, by tokens-per-CTA/8 (NB); how many
# CTAs fit on one multiprocessor (its __launch_bounds__ minimum).
_STREAM_WARPS_K = _STREAM_SHAPES[STREAM][1]
_STREAM_CHUNK = {1: 8, 2: 8, 4: 4, 8: 2}
_STREAM_CTAS_PER_SM = {1: 2, 2: 2, 4: 2, 8: 1}
_WGMMA_TOKENS, _WGMMA_ROW_TILES_PER_WG = 128, 4
_WGMMA_MIN_M = 33  # measured on the H200 (benchmarks/notes-gemm.md): wgmma wins from M = 64, stream at M = 32
# ... with 128-token tiles. With the 64-token K2 form the wgmma kernel is also faster at
# M = 17..32 (NB = 4 for the stream kernel) on every benchmark shape whose packed weights
# reach 13 MB (1.07-1.27x: 5120^2 up to 14336 x 4096, M = 24 and 32) and slower on 4096^2
# (8.4 MB, 0.92-0.94x) (H200, benchmarks/results/gemm-v18-h200/m24-m32-explore.txt): the
# plan takes it there from this many bytes of W4 codes, between the two measured sizes. Not for
# W8 weights: W8A8 on the same shapes was 0.95-1.20x, slower on three of five
# (w8a8-m24-m32.txt), so it keeps the stream kernel up to M = 32.
_WGMMA_NB4_MIN_BYTES = 12 << 20
# The wgmma kernel's time, fitted by least squares (relative error) to every choice that
# benchmarks/gemm.py --explore-wgmma timed on the H200 (1 or 2 row warpgroups, the K2 form with
# 128 or 64 tokens, x 1-4 or 8 splits; 14 cases, M = 64..512 on five shapes;
# benchmarks/fit_wgmma_plan.py on benchmarks/results/gemm-v18-h200/t64-explore.json,
# notes-gemm.md, version 18): per wave of CTAs a fixed cost plus a cost per 128-wide pipeline
# stage that one warpgroup walks (two row warpgroups do twice the rows in ~1.2x the time of one;
# in the K2 form each half walks half of the stages at ~1.28x a lone warpgroup's cost per stage,
# and with 64 tokens at ~0.78x the K2 form's: half the tensor-core work, the same
# dequantization), and per extra K split a fixed cost plus the INT32 partials' round trip
# through the workspace, which grows with the output (M x N x 4 bytes per split).
# Microseconds. It picks the measured best in all 14 cases, in 17 of the 18 of the committed
# library's sweep (gemm-v18-h200/final-explore.json, with a fifth slot per half for the 64-token
# form and M = 32, 48; the other 1.025x the best), and in 24 of version 17's 27 (whose sweep had
# no 64-token form; the other three within 1.09x); a constant cost per split (the
# model before version 14) picked 23% slower choices where the partials are large (M = 256,
# N = 11008: three splits of two warpgroups).
_WGMMA_WAVE_US = 2.026
# The 192-row CTAs of three 64-row warpgroups (WGMMA_M64, 3; 2026-12-04) are not in that sweep:
# their stage cost is set from the one case where they were measured the best, 11008 x 4096 at
# M = 256 (0.907x the time of the two row warpgroups' 86 CTAs, per group; 0.878x per channel;
# benchmarks/results/gemm-v27-h200/m64-explore*.txt), at the same ratio to that form's modelled
# time there. The least efficient form per row, the model takes it only where its grid needs
# fewer waves: it moved none of the other choices timed that day, and wherever it takes the
# form (17 cases timed, M = 128-4096) the form was the measured best (m64-plan-check*.txt).
_WGMMA_STAGE_US = {(WGMMA, 1): 0.825, (WGMMA, 2): 0.981, (WGMMA_K2, 1): 1.057, (WGMMA_K2_T64, 1): 0.827,
                   (WGMMA_M64, 3): 0.884}
_WGMMA_SPLIT_US, _WGMMA_SPLIT_US_PER_MB = 0.973, 0.594
MAX_SPLITS = 8


@dataclass(frozen=True)
class Plan:
    """Which kernel runs a GEMM: `tile` is NB (stream: 8*NB tokens per CTA), WGS (wgmma:
    warpgroups of 128 rows per CTA, WGMMA_M64: of 64 rows); `splits` > 1 splits K across CTAs
    (one launch)."""

    kernel: int
    tile: int
    splits: int

    @classmethod
    def parse(cls, text: str) -> "Plan":
        """'KERNEL:TILE:SPLITS' with KERNEL a name of KERNEL_NAMES (e.g. 'wgmma_m64:3:1'); ValueError otherwise."""
        names = {name: kernel for kernel, name in KERNEL_NAMES.items()}
        try:
            name, tile, splits = text.split(":")
            return cls(names[name], int(tile), int(splits))
        except (ValueError, KeyError):
            raise ValueError(f"{text!r}: give KERNEL:TILE:SPLITS with KERNEL one of {', '.join(names)} "
                             "(e.g. wgmma_m64:3:1)") from None

    def max_splits(self, k_tiles: int) -> int:
        """The most K splits this kernel can take: wgmma splits whole 4-k-tile stages."""
        return math.ceil(k_tiles / 4) if self.kernel in WGMMA_KERNELS else k_tiles

    def grid_tiles(self, m: int, n_tiles: int) -> int:
        """CTA tiles in the (x, y) plane of the grid: the split-K counters needed."""
        if self.kernel in _STREAM_SHAPES:
            return math.ceil(n_tiles / _STREAM_SHAPES[self.kernel][0]) * math.ceil(m / (8 * self.tile))
        tokens = 64 if self.kernel == WGMMA_K2_T64 else _WGMMA_TOKENS
        row_tiles = (2 if self.kernel == WGMMA_M64 else _WGMMA_ROW_TILES_PER_WG) * self.tile
        return math.ceil(n_tiles / row_tiles) * math.ceil(m / tokens)

    def name(self) -> str:
        return f"{KERNEL_NAMES[self.kernel]} tile={self.tile} splits={self.splits}"


def check_plan(p: Plan, k_tiles: int) -> None:
    """A plan the library can launch (PLAN_OVERRIDE may hold any): raise ValueError if not."""
    tiles = {STREAM: (1, 2, 4, 8), WGMMA: (1, 2), STREAM_1X16: (1, 2), STREAM_2X8: (1, 2), WGMMA_K2: (1,), WGMMA_K2_T64: (1,),
             WGMMA_M64: (3,)}
    if p.kernel not in tiles or p.tile not in tiles[p.kernel]:
        raise ValueError(f"no kernel {p.kernel} with tile {p.tile}: kernels and tiles are {tiles}")
    most = p.max_splits(k_tiles)
    if not 1 <= p.splits <= most:
        raise ValueError(f"{p.splits} K splits for {k_tiles} k-tiles: between 1 and {most}")


def stream_tile(m: int) -> int:
    """NB of the stream kernel for M tokens: 8 NB tokens per CTA (see plan)."""
    return 1 if m <= 8 else 2 if m <= 16 else 4 if m <= 32 else 8


def plan(m: int, n_tiles: int, k_tiles: int, sms: int, hopper: bool, wide: bool = True, weight_bits: int = 4) -> Plan:
    """The tile configuration for an [m, 32*k_tiles] x [32*n_tiles, 32*k_tiles]^T GEMM.

    M <= 32 (or no Hopper): the stream kernel. The GEMM is a weight stream bounded by memory
    bandwidth; tokens per CTA grow with M (8, 16, 32, 64: NB = 1, 2, 4, 8) so that each weight
    byte is read once, and K is split across CTAs until about two CTAs per multiprocessor
    run (enough 128-bit loads in flight), never past one wave of them, and never so far that a
    warp of a split gets less than one full chunk of k-tiles.
      M <= 8: NB 1 | <= 16: NB 2 | <= 32: NB 4 | larger (no Hopper): NB 8, ceil(M / 64) token tiles
    (On Hopper, M = 17..32 with at least 12 MB of packed W4 weights goes to the wgmma kernel's
    64-token form instead: measured 1.07-1.27x faster there, slower on 4096 x 4096; W8 weights,
    weight_bits = 8, stay on the stream kernel.)
    At M <= 16, when the row tiles alone make one wave of 16-warp CTAs (3/4 of the SMs to all
    of them: 1 row tile per CTA, else 2), those CTAs (`wide`; 1 x 16 or 2 x 8 warps, one per
    SM) run unsplit instead: no split-K round trip, whose last CTA the next kernel waits for.
    Measured on the H200 (benchmarks/gemm.py --explore-wide): 1.12-1.20x on 4096 x 4096,
    1.05-1.11x on 4096 x 14336, 1.02-1.10x on 8192 x 8192; where they would need two waves
    (14336 x 4096) they were 0.76-0.84x, and the plan keeps the 8-warp CTAs there.
    M > 32 on Hopper (and M = 17..32 as above): the wgmma kernel, one CTA per multiprocessor,
    128 tokens per CTA with 1 or 2 warpgroups of 128 rows each, or 3 of 64 rows (192-row CTAs),
    or the K2 form (128 rows, two halves of warpgroups taking alternate stages, one warpgroup per
    m16 block in each) with 128 or 64 tokens, and 1..8 K splits (whole pipeline stages): the
    least time in a model fitted to the measurements (_WGMMA_*: waves x (fixed + stages a
    warpgroup walks x cost per stage) + cost per extra split, growing with the output). On its
    sweep (20 choices x 14 cases, M = 64..512 on five shapes) it picks the fastest in all 14:
    the 64-token K2 form at M = 64 (1.14-1.27x the 128-token forms) and at M = 128 on 4096 x
    4096, the 128-token forms from M = 256; the 192-row CTAs where their grid needs fewer waves
    (11008 x 4096 at M = 256: 1.10x; the best of 25 choices on all 17 cases timed).
    """
    nb4_on_wgmma = (hopper and weight_bits == 4 and stream_tile(m) == 4
                    and n_tiles * k_tiles * 512 >= _WGMMA_NB4_MIN_BYTES)  # 512 B of W4 codes a tile
    if not hopper or (m < _WGMMA_MIN_M and not nb4_on_wgmma):
        nb = stream_tile(m)
        if wide and nb <= 2:
            for kernel in (STREAM_1X16, STREAM_2X8):
                if 0.75 * sms <= Plan(kernel, nb, 1).grid_tiles(m, n_tiles) <= sms:
                    return Plan(kernel, nb, 1)
        p = Plan(STREAM, nb, 1)
        target = _STREAM_CTAS_PER_SM[nb] * sms
        full_chunks = max(1, k_tiles // (_STREAM_WARPS_K * _STREAM_CHUNK[nb]))
        # Never past one wave of those slots: 11008 x 4096 (172 CTA tiles) split 2 ways (344 CTAs
        # for 264 slots, as the rounded count gave) took 1.27-1.46x as long as unsplit at
        # M = 1..16 (H200, benchmarks/gemm.py --explore-plans).
        splits = target // p.grid_tiles(m, n_tiles)
        return Plan(STREAM, nb, max(1, min(splits, full_chunks, MAX_SPLITS)))
    best, best_cost = None, math.inf
    for kernel, wgs in _WGMMA_STAGE_US:
        for splits in range(1, min(MAX_SPLITS, math.ceil(k_tiles / 4)) + 1):
            p = Plan(kernel, wgs, splits)
            waves, walked, extra, partials_mb = wgmma_cost_terms(p, m, n_tiles, k_tiles, sms)
            cost = waves * (_WGMMA_WAVE_US + walked * _WGMMA_STAGE_US[kernel, wgs])
            cost += extra * (_WGMMA_SPLIT_US + _WGMMA_SPLIT_US_PER_MB * partials_mb)
            if cost < best_cost:
                best, best_cost = p, cost
    return best


def wgmma_cost_terms(p: Plan, m: int, n_tiles: int, k_tiles: int, sms: int) -> tuple[int, int, int, float]:
    """The terms of plan's wgmma cost model for `p`: waves of CTAs, the 4-k-tile pipeline stages one
    warpgroup walks, extra K splits, and MB of INT32 partials per extra split (also what
    benchmarks/fit_wgmma_plan.py fits the constants to)."""
    stages = math.ceil(k_tiles / 4)
    waves = math.ceil(p.grid_tiles(m, n_tiles) * p.splits / sms)
    walked = math.ceil(stages / p.splits)  # the stages of one split ...
    if p.kernel in (WGMMA_K2, WGMMA_K2_T64):
        walked = math.ceil(walked / 2)  # ... of which each of the K2 form's halves takes every other one
    return waves, walked, p.splits - 1, m * n_tiles * 32 * 4 / 1e6


PLAN_OVERRIDE: Plan | None = None  # benchmarks/gemm.py times a chosen kernel with this


def set_dependent_launch(enabled: bool = True) -> None:
    """Whether the GEMM kernels (W4A8, W8A8, fused sparse-dense, W4A16) go out as programmatic
    dependent launches on Hopper, for the whole process (default: yes). A dependent GEMM's
    CTAs start (the small-M kernel's also load their first weights) while the previous kernel
    of the stream finishes; they wait for it before they read activations or write anything.
    benchmarks/gemm.py --explore-stream times both."""
    _call("qoq_gemm_set_dependent_launch", int(enabled))


def set_fused_dependent_launch(enabled: bool = False) -> None:
    """The same for the small kernels between the GEMMs (the fused norm / quantization kernels,
    qk_norm_rope): off by default - benchmarks/decode.py --fused-pdl times both."""
    _call("qoq_fused_set_dependent_launch", int(enabled))


def set_stage_activations(enabled: bool = True) -> None:
    """Whether the small-M (stream) kernel copies each chunk's activations into shared memory
    with 16-byte copies before its mma reads them (at M >= 8), instead of loading the 32-bit B
    fragments from global memory, for the whole process (default: yes; measured 1.15-1.6x
    faster at M = 16 and 32 on the H200). benchmarks/gemm.py --stage-ab times both."""
    _call("qoq_gemm_set_stage_activations", int(enabled))


FUSED_STAGE_NEVER, FUSED_STAGE_TWO_BLOCKS, FUSED_STAGE_ALWAYS = 0, 1, 2  # FusedStaging of gemm_kernels.cuh


def set_fused_staging(mode: int = FUSED_STAGE_ALWAYS) -> None:
    """When the fused sparse-dense kernel stages its activations in shared memory (only while
    set_stage_activations holds), for the whole process: never, with 16 tokens per CTA (M > 8),
    or from M = 8 like the dense kernel (the default; its outlier path gathers activations from
    the staged chunk, measured faster than through L1 at M = 8 and 16 on the H200).
    benchmarks/sparse_dense.py --explore times the choices."""
    if mode not in (FUSED_STAGE_NEVER, FUSED_STAGE_TWO_BLOCKS, FUSED_STAGE_ALWAYS):
        raise ValueError(f"fused staging mode {mode!r}: 0 (never), 1 (16 tokens per CTA) or 2 (from M = 8)")
    _call("qoq_gemm_set_fused_staging", mode)


TRACE_WORDS = 8  # kTraceWords of kernels/gemm_common.cuh: the int64 words of one CTA's timeline


def set_trace(buffer: Tensor | None) -> None:
    """Diagnostics: the stream GEMM kernels launched from now on (this process) write their
    CTAs' timelines into `buffer` (CUDA int64, TRACE_WORDS per CTA of the grid: global-timer
    stamps in ns at entry, after the dependent-launch wait, after the first chunk, after the
    main loop, after the k-slice and split-K reductions and after the stores, then the
    multiprocessor | ran-the-epilogue << 32), or nowhere (None, the default). The buffer must
    outlive every launch that holds it, CUDA-graph replays included.
    benchmarks/gemm_timeline.py reads them."""
    if buffer is not None and (not isinstance(buffer, Tensor) or buffer.dtype != torch.int64 or not buffer.is_cuda):
        raise ValueError("the trace buffer must be a CUDA int64 tensor")
    _call("qoq_gemm_set_trace", None if buffer is None else buffer.data_ptr())


@functools.lru_cache(maxsize=None)
def _device_info(index: int) -> tuple[int, bool]:
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, props.major == 9


# Split-K counters: one int32 per CTA tile, zero between launches (the last CTA of each
# tile resets its own). One buffer per device, shared by every GEMM: kernels on one
# stream never overlap; GEMMs running concurrently on several streams are not supported.
_COUNTERS: dict[int, Tensor] = {}


def _counters(device: torch.device, needed: int) -> Tensor:
    buf = _COUNTERS.get(device.index)
    if buf is None or buf.numel() < needed:
        buf = torch.zeros(max(needed, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device.index] = buf
    return buf


# -- validation (before any launch) -----------------------------------------------------------
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _expect(name: str, t, dtype: torch.dtype, shape: tuple) -> None:
    """t must be a contiguous `dtype` tensor of `shape` (None entries match any size)."""
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {_dtype_name(dtype)}, got {_dtype_name(t.dtype)}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        want = ", ".join("*" if s is None else str(s) for s in shape)
        raise ValueError(f"{name} must have shape [{want}], got {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")


# Operands the kernels read with 16-byte vector loads or cp.async: their base must be aligned.
_VECTOR_READ = {"x", "x_q", "delta", "gate", "up", "weight", "qweight", "scale1", "zero_x_scale1", "tc_entries", "rotation"}


def _expect_device(**tensors: Tensor) -> torch.device:
    """All on one CUDA device; the vector-read ones 16-byte aligned."""
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(f"all operands must be on one device, got {', '.join(sorted(map(str, devices)))}")
    device = devices.pop()
    if device.type != "cuda":
        raise ValueError(f"the kernels run on CUDA tensors, got {device} tensors")
    for name, t in tensors.items():
        if name in _VECTOR_READ and t.numel() and t.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned (a fresh or .clone()d tensor is)")
    return device


def _check_activations(x_q: Tensor, x_scale: Tensor) -> tuple[int, int]:
    _expect("x_q", x_q, torch.int8, (None, None))
    m, kp = x_q.shape
    if kp % 32 or kp == 0:
        raise ValueError(f"x_q has {kp} columns; it must be K padded to a multiple of 32 (the packed k_padded)")
    _expect("x_scale", x_scale, torch.float16, (m,))
    return m, kp


def _check_rows(out_features: int, n_tiles: int) -> None:
    if not (n_tiles * 32 - 31 <= out_features <= n_tiles * 32):
        raise ValueError(f"out_features {out_features} does not fit {n_tiles} packed row tiles of 32")


def check_w4a8_per_group(x_q, x_scale, qweight, scale0, scale1, zero_x_scale1, out_features: int) -> int:
    """Validate the per-group W4A8 operands; returns log2(group size / 32)."""
    m, kp = _check_activations(x_q, x_scale)
    _expect("qweight", qweight, torch.uint8, (None, kp // 32, 32, 16))
    nt = qweight.shape[0]
    _expect("scale0", scale0, torch.float16, (nt * 32,))
    _expect("scale1", scale1, torch.uint8, (nt, None, 32))
    groups = scale1.shape[1]
    _expect("zero_x_scale1", zero_x_scale1, torch.uint8, (nt, groups, 32))
    shift = _group_shift(groups, kp)
    _check_rows(out_features, nt)
    _expect_device(x_q=x_q, x_scale=x_scale, qweight=qweight, scale0=scale0, scale1=scale1, zero_x_scale1=zero_x_scale1)
    return shift


def check_w4a8_per_channel(x_q, x_scale, x_rowsum, qweight, scale, zero, out_features: int) -> None:
    m, kp = _check_activations(x_q, x_scale)
    _expect("x_rowsum", x_rowsum, torch.int32, (m,))
    _expect("qweight", qweight, torch.uint8, (None, kp // 32, 32, 16))
    nt = qweight.shape[0]
    _expect("scale", scale, torch.float16, (nt * 32,))
    _expect("zero", zero, torch.uint8, (nt * 32,))
    _check_rows(out_features, nt)
    _expect_device(x_q=x_q, x_scale=x_scale, x_rowsum=x_rowsum, qweight=qweight, scale=scale, zero=zero)


def check_w8a8(x_q, x_scale, qweight, scale, out_features: int) -> None:
    m, kp = _check_activations(x_q, x_scale)
    _expect("qweight", qweight, torch.int8, (None, kp // 32, 32, 32))
    nt = qweight.shape[0]
    _expect("scale", scale, torch.float16, (nt * 32,))
    _check_rows(out_features, nt)
    _expect_device(x_q=x_q, x_scale=x_scale, qweight=qweight, scale=scale)


# Tile-COO buckets as the kernel hard-codes them (kBucketN, kBucketK in kernels/gemm_common.cuh);
# tests/test_sparse_dense_gpu.py checks they equal qoqtool.packing.tile_coo's BUCKET_N, BUCKET_K.
TILE_COO_BUCKET = (32, 64)
TILE_COO_ENTRY_BYTES = 16


def check_tile_coo(tc_entries, tc_start, tc_count, n_tiles: int, k_padded: int) -> None:
    """Dtypes and shapes of a Tile-COO section for a weight of n_tiles row tiles and packed K.

    The contents (offsets within the entries, indices within their tiles) are checked once,
    when the section is loaded (qoqtool.packing.tile_coo.validate): reading them back from
    the GPU on every call would synchronize the stream.
    """
    _expect("tc_entries", tc_entries, torch.uint8, (None, TILE_COO_ENTRY_BYTES))
    buckets = (n_tiles, -(-k_padded // TILE_COO_BUCKET[1]))
    _expect("tc_start", tc_start, torch.int32, buckets)
    _expect("tc_count", tc_count, torch.int32, buckets)


MAX_QUANTIZE_K = 32768  # kernels/fused_ops.cu keeps a padded row in registers


def check_quantize(x: Tensor, k_padded: int, name: str = "x") -> tuple[int, int]:
    _expect(name, x, torch.float16, (None, None))
    m, k = x.shape
    if k == 0 or k_padded < k or k_padded % 32 or k_padded > MAX_QUANTIZE_K:
        raise ValueError(f"k_padded {k_padded} must be a multiple of 32, at least K = {k} and at most {MAX_QUANTIZE_K}")
    return m, k


# -- GEMMs --------------------------------------------------------------------------------------
_GEMMS = {  # kind -> (entry point, validation, operand names)
    "per_group": ("qoq_w4a8_gemm_per_group", check_w4a8_per_group,
                  ("x_q", "x_scale", "qweight", "scale0", "scale1", "zero_x_scale1")),
    "per_channel": ("qoq_w4a8_gemm_per_channel", check_w4a8_per_channel,
                    ("x_q", "x_scale", "x_rowsum", "qweight", "scale", "zero")),
    "w8a8": ("qoq_w8a8_gemm", check_w8a8, ("x_q", "x_scale", "qweight", "scale")),
}


def _output(x_q: Tensor, out: Tensor | None, out_features: int, dtype: torch.dtype) -> Tensor:
    """The [M, out_features] result buffer: a new one, or the caller's after checking it."""
    if out is None:
        return torch.empty((x_q.shape[0], out_features), dtype=dtype, device=x_q.device)
    _expect("out", out, dtype, (x_q.shape[0], out_features))
    _expect_device(x_q=x_q, out=out)
    return out


def _split_buffers(p: Plan, m: int, n_tiles: int, device, partials=(torch.int32,)) -> list[Tensor | None]:
    """Split-K's [splits, M, NT*32] partial sums (one buffer per dtype in `partials`) and the
    CTA tiles' arrival counters; None for each without split-K. The caller keeps them alive
    until the launch is queued (the allocator may reuse freed memory at once)."""
    if p.splits == 1:
        return [None] * (len(partials) + 1)
    buffers = [torch.empty(p.splits * m * n_tiles * 32, dtype=dtype, device=device) for dtype in partials]
    return buffers + [_counters(device, p.grid_tiles(m, n_tiles))]


def _ptr(t: Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(0) if t is None else kl.ptr(t)


def run_gemm(kind: str, *operands: Tensor, out_features: int, out: Tensor | None = None,
             out_i32: bool = False, x_rowsum: Tensor | None = None) -> Tensor:
    """Validate, plan, launch one GEMM kernel; the custom ops below call this.

    kind: "per_group" | "per_channel" | "w8a8", operands in the order of that op. `out`
    (optional, [M, out_features] contiguous fp16, or int32 with out_i32) receives the result:
    tests poison it first. out_i32 writes the raw INT32 accumulations instead of scaled fp16
    (after the zero-point term for per-channel W4), for bit-exact comparisons. x_rowsum
    (per_group only, optional; [M] int32, the sums of x_q's rows as the quantize ops return
    them): the wgmma kernel then multiplies the weights as UINT8 + 128 and subtracts 128 *
    x_rowsum, one instruction fewer per four weights; the results are the same.
    """
    entry, check, names = _GEMMS[kind]
    tail = check(*operands, out_features)
    tail = () if tail is None else (tail,)  # the per-group check returns the group shift
    x_q, n_tiles = operands[0], operands[names.index("qweight")].shape[0]
    if x_rowsum is not None:
        if kind != "per_group":
            raise ValueError(f"the x_rowsum option is the per_group GEMM's, not {kind!r}'s "
                             "(per_channel takes the row sums as an operand, w8a8 takes none)")
        _expect("x_rowsum", x_rowsum, torch.int32, (x_q.shape[0],))
        _expect_device(x_q=x_q, x_rowsum=x_rowsum)
    m, kp = x_q.shape
    out = _output(x_q, out, out_features, torch.int32 if out_i32 else torch.float16)
    if m == 0:
        return out
    if x_rowsum is not None and hasattr(_lib(), "qoq_w4a8_gemm_per_group_rowsum"):  # (else an older build: without)
        entry, operands = "qoq_w4a8_gemm_per_group_rowsum", (*operands[:2], x_rowsum, *operands[2:])
    sms, hopper = _device_info(x_q.device.index)
    p = PLAN_OVERRIDE or plan(m, n_tiles, kp // 32, sms, hopper, weight_bits=8 if kind == "w8a8" else 4)
    check_plan(p, kp // 32)
    split = _split_buffers(p, m, n_tiles, x_q.device)  # workspace, counters
    _call(entry, p.kernel, p.tile, p.splits, *map(kl.ptr, operands), kl.ptr(out), int(out_i32), m, out_features,
          kp, *tail, *map(_ptr, split), kl.stream_of(x_q))
    return out


# The fused sparse-dense GEMM: the outliers ride inside the stream kernel (small M). The
# packed linear uses it up to this many tokens and the dense wgmma kernel + a separate sparse
# product above. Measured on the H200 (benchmarks/RESULTS.md, issue 8): at 0.5-5% outliers the
# fused kernel is 1.9-6.0x faster than the stream kernel + a separate product at M <= 16 and
# 1.25-3.3x at M = 32, but only 1.07-1.2x at M = 64 at 0.5-1%, where the dense wgmma kernel is
# itself ~1.2x faster than the stream kernel.
FUSED_MAX_M = 32
# QOQTOOL_FUSED_OUTLIERS=0 makes packed models add their outliers with the separate product
# (the stopgap) at every M, for comparison.
FUSED_OUTLIERS = os.environ.get("QOQTOOL_FUSED_OUTLIERS", "1") != "0"
# QOQTOOL_FUSED_SLICED=1 sends every input of a packed W4A8 linear with outliers through the
# fused kernel, FUSED_MAX_M tokens at a time (the activations are quantized per token, so the
# slices compute what the whole input would). Slower above FUSED_MAX_M than the wgmma kernel +
# the separate product (each slice reads all the weights again): it exists to measure the fused
# kernel end to end on whole-window perplexity, where every linear has thousands of tokens.
FUSED_SLICED = os.environ.get("QOQTOOL_FUSED_SLICED", "0") == "1"
_SPARSE_DENSE_ENTRY = {"per_group": "qoq_w4a8_sparse_dense_gemm_per_group",
                       "per_channel": "qoq_w4a8_sparse_dense_gemm_per_channel"}


def _stream_only_plan(m: int, n_tiles: int, kp: int, device, what: str,
                      wide: bool = False) -> tuple[Plan, list[Tensor | None]]:
    """For the GEMMs that exist only on the stream kernel (fused sparse-dense, W4A16): its plan
    as on a GPU without wgmma, with the 16-warp CTA shapes if `wide` (PLAN_OVERRIDE may force
    tile, splits and those shapes, not another kernel), and the split-K buffers: INT32
    workspace, fp32 partials, counters."""
    sms, _ = _device_info(device.index)
    p = PLAN_OVERRIDE or plan(m, n_tiles, kp // 32, sms, hopper=False, wide=wide)
    if p.kernel not in ((STREAM, STREAM_1X16, STREAM_2X8) if wide else (STREAM,)):
        raise ValueError(f"{what} runs on the stream kernel only" + (" (8 or 16 warps)" if wide else " (8 warps)"))
    return p, _split_buffers(p, m, n_tiles, device, partials=(torch.int32, torch.float32))


def run_sparse_dense_gemm(kind: str, *operands: Tensor, tc: tuple[Tensor, Tensor, Tensor], out_features: int,
                          out: Tensor | None = None) -> Tensor:
    """Validate, plan, launch the fused W4A8 + Tile-COO GEMM; the custom ops below call this.

    kind: "per_group" | "per_channel", operands as for run_gemm; tc = (tc_entries, tc_start,
    tc_count) of a section that passed tile_coo.validate. Always the stream kernel (the plan
    as on a GPU without wgmma, 16-warp CTAs included); PLAN_OVERRIDE may force its shape, tile
    and splits, not the wgmma kernel. fp16 output only.
    """
    if kind not in ("per_group", "per_channel"):
        raise ValueError(f"the fused sparse-dense GEMM exists for per_group and per_channel W4A8, not {kind!r}")
    _, check, names = _GEMMS[kind]
    x_q = operands[0]
    m, kp = _check_activations(x_q, operands[1])
    check_tile_coo(*tc, -(-out_features // 32), kp)  # the section's shapes first (CPU-testable)
    tail = check(*operands, out_features)  # the dense operands, then their device and alignment
    tail = () if tail is None else (tail,)
    n_tiles = operands[names.index("qweight")].shape[0]
    _expect_device(x_q=x_q, tc_entries=tc[0], tc_start=tc[1], tc_count=tc[2])
    out = _output(x_q, out, out_features, torch.float16)
    if m == 0:
        return out
    p, split = _stream_only_plan(m, n_tiles, kp, x_q.device, "the fused sparse-dense GEMM", wide=True)
    _call(_SPARSE_DENSE_ENTRY[kind], p.kernel, p.tile, p.splits, *map(kl.ptr, operands), *map(kl.ptr, tc),
          kl.ptr(out), m, out_features, kp, *tail, *map(_ptr, split), kl.stream_of(x_q))
    return out


# -- W4A16 (fp16 activations), small M ---------------------------------------------------------------
def _group_shift(groups: int, kp: int) -> int:
    group_size = kp // groups if groups else 0
    if groups == 0 or kp % groups or group_size % 32 or (group_size // 32) & (group_size // 32 - 1):
        raise ValueError(f"{groups} groups over K = {kp}: the group size must be 32 * 2^j (32, 64, 128, ...)")
    return (group_size // 32).bit_length() - 1


def check_w4a16(x, qweight, scale, zero, out_features: int) -> int:
    """Validate the W4A16 operands (x fp16 [M, Kp], zero past K); returns log2(group size / 32)."""
    _expect("x", x, torch.float16, (None, None))
    kp = x.shape[1]
    if kp % 32 or kp == 0:
        raise ValueError(f"x has {kp} columns; it must be K padded to the group size (the packed k_padded)")
    _expect("qweight", qweight, torch.uint8, (None, kp // 32, 32, 16))
    nt = qweight.shape[0]
    _expect("scale", scale, torch.float16, (nt, None, 32))
    _expect("zero", zero, torch.uint8, (nt, scale.shape[1], 32))
    shift = _group_shift(scale.shape[1], kp)
    _check_rows(out_features, nt)
    _expect_device(x=x, qweight=qweight, scale=scale, zero=zero)
    return shift


def run_w4a16_gemm(x: Tensor, qweight: Tensor, scale: Tensor, zero: Tensor, out_features: int,
                   tc: tuple[Tensor, Tensor, Tensor] | None = None, out: Tensor | None = None) -> Tensor:
    """Validate, plan, launch the W4A16 stream kernel (with the Tile-COO section `tc` fused in,
    when given). The stream kernel's plan for M; PLAN_OVERRIDE may force its tile and splits."""
    shift = check_w4a16(x, qweight, scale, zero, out_features)
    m, kp = x.shape
    n_tiles = qweight.shape[0]
    if tc is not None:
        check_tile_coo(*tc, n_tiles, kp)
        _expect_device(x=x, tc_entries=tc[0], tc_start=tc[1], tc_count=tc[2])
    out = _output(x, out, out_features, torch.float16)
    if m == 0:
        return out
    p, split = _stream_only_plan(m, n_tiles, kp, x.device, "the W4A16 GEMM")
    ptrs = (kl.ptr(x), kl.ptr(qweight), kl.ptr(scale), kl.ptr(zero))
    if tc is None:
        _call("qoq_w4a16_gemm", p.tile, p.splits, *ptrs, kl.ptr(out), m, out_features, kp, shift, *map(_ptr, split),
              kl.stream_of(x))
    else:
        _call("qoq_w4a16_sparse_dense_gemm", p.tile, p.splits, *ptrs, *map(kl.ptr, tc), kl.ptr(out), m, out_features,
              kp, shift, *map(_ptr, split), kl.stream_of(x))
    return out


@torch.library.custom_op("qoqtool::w4a16_gemm", mutates_args=())
def w4a16_gemm(x: Tensor, qweight: Tensor, scale: Tensor, zero: Tensor, out_features: int) -> Tensor:
    """out[m, n] = fp16(sum_k x[m, k] * (q - z)[n, k] * s[n, k // G]), fp32 accumulation."""
    return run_w4a16_gemm(x, qweight, scale, zero, out_features)


@w4a16_gemm.register_fake
def _(x, qweight, scale, zero, out_features):
    return x.new_empty((x.shape[0], out_features), dtype=torch.float16)


@torch.library.custom_op("qoqtool::w4a16_sparse_dense_gemm", mutates_args=())
def w4a16_sparse_dense_gemm(x: Tensor, qweight: Tensor, scale: Tensor, zero: Tensor, tc_entries: Tensor,
                            tc_start: Tensor, tc_count: Tensor, out_features: int) -> Tensor:
    """w4a16_gemm + sum_k S[n, k] * x[m, k] (the Tile-COO outliers, fp16 activations), one kernel."""
    return run_w4a16_gemm(x, qweight, scale, zero, out_features, tc=(tc_entries, tc_start, tc_count))


@w4a16_sparse_dense_gemm.register_fake
def _(x, qweight, scale, zero, tc_entries, tc_start, tc_count, out_features):
    return x.new_empty((x.shape[0], out_features), dtype=torch.float16)


def _gemm_fake(x_q: Tensor, out_features: int) -> Tensor:
    return x_q.new_empty((x_q.shape[0], out_features), dtype=torch.float16)


@torch.library.custom_op("qoqtool::w4a8_gemm_per_group", mutates_args=())
def w4a8_gemm_per_group(x_q: Tensor, x_scale: Tensor, qweight: Tensor, scale0: Tensor, scale1: Tensor,
                        zero_x_scale1: Tensor, out_features: int, x_rowsum: Tensor | None = None) -> Tensor:
    """out[m, n] = fp16(sum_k x_q[m, k] * (q - z)*s1 [n, k] * x_scale[m] * scale0[n]); x_rowsum
    (optional, the quantize ops' third output) makes the wgmma kernel (M > 32) cheaper."""
    return run_gemm("per_group", x_q, x_scale, qweight, scale0, scale1, zero_x_scale1, out_features=out_features,
                    x_rowsum=x_rowsum)


@w4a8_gemm_per_group.register_fake
def _(x_q, x_scale, qweight, scale0, scale1, zero_x_scale1, out_features, x_rowsum=None):
    return _gemm_fake(x_q, out_features)


@torch.library.custom_op("qoqtool::w4a8_gemm_per_channel", mutates_args=())
def w4a8_gemm_per_channel(x_q: Tensor, x_scale: Tensor, x_rowsum: Tensor, qweight: Tensor, scale: Tensor,
                          zero: Tensor, out_features: int) -> Tensor:
    """out[m, n] = fp16((sum_k x_q[m, k] q[n, k] - zero[n] * x_rowsum[m]) * scale[n] * x_scale[m])."""
    return run_gemm("per_channel", x_q, x_scale, x_rowsum, qweight, scale, zero, out_features=out_features)


@w4a8_gemm_per_channel.register_fake
def _(x_q, x_scale, x_rowsum, qweight, scale, zero, out_features):
    return _gemm_fake(x_q, out_features)


@torch.library.custom_op("qoqtool::w8a8_gemm", mutates_args=())
def w8a8_gemm(x_q: Tensor, x_scale: Tensor, qweight: Tensor, scale: Tensor, out_features: int) -> Tensor:
    """out[m, n] = fp16(sum_k x_q[m, k] w[n, k] * x_scale[m] * scale[n])."""
    return run_gemm("w8a8", x_q, x_scale, qweight, scale, out_features=out_features)


@w8a8_gemm.register_fake
def _(x_q, x_scale, qweight, scale, out_features):
    return _gemm_fake(x_q, out_features)


@torch.library.custom_op("qoqtool::w4a8_sparse_dense_gemm_per_group", mutates_args=())
def w4a8_sparse_dense_gemm_per_group(x_q: Tensor, x_scale: Tensor, qweight: Tensor, scale0: Tensor, scale1: Tensor,
                                     zero_x_scale1: Tensor, tc_entries: Tensor, tc_start: Tensor, tc_count: Tensor,
                                     out_features: int) -> Tensor:
    """out[m, n] = fp16(x_scale[m] * (scale0[n] * sum_k x_q[m, k] w8[n, k] + sum_k S[n, k] x_q[m, k])),
    S the fp16 outliers of the Tile-COO section (tc_*), the sparse sum in fp32."""
    return run_sparse_dense_gemm("per_group", x_q, x_scale, qweight, scale0, scale1, zero_x_scale1,
                                 tc=(tc_entries, tc_start, tc_count), out_features=out_features)


@w4a8_sparse_dense_gemm_per_group.register_fake
def _(x_q, x_scale, qweight, scale0, scale1, zero_x_scale1, tc_entries, tc_start, tc_count, out_features):
    return _gemm_fake(x_q, out_features)


@torch.library.custom_op("qoqtool::w4a8_sparse_dense_gemm_per_channel", mutates_args=())
def w4a8_sparse_dense_gemm_per_channel(x_q: Tensor, x_scale: Tensor, x_rowsum: Tensor, qweight: Tensor, scale: Tensor,
                                       zero: Tensor, tc_entries: Tensor, tc_start: Tensor, tc_count: Tensor,
                                       out_features: int) -> Tensor:
    """out[m, n] = fp16(x_scale[m] * (scale[n] * (sum_k x_q q - zero[n] x_rowsum[m]) + sum_k S[n, k] x_q[m, k]))."""
    return run_sparse_dense_gemm("per_channel", x_q, x_scale, x_rowsum, qweight, scale, zero,
                                 tc=(tc_entries, tc_start, tc_count), out_features=out_features)


@w4a8_sparse_dense_gemm_per_channel.register_fake
def _(x_q, x_scale, x_rowsum, qweight, scale, zero, tc_entries, tc_start, tc_count, out_features):
    return _gemm_fake(x_q, out_features)


# -- fused quantization ---------------------------------------------------------------------------
def _quantize_outputs(m: int, k_padded: int, device) -> tuple[Tensor, Tensor, Tensor]:
    return (torch.empty((m, k_padded), dtype=torch.int8, device=device),
            torch.empty(m, dtype=torch.float16, device=device),
            torch.empty(m, dtype=torch.int32, device=device))


def _quantize_fake(x: Tensor, k_padded: int) -> tuple[Tensor, Tensor, Tensor]:
    m = x.shape[0]
    return (x.new_empty((m, k_padded), dtype=torch.int8), x.new_empty(m, dtype=torch.float16),
            x.new_empty(m, dtype=torch.int32))


@torch.library.custom_op("qoqtool::quantize_per_token", mutates_args=())
def quantize_per_token(x: Tensor, k_padded: int) -> tuple[Tensor, Tensor, Tensor]:
    """fp16 x [M, K] -> (codes [M, k_padded] int8, zero past K; scales [M] fp16; code sums [M] int32)."""
    m, k = check_quantize(x, k_padded)
    _expect_device(x=x)
    outs = _quantize_outputs(m, k_padded, x.device)
    if m:
        _call("qoq_quantize_per_token", kl.ptr(x), m, k, k_padded, *map(kl.ptr, outs), kl.stream_of(x))
    return outs


@quantize_per_token.register_fake
def _(x, k_padded):
    return _quantize_fake(x, k_padded)


@torch.library.custom_op("qoqtool::rmsnorm_quantize", mutates_args=())
def rmsnorm_quantize(x: Tensor, weight: Tensor, eps: float, k_padded: int) -> tuple[Tensor, Tensor, Tensor]:
    """quantize_per_token(fp16(fp16(x * rsqrt(mean(x^2) + eps)) * weight)), the norm in fp32."""
    m, k = check_quantize(x, k_padded)
    _expect("weight", weight, torch.float16, (k,))
    _expect_device(x=x, weight=weight)
    outs = _quantize_outputs(m, k_padded, x.device)
    if m:
        _call("qoq_rmsnorm_quantize", kl.ptr(x), kl.ptr(weight), float(eps), m, k, k_padded, *map(kl.ptr, outs),
              kl.stream_of(x))
    return outs


@rmsnorm_quantize.register_fake
def _(x, weight, eps, k_padded):
    return _quantize_fake(x, k_padded)


@torch.library.custom_op("qoqtool::add_rmsnorm_quantize", mutates_args=())
def add_rmsnorm_quantize(x: Tensor, delta: Tensor, weight: Tensor, eps: float,
                         k_padded: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(h, *rmsnorm_quantize(h, weight, eps, k_padded)) for h = x + delta in fp16: the residual add
    before a norm, in the norm's kernel (bit for bit the two ops one after the other)."""
    check_quantize(x, k_padded)
    m, k = _check_norm(x, weight, delta)
    total = torch.empty_like(x)
    outs = _quantize_outputs(m, k_padded, x.device)
    if m:
        _call("qoq_add_rmsnorm_quantize", kl.ptr(x), kl.ptr(delta), kl.ptr(weight), float(eps), m, k, k_padded,
              kl.ptr(total), *map(kl.ptr, outs), kl.stream_of(x))
    return (total, *outs)


@add_rmsnorm_quantize.register_fake
def _(x, delta, weight, eps, k_padded):
    return (torch.empty_like(x), *_quantize_fake(x, k_padded))


def has_fused_norms() -> bool:
    """Whether the loaded library has the residual-add norm kernels (add_rmsnorm_quantize, and
    rmsnorm / add_rmsnorm for fp16 outputs); builds before 2026-12-07 lack them."""
    return hasattr(_lib(), "qoq_add_rmsnorm_quantize") and hasattr(_lib(), "qoq_add_rmsnorm")


def _check_norm(x: Tensor, weight: Tensor, delta: Tensor | None = None) -> tuple[int, int]:
    _expect("x", x, torch.float16, (None, None))
    m, k = x.shape
    if not 0 < k <= MAX_QUANTIZE_K:
        raise ValueError(f"rows of 1 to {MAX_QUANTIZE_K} features, got {k}")
    _expect("weight", weight, torch.float16, (k,))
    if delta is not None:
        _expect("delta", delta, torch.float16, (m, k))
        _expect_device(x=x, delta=delta, weight=weight)
    else:
        _expect_device(x=x, weight=weight)
    return m, k


@torch.library.custom_op("qoqtool::rmsnorm", mutates_args=())
def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """fp16(fp16(x * rsqrt(mean(x^2) + eps)) * weight) for fp16 rows x [M, K], the norm in fp32:
    transformers' Llama RMSNorm in one kernel, for the models whose linears are not quantized."""
    m, k = _check_norm(x, weight)
    out = torch.empty_like(x)
    if m:
        _call("qoq_add_rmsnorm", kl.ptr(x), None, kl.ptr(weight), float(eps), m, k, None, kl.ptr(out),
              kl.stream_of(x))
    return out


@rmsnorm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("qoqtool::add_rmsnorm", mutates_args=())
def add_rmsnorm(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(h, rmsnorm(h, weight, eps)) for h = x + delta in fp16: the residual add in the norm's kernel."""
    m, k = _check_norm(x, weight, delta)
    total, out = torch.empty_like(x), torch.empty_like(x)
    if m:
        _call("qoq_add_rmsnorm", kl.ptr(x), kl.ptr(delta), kl.ptr(weight), float(eps), m, k, kl.ptr(total),
              kl.ptr(out), kl.stream_of(x))
    return total, out


@add_rmsnorm.register_fake
def _(x, delta, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("qoqtool::silu_mul_quantize", mutates_args=())
def silu_mul_quantize(gate: Tensor, up: Tensor, k_padded: int) -> tuple[Tensor, Tensor, Tensor]:
    """quantize_per_token(fp16(silu(gate) * up)), the product in fp32."""
    m, k = check_quantize(gate, k_padded, "gate")
    _expect("up", up, torch.float16, (m, k))
    _expect_device(gate=gate, up=up)
    outs = _quantize_outputs(m, k_padded, gate.device)
    if m:
        _call("qoq_silu_mul_quantize", kl.ptr(gate), kl.ptr(up), m, k, k_padded, *map(kl.ptr, outs),
              kl.stream_of(gate))
    return outs


@silu_mul_quantize.register_fake
def _(gate, up, k_padded):
    return _quantize_fake(gate, k_padded)


# The rotation the fused kernel applies: R = (Sylvester(a) / sqrt(a)) (x) F diag(signs), a in
# ROTATE_SYLVESTER (a warp's column of a values, kernels/fused_ops.cu), F of order at most
# ROTATE_MAX_M as an fp32 matrix (CUDA cores), or F = H / sqrt(m) of an even order up to
# ROTATE_MAX_BITS_M with H given as sign bits (tensor cores; its shared memory, rotate_bits_smem,
# at most ROTATE_MAX_SMEM).
ROTATE_SYLVESTER, ROTATE_MAX_M, ROTATE_MAX_BITS_M, ROTATE_MAX_SMEM = (32, 1024), 32, 512, 227 * 1024


def rotate_bits_smem(sylvester: int, order: int) -> int:
    """Shared memory of the tensor-core rotation (kernels/fused_ops.cu, rotate_mma_smem): the row
    as fp16 [a][m rounded up to 16, + 8] and as fp32 [a][m], the sign bits [m][ceil(m / 32)]."""
    return sylvester * (((order + 15) & ~15) + 8) * 2 + sylvester * order * 4 + order * ((order + 31) // 32) * 4


def rotation_form_fits(sylvester: int, order: int, bits: bool) -> bool:
    """Whether a fused rotation kernel takes (H_a / sqrt(a)) (x) F with a = `sylvester` and F of
    order m = `order`: a a power of two in ROTATE_SYLVESTER, and m at most ROTATE_MAX_M (the fp32
    factor on the CUDA cores) or, `bits`, m even up to ROTATE_MAX_BITS_M within ROTATE_MAX_SMEM
    (the sign bits on the tensor cores). The ops' checks and runtime.fusion's choice."""
    low, high = ROTATE_SYLVESTER
    if not low <= sylvester <= high or sylvester & (sylvester - 1):
        return False
    if not bits:
        return 1 <= order <= ROTATE_MAX_M
    return 2 <= order <= ROTATE_MAX_BITS_M and order % 2 == 0 and rotate_bits_smem(sylvester, order) <= ROTATE_MAX_SMEM


def hadamard_sign_bits(h: Tensor) -> Tensor:
    """The sign bits of a +-1 (or scaled +-1) matrix H [m, m] as silu_mul_rotate_quantize_bits
    takes them: int32 [m, ceil(m / 32)], bit k % 32 of word [n, k // 32] set where H[k, n] < 0."""
    m = h.shape[0]
    words = (m + 31) // 32
    neg = torch.zeros(m, words * 32, dtype=torch.int64)
    neg[:, :m] = (h.t() < 0).to(torch.int64).cpu()
    packed = (neg.reshape(m, words, 32) << torch.arange(32)).sum(-1)  # < 2^32
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32).to(h.device)


def has_fused_rotation(bits: bool = False) -> bool:
    """Whether the loaded library has the fused rotation (`bits`: its tensor-core form, 22:30 UTC
    that day): builds before 2026-12-06 (timed through benchmarks/library_ab.py) lack it, and
    runtime.fusion then rotates unfused."""
    return hasattr(_lib(), "qoq_silu_mul_rotate_quantize_bits" if bits else "qoq_silu_mul_rotate_quantize")


@torch.library.custom_op("qoqtool::silu_mul_rotate_quantize", mutates_args=())
def silu_mul_rotate_quantize(gate: Tensor, up: Tensor, factor: Tensor, signs: Tensor, sylvester: int,
                             k_padded: int) -> tuple[Tensor, Tensor, Tensor]:
    """quantize_per_token(fp16(fp16(silu(gate) * up) R)) with R = (H_a / sqrt(a)) (x) factor
    diag(signs), H_a Sylvester's Hadamard matrix of order a = `sylvester` (a power of two, 32..1024) and
    `factor` the m x m fp32 second factor (K = a m; m = 1: none) and `signs` +-1 - qoqtool.runtime.mlp's
    online down_proj rotation, in the quantization kernel."""
    m, k = check_quantize(gate, k_padded, "gate")
    _expect("up", up, torch.float16, (m, k))
    order = factor.shape[0] if factor.dim() == 2 else 0
    _expect("factor", factor, torch.float32, (order, order))
    _expect("signs", signs, torch.float32, (k,))
    low, high = ROTATE_SYLVESTER
    if not rotation_form_fits(sylvester, order, bits=False) or sylvester * order != k:
        raise ValueError(f"the fused rotation needs K = a * m with a a power of two from {low} to {high} and "
                         f"m <= {ROTATE_MAX_M}: got K = {k}, a = {sylvester}, m = {order}")
    _expect_device(gate=gate, up=up, factor=factor, signs=signs)
    outs = _quantize_outputs(m, k_padded, gate.device)
    if m:
        _call("qoq_silu_mul_rotate_quantize", kl.ptr(gate), kl.ptr(up), kl.ptr(factor), kl.ptr(signs), m, k, k_padded,
              sylvester, order, *map(kl.ptr, outs), kl.stream_of(gate))
    return outs


@silu_mul_rotate_quantize.register_fake
def _(gate, up, factor, signs, sylvester, k_padded):
    return _quantize_fake(gate, k_padded)


@torch.library.custom_op("qoqtool::silu_mul_rotate_quantize_bits", mutates_args=())
def silu_mul_rotate_quantize_bits(gate: Tensor, up: Tensor, bits: Tensor, signs: Tensor, sylvester: int,
                                  k_padded: int) -> tuple[Tensor, Tensor, Tensor]:
    """silu_mul_rotate_quantize with the second factor H / sqrt(m), H a +-1 matrix of an even order
    m = 2..ROTATE_MAX_BITS_M given as `bits` (hadamard_sign_bits(H), int32 [m, ceil(m / 32)]), on
    the tensor cores: Llama-2's 11008 = 32 x 344, Qwen2.5's 18944 = 128 x 148 (runtime.fusion
    takes it above fusion.BITS_ABOVE)."""
    m, k = check_quantize(gate, k_padded, "gate")
    _expect("up", up, torch.float16, (m, k))
    order = bits.shape[0] if bits.dim() == 2 else 0
    _expect("bits", bits, torch.int32, (order, (order + 31) // 32))
    _expect("signs", signs, torch.float32, (k,))
    low, high = ROTATE_SYLVESTER
    if not rotation_form_fits(sylvester, order, bits=True) or sylvester * order != k:
        raise ValueError(f"the fused tensor-core rotation needs K = a * m with a a power of two from {low} to {high}, "
                         f"m even from 2 to {ROTATE_MAX_BITS_M} and at most {ROTATE_MAX_SMEM} bytes of "
                         f"shared memory: got K = {k}, a = {sylvester}, m = {order}")
    _expect_device(gate=gate, up=up, bits=bits, signs=signs)
    outs = _quantize_outputs(m, k_padded, gate.device)
    if m:
        _call("qoq_silu_mul_rotate_quantize_bits", kl.ptr(gate), kl.ptr(up), kl.ptr(bits), kl.ptr(signs), m, k,
              k_padded, sylvester, order, *map(kl.ptr, outs), kl.stream_of(gate))
    return outs


@silu_mul_rotate_quantize_bits.register_fake
def _(gate, up, bits, signs, sylvester, k_padded):
    return _quantize_fake(gate, k_padded)


# -- queries and keys before attention ---------------------------------------------------------------
QK_MAX_HEAD_DIM, QK_MAX_ROTATED_HEAD_DIM = 256, 128  # kernels/qk_rope.cu: D = 32 J, J <= 8; R in 32 KB


def _token_rows(name: str, t: Tensor) -> int:
    """The element stride between consecutive tokens of t [B, T, H, D] whose heads are
    contiguous (a view into a GEMM's output rows, or a contiguous tensor); ValueError otherwise."""
    batch, steps, heads, dim = t.shape
    if t.stride(3) != 1 or (heads > 1 and t.stride(2) != dim):
        raise ValueError(f"{name}'s heads must be contiguous within a token ([B, T, H, D] with strides [*, *, D, 1])")
    stride = t.stride(1) if steps > 1 else t.stride(0)
    if batch > 1 and steps > 1 and t.stride(0) != steps * t.stride(1):
        raise ValueError(f"{name}'s tokens must be evenly spaced (the rows of one [B * T, *] tensor)")
    return stride if batch * steps > 1 else heads * dim


def qk_rope_fits(head_dim: int, rotated: bool) -> bool:
    """Whether qk_norm_rope takes heads of this size (with a key rotation: `rotated`)."""
    return head_dim % 32 == 0 and 0 < head_dim <= (QK_MAX_ROTATED_HEAD_DIM if rotated else QK_MAX_HEAD_DIM)


def has_qk_norm_rope() -> bool:
    """Whether the loaded library has qk_norm_rope (builds before 2026-12-07 lack it)."""
    return hasattr(_lib(), "qoq_qk_norm_rope")


@torch.library.custom_op("qoqtool::qk_norm_rope", mutates_args=())
def qk_norm_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, q_weight: Tensor | None, k_weight: Tensor | None,
                 eps: float, rotation: Tensor | None, key_shift: Tensor | None) -> tuple[Tensor, Tensor]:
    """Queries q [B, T, Hq, D] and keys k [B, T, Hkv, D] (fp16, each token's heads contiguous: views
    into the q/k/v GEMM's output are read in place) -> (q_out, k_out), the same shapes, contiguous:
    each head RMS-normalized with q_weight / k_weight [D] (Qwen3's q_norm / k_norm; both or
    neither) and eps, RoPE with cos, sin [B, T, D] (transformers' rotate_half form), times
    `rotation` [D, D] (the online key rotation), keys minus key_shift [Hkv, D] fp32 - every step
    optional but RoPE, each rounded to fp16 as the torch path rounds (kernels/qk_rope.cu)."""
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, Tensor) or t.dtype != torch.float16 or t.dim() != 4:
            raise ValueError(f"{name} must be an fp16 tensor [B, T, heads, head_dim]")
    batch, steps, q_heads, dim = q.shape
    kv_heads = k.shape[2]
    if k.shape[:2] != q.shape[:2] or k.shape[3] != dim:
        raise ValueError(f"q {list(q.shape)} and k {list(k.shape)} must agree on B, T and head_dim")
    if not qk_rope_fits(dim, rotation is not None):
        raise ValueError(f"head_dim must be a multiple of 32 up to {QK_MAX_HEAD_DIM} ({QK_MAX_ROTATED_HEAD_DIM} with a "
                         f"key rotation), got {dim}")
    q_stride, k_stride = _token_rows("q", q), _token_rows("k", k)
    _expect("cos", cos, torch.float16, (batch, steps, dim))
    _expect("sin", sin, torch.float16, (batch, steps, dim))
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight come together (the model's q_norm and k_norm) or not at all")
    optional = {}
    if q_weight is not None:
        _expect("q_weight", q_weight, torch.float16, (dim,))
        _expect("k_weight", k_weight, torch.float16, (dim,))
        optional.update(q_weight=q_weight, k_weight=k_weight)
    if rotation is not None:
        _expect("rotation", rotation, torch.float16, (dim, dim))
        optional["rotation"] = rotation
    if key_shift is not None:
        _expect("key_shift", key_shift, torch.float32, (kv_heads, dim))
        optional["key_shift"] = key_shift
    _expect_device(q=q, k=k, cos=cos, sin=sin, **optional)
    q_out = torch.empty(batch, steps, q_heads, dim, dtype=torch.float16, device=q.device)
    k_out = torch.empty(batch, steps, kv_heads, dim, dtype=torch.float16, device=q.device)
    if q.numel() and k.numel():
        _call("qoq_qk_norm_rope", kl.ptr(q), kl.ptr(k), q_stride, k_stride, kl.ptr(cos), kl.ptr(sin),
              *(kl.ptr_or_null(t) for t in (q_weight, k_weight)), float(eps),
              *(kl.ptr_or_null(t) for t in (rotation, key_shift)), batch * steps, q_heads, kv_heads, dim,
              kl.ptr(q_out), kl.ptr(k_out), kl.stream_of(q))
    return q_out, k_out


@qk_norm_rope.register_fake
def _(q, k, cos, sin, q_weight, k_weight, eps, rotation, key_shift):
    return torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(k, memory_format=torch.contiguous_format)


# -- the packed linear's forward pass ---------------------------------------------------------------
# q/k/v (and gate/up) read the same input tensor: quantizing it once for all of them saves
# two kernel launches per layer. The last input is remembered by identity and version
# counter (a strong reference keeps its memory from being reused while it is remembered;
# in-place changes bump the version). Nothing is remembered or reused while a CUDA graph is
# being captured: a captured quantization must not be reused outside that graph's replay.
SHARE_INPUT_QUANTIZATION = True
_last_input: tuple | None = None  # (x, x._version, k_padded, (x_q, x_scale, x_rowsum))


def clear_quantization_cache() -> None:
    global _last_input
    _last_input = None


def aligned_rows(t: Tensor) -> Tensor:
    """t as contiguous rows [tokens, features] whose base is 16-byte aligned (the kernels read
    16-byte vectors; a view into a larger tensor may start anywhere)."""
    x = t.reshape(-1, t.shape[-1]).contiguous()
    return x.clone() if x.data_ptr() % 16 else x


def _quantized_input(x: Tensor, k_padded: int) -> tuple[Tensor, Tensor, Tensor]:
    global _last_input
    share = SHARE_INPUT_QUANTIZATION and not torch.cuda.is_current_stream_capturing()
    if share and _last_input is not None:
        x0, version, kp, result = _last_input
        if x0 is x and version == x._version and kp == k_padded:
            return result
    result = torch.ops.qoqtool.quantize_per_token(aligned_rows(x.to(torch.float16)), k_padded)
    _last_input = (x, x._version, k_padded, result) if share else None
    return result


def fuses_outliers(module, tokens: int) -> bool:
    """Whether packed_linear_forward applies the module's Tile-COO outliers itself: W4A16 always
    (the fused W4A16 kernel, or the reference path above W4A16_MAX_M tokens); W4A8 progressive
    or per-channel UINT4 at most FUSED_MAX_M tokens (the fused sparse-dense kernel). Otherwise
    the caller adds them (PackedLinear._sparse_term). FUSED_SLICED: W4A8 at every M, in slices."""
    if not getattr(module, "has_outliers", False):
        return False
    if module.act_bits == 16:
        return module.kind == "uint4" and module.group_size is not None
    return (FUSED_OUTLIERS and module.act_bits == 8 and (tokens <= FUSED_MAX_M or FUSED_SLICED)
            and (module.kind == "progressive" or (module.kind == "uint4" and module.group_size is None)))


# The paths of a packed linear's call on CUDA (kernel_path), as `qoqtool eval` reports them.
PATH_KERNEL, PATH_FUSED = "kernel", "fused sparse-dense kernel"
PATH_SEPARATE = "kernel + separate sparse product"  # the caller adds the outliers (PackedLinear._sparse_term)
PATH_W4A16_PREFILL = "reference path (W4A16 prefill)"


def kernel_path(module, tokens: int) -> str:
    """Which computation packed_linear_forward gives a call of `tokens` tokens (PATH_*); with
    PATH_SEPARATE the caller still has to add the outliers."""
    if module.act_bits == 16 and tokens > W4A16_MAX_M:
        return PATH_W4A16_PREFILL
    if not getattr(module, "has_outliers", False):
        return PATH_KERNEL
    return PATH_FUSED if fuses_outliers(module, tokens) else PATH_SEPARATE


# The W4A16 kernel is a weight stream for decode-sized M; larger inputs (prefill, perplexity
# windows) take the reference path's dequantized matmul.
W4A16_MAX_M = 64


def _w4a16_forward(module, x: Tensor) -> Tensor:
    if module.kind != "uint4" or module.group_size is None:
        raise NotImplementedError(f"no kernel for {module.kind} weights with unquantized activations")
    if x.shape[-1] != module.in_features:
        raise ValueError(f"input has {x.shape[-1]} features, the layer takes {module.in_features}")
    tokens = x.numel() // x.shape[-1]
    if tokens > W4A16_MAX_M:
        return module.reference()(x)  # outliers and bias included
    x2 = x.reshape(tokens, module.in_features).to(torch.float16)
    x2 = torch.nn.functional.pad(x2, (0, module.k_padded - module.in_features)).contiguous()  # zeros past K
    n, ops = module.out_features, torch.ops.qoqtool
    dense = (x2, module.qweight, module.scale, module.zero)
    if module.has_outliers:
        y = ops.w4a16_sparse_dense_gemm(*dense, module.tc_entries, module.tc_start, module.tc_count, n)
    else:
        y = ops.w4a16_gemm(*dense, n)
    return _with_bias(module, y, x)


def _with_bias(module, y: Tensor, x: Tensor) -> Tensor:
    """The kernel's [tokens, N] output + the bias (in fp32, as the reference path adds it), in
    x's dtype and leading shape."""
    if module.bias is not None:
        y = y.float() + module.bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], module.out_features)


def int8_kernel_declines(module) -> str | None:
    """Why no GEMM kernel with INT8 activations takes this packed linear, or None when one does
    (progressive and per-channel UINT4 W4A8, W8A8)."""
    if module.act_bits != 8:
        return f"no kernel for {module.act_bits}-bit activations"
    if module.kind == "uint4" and module.group_size is not None:
        return "no kernel for UINT4 weights with float group scales"
    if module.kind not in ("progressive", "uint4", "int8_channel"):
        return f"no kernel for packed format {module.kind!r}"
    return None


def packed_linear_forward(module, x: Tensor, quantized: tuple[Tensor, ...] | None = None) -> Tensor:
    """y = module(x) on the GPU kernels for a packed linear (qoqtool.runtime.packed_linear).

    x: any leading dims, fp16/bf16/fp32 (W4A8: quantized from fp16; W4A16: multiplied in fp16);
    returns x.dtype. Raises NotImplementedError for formats without a kernel (W8A16, UINT4 with
    float group scales and INT8 activations, per-channel UINT4 with unquantized activations) so
    that the caller can fall back to the reference path. A module with outliers (`has_outliers`,
    buffers tc_*) gets them from the fused kernel when `fuses_outliers(module, tokens)`, and not
    at all otherwise (the caller adds them). `quantized`: (x_q, x_scale, x_rowsum) of x as a
    fused kernel computed them (W4A8 only; qoqtool.runtime.fusion), used instead of quantizing x.
    """
    if module.act_bits == 16:
        if quantized is not None:
            raise ValueError("W4A16 linears take unquantized activations")
        return _w4a16_forward(module, x)
    declined = int8_kernel_declines(module)
    if declined:
        raise NotImplementedError(declined)
    kind = module.kind
    if x.shape[-1] != module.in_features:
        raise ValueError(f"input has {x.shape[-1]} features, the layer takes {module.in_features}")
    x_q, x_scale, x_rowsum = quantized or _quantized_input(x, module.k_padded)
    if x_q.shape != (x.numel() // x.shape[-1], module.k_padded):
        raise ValueError(f"the quantized input is {list(x_q.shape)}, the layer needs "
                         f"[{x.numel() // x.shape[-1]}, {module.k_padded}]")
    n = module.out_features
    ops = torch.ops.qoqtool
    rowsum = {}  # the dense per-group GEMM takes the row sums as an option (a cheaper wgmma main loop)
    if kind == "progressive":
        dense, fused = ops.w4a8_gemm_per_group, ops.w4a8_sparse_dense_gemm_per_group
        operands = (x_q, x_scale, module.qweight, module.scale0, module.scale1, module.zero_x_scale1)
        rowsum = {"x_rowsum": x_rowsum}
    elif kind == "uint4":
        dense, fused = ops.w4a8_gemm_per_channel, ops.w4a8_sparse_dense_gemm_per_channel
        operands = (x_q, x_scale, x_rowsum, module.qweight, module.scale, module.zero)
    else:
        dense, fused = ops.w8a8_gemm, None
        operands = (x_q, x_scale, module.qweight, module.scale)
    if fuses_outliers(module, x_q.shape[0]):  # never for W8A8
        tc, m = (module.tc_entries, module.tc_start, module.tc_count), x_q.shape[0]
        if m <= FUSED_MAX_M:
            y = fused(*operands, *tc, n)
        else:  # FUSED_SLICED: the per-token operands (x_q, x_scale, per channel x_rowsum) in row slices
            per_token = 3 if kind == "uint4" else 2
            y = torch.cat([fused(*(t[i:i + FUSED_MAX_M] for t in operands[:per_token]), *operands[per_token:], *tc, n)
                           for i in range(0, m, FUSED_MAX_M)])
    else:
        y = dense(*operands, n, **rowsum)
    return _with_bias(module, y, x)
