"""The W4A16 GEMM (fp16 activations x UINT4 weights with fp16 group scales) and its fused
sparse-dense variant (kernels/w4a16_gemm.cu).

GPU tests (marked gpu, skipped without CUDA): outputs within 1e-3 (relative Frobenius norm) of
the float64 reference x . ((q - z) * s)^T (+ x . S^T with outliers), for group 32 / 64 / 128,
M in {1, 3, 8, 16, 17, 33, 64}, N and K that divide no tile, split-K off and on, outputs
poisoned first; the packed linear on CUDA against its reference path, with and without
outliers, at M under and over W4A16_MAX_M. CPU tests: the argument checks, which must refuse
bad operands before any launch.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_kernels_gemm import on_gpu
from test_sparse_dense_gpu import random_outliers, stream_plan

from qoqtool.packing import tile_coo
from qoqtool.packing.layout import pack_group_params, pack_w4, pad_rows, padded_rows
from qoqtool.quantizers.formats import UInt4Weight, padded_size
from qoqtool.runtime import cuda_ops

REL_TOL = 1e-3
N, K = 1000, 600  # 31 full row tiles + 8 rows; K padded to the group


@contextlib.contextmanager
def forced(p: cuda_ops.Plan):
    """cuda_ops.PLAN_OVERRIDE = p inside the block."""
    old, cuda_ops.PLAN_OVERRIDE = cuda_ops.PLAN_OVERRIDE, p
    try:
        yield
    finally:
        cuda_ops.PLAN_OVERRIDE = old


def make_w4a16(n: int, k: int, group: int, device: str = "cuda", seed: int = 0):
    """(UInt4Weight with fp16 group scales, packed operands (qweight, scale, zero))."""
    g = torch.Generator(device=device).manual_seed(seed)
    kp = padded_size(k, group)
    groups = kp // group
    codes = torch.randint(0, 16, (n, kp), generator=g, device=device, dtype=torch.uint8)
    zero = torch.randint(0, 16, (n, groups), generator=g, device=device, dtype=torch.uint8)
    scale = (torch.rand(n, groups, generator=g, device=device) * 2e-2 + 1e-3).half()
    w = UInt4Weight(codes, scale, zero, group, k)
    np_ = padded_rows(n)
    packed = (pack_w4(pad_rows(codes, np_, 0)), pack_group_params(pad_rows(scale, np_, 1.0)),
              pack_group_params(pad_rows(zero, np_, 0)))
    return w, packed


def make_x(m: int, k: int, kp: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, kp, generator=g, device="cuda").half()
    x[:, k:] = 0  # padding past K, as the packed linear writes it
    return x


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@on_gpu
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 3, 8, 16, 17, 33, 64])
@pytest.mark.parametrize("splits", [1, 3])
def test_w4a16_matches_the_float_reference(group, m, splits):
    w, packed = make_w4a16(N, K, group)
    x = make_x(m, K, w.codes.shape[1])
    ref = x[:, :K].double() @ w.dequantize().double().t()
    out = torch.full((m, N), float("nan"), dtype=torch.float16, device="cuda")  # poisoned
    with forced(stream_plan(m, splits)):
        cuda_ops.run_w4a16_gemm(x, *packed, N, out=out)
    assert torch.isfinite(out).all(), "some outputs were not written"
    assert rel_err(out, ref) <= REL_TOL


@on_gpu
@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("m", [1, 8, 16, 33])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("density", [0.01, 0.05])
def test_w4a16_sparse_dense_matches_dense_plus_sparse(group, m, splits, density):
    w, packed = make_w4a16(N, K, group)
    kp = w.codes.shape[1]
    sparse = random_outliers(N, K, density, seed=7, full_bucket=True)
    tc = tile_coo.encode(sparse, kp)
    x = make_x(m, K, kp)
    dense = x[:, :K].double() @ w.dequantize().double().t()
    extra = x[:, :K].double() @ sparse.to_dense().cuda().double().t()
    assert extra.norm() > 10 * REL_TOL * (dense + extra).norm(), "the sparse term is too small to be checked"
    out = torch.full((m, N), float("nan"), dtype=torch.float16, device="cuda")
    with forced(stream_plan(m, splits)):
        cuda_ops.run_w4a16_gemm(x, *packed, N, tc=tuple(t.cuda() for t in (tc.entries, tc.start, tc.count)), out=out)
    assert torch.isfinite(out).all()
    assert rel_err(out, dense + extra) <= REL_TOL


@on_gpu
@pytest.mark.parametrize("outliers", [False, True])
def test_packed_w4a16_linear_on_cuda_matches_its_reference(outliers):
    from qoqtool.runtime import packed_linear

    w, _ = make_w4a16(N, K, 128, device="cpu")
    sparse = random_outliers(N, K, 0.01, seed=3) if outliers else None
    bias = torch.randn(N).half()
    module = packed_linear.PackedLinear.pack(w, bias, 16, outliers=sparse).cuda()
    for m in (5, cuda_ops.W4A16_MAX_M, cuda_ops.W4A16_MAX_M + 1):  # kernel, kernel, reference path
        x = torch.randn(m, K, device="cuda", generator=torch.Generator("cuda").manual_seed(m)).half()
        with torch.no_grad():
            y, ref = module(x), module.reference()(x)
        assert module.use_kernels, "the kernel path was given up"
        assert rel_err(y, ref.double()) <= REL_TOL, f"M={m}"


def test_w4a16_bad_operands_are_refused_before_launch():
    w, packed = make_w4a16(64, 256, 128, device="cpu")
    x = torch.zeros(2, 256, dtype=torch.float16)
    qweight, scale, zero = packed
    cases = {
        "fp32 activations": ((x.float(), qweight, scale, zero), "x must be float16"),
        "K not padded": ((x[:, :250].contiguous(), qweight, scale, zero), "multiple of 32|K padded"),
        "non-contiguous x": ((torch.zeros(256, 2, dtype=torch.float16).t(), qweight, scale, zero), "contiguous"),
        "scale of another K": ((x, qweight, scale[:, :1].contiguous(), zero), "zero must have shape"),
        "odd group size": ((torch.zeros(2, 96, dtype=torch.float16), qweight[:, :3].contiguous(), scale, zero),
                           "zero must have shape|group size"),
        "int8 zero": ((x, qweight, scale, zero.to(torch.int8)), "zero must be uint8"),
        "CPU tensors": ((x, qweight, scale, zero), "CUDA"),
    }
    for what, (args, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            cuda_ops.run_w4a16_gemm(*args, 64)
