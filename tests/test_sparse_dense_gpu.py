"""The fused sparse-dense W4A8 GEMM (dense INT4 + Tile-COO outliers in one stream kernel).

GPU tests (marked gpu, skipped without CUDA): the fused output is within 1e-3 (relative
Frobenius norm) of the float64 dense reference plus the float64 sparse reference
sx[m] * sum_k S[n, k] xq[m, k], for progressive g64 / g128 and per-channel UINT4 weights,
M in {1, 5, 8, 16, 33, 64}, shapes that divide no tile evenly, outlier densities 0 / 1 / 5 %,
split-K forced off and on (3 splits, so that buckets straddle splits), a bucket with every
slot filled and many empty buckets, every CTA shape (8 warps; 1 x 16 and 2 x 8 warps) with the
activations staged in shared memory or not. Every check whose outliers are not empty first asserts
that the sparse term is large enough for the check to fail without it. On failure the
message names the first mismatching (m, n) and whether the sparse term there looks
missing, doubled or otherwise wrong. CPU tests: the argument checks, which must refuse bad
sections and shapes before any launch, and which linears the packed forward pass fuses.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
from test_kernels_gemm import make_activations, make_weight, misaligned, on_gpu

from qoqtool.packing import tile_coo
from qoqtool.quantizers.outliers import SparseOutliers
from qoqtool.runtime import cuda_ops



REL_TOL = 1e-3
KINDS = [("per_group", 64), ("per_group", 128), ("per_channel", 0)]  # (kind, group size)
N, K = 1000, 600  # 31 full row tiles + 8 rows; Kp = 640 (g64, g128: 20 k-tiles) or 608 (per channel: 19)


# -- operands ---------------------------------------------------------------------------------------
def random_outliers(n: int, k: int, density: float, seed: int, full_bucket: bool = False,
                    empty_every_other: bool = False) -> SparseOutliers:
    """Unit-scale fp16 residuals at random positions (natural columns < K, never padding).
    full_bucket: every slot of bucket (1, 1) as well (rows 32..63, columns 64..127).
    empty_every_other: no outlier in odd row tiles or odd 64-column blocks (empty buckets)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(n, k, generator=g) < density
    if empty_every_other:
        mask[(torch.arange(n) // 32) % 2 == 1] = False
        mask[:, (torch.arange(k) // 64) % 2 == 1] = False
    if full_bucket:
        mask[32:64, 64:128] = True
    return SparseOutliers.from_mask(mask, torch.randn(n, k, generator=g))


@functools.lru_cache(maxsize=64)
def section(kind: str, group: int, n: int, k: int, density: float, seed: int = 5, **pattern):
    """(outliers scaled so the sparse term is ~half the dense one, their Tile-COO section on CUDA,
    the dense operands); the scale is a power of two, so the fp16 values stay exact."""
    w, packed, w8 = make_weight(kind, n, k, group or 128)
    kp = w8.shape[1]
    sparse = random_outliers(n, k, density, seed, **pattern)
    if sparse.nnz:
        x_q, x_scale, _ = make_activations(8, k, kp, seed=9)
        dense = (x_q.double() @ w8.double().t()).norm() * dense_scale(kind, w).double().mean()
        unit = (x_q[:, :k].double() @ sparse.to_dense().cuda().double().t()).norm()
        scale = 2.0 ** torch.round(torch.log2(0.5 * dense / unit)).item()
        sparse = SparseOutliers(sparse.rows, sparse.cols, (sparse.values.float() * scale).half(), sparse.shape)
    tc = tile_coo.encode(sparse, kp)
    return w, packed, w8, sparse, tuple(t.cuda() for t in (tc.entries, tc.start, tc.count))


def dense_scale(kind: str, w) -> torch.Tensor:
    """The weight's scale per output channel ([N]), as the epilogue applies it."""
    return w.scale[:, 0] if kind == "per_channel" else w.row_scale()


def operands(kind, packed, x_q, x_scale, x_rowsum):
    return (x_q, x_scale, x_rowsum, *packed) if kind == "per_channel" else (x_q, x_scale, *packed)


def references(kind, w, w8, sparse, x_q, x_scale):
    """(dense, sparse) float64 references [M, N]: sx * sw * (xq . w8) and sx * (xq . S^T)."""
    sx = x_scale.double()[:, None]
    dense = (x_q.double() @ w8.double().t()) * dense_scale(kind, w).double()[None, :] * sx
    s = sparse.to_dense().cuda().double()
    return dense, (x_q[:, : s.shape[1]].double() @ s.t()) * sx


def diagnose(out: torch.Tensor, dense: torch.Tensor, sparse: torch.Tensor) -> str:
    """Where and how the fused output goes wrong: the first bad (m, n) and what it looks like."""
    ref = dense + sparse
    tol = 8e-3 * ref.pow(2).mean().sqrt() + 1e-3 * ref.abs()  # well above fp16 rounding
    bad = ((out.double() - ref).abs() > tol) | ~torch.isfinite(out)
    if not bad.any():
        return "no single output is far off (the error is spread thin)"
    m, n = (int(i) for i in bad.nonzero()[0])
    got, d, s = out[m, n].item(), dense[m, n].item(), sparse[m, n].item()
    if abs(got - d) <= 1e-2 * abs(s):
        verdict = "the sparse term is missing there"
    elif abs(got - d - 2 * s) <= 1e-2 * abs(s):
        verdict = "the sparse term is added twice there"
    else:
        verdict = f"out - dense = {got - d:.5g}, sparse reference {s:.5g}"
    rows, tokens = bad.nonzero()[:, 1], bad.nonzero()[:, 0]
    return (f"{int(bad.sum())} of {bad.numel()} outputs off; first at (m={m}, n={n}): fused {got:.5g}, dense "
            f"{d:.5g} + sparse {s:.5g}; {verdict}; row tiles {sorted(set((rows // 32).tolist()))[:12]}, "
            f"tokens {sorted(set(tokens.tolist()))[:12]}")


def run_fused(kind, packed, tc, x_q, x_scale, x_rowsum, n) -> torch.Tensor:
    out = torch.full((x_q.shape[0], n), float("nan"), dtype=torch.float16, device="cuda")  # poison
    cuda_ops.run_sparse_dense_gemm(kind, *operands(kind, packed, x_q, x_scale, x_rowsum), tc=tc, out_features=n, out=out)
    return out


def stream_plan(m: int, splits: int, shape: int = cuda_ops.STREAM) -> cuda_ops.Plan:
    return cuda_ops.Plan(shape, cuda_ops.stream_tile(m), splits)


def check_fused(kind, group, m, n, k, density, splits, monkeypatch, shape=cuda_ops.STREAM, **pattern) -> None:
    w, packed, w8, sparse, tc = section(kind, group, n, k, density, **pattern)
    x_q, x_scale, x_rowsum = make_activations(m, k, w8.shape[1], seed=m)
    if splits is not None:
        monkeypatch.setattr(cuda_ops, "PLAN_OVERRIDE", stream_plan(m, splits, shape))
    out = run_fused(kind, packed, tc, x_q, x_scale, x_rowsum, n)
    dense, sp = references(kind, w, w8, sparse, x_q, x_scale)
    what = (f"{kind} g{group} M={m} N={n} K={k} density={density} {cuda_ops.KERNEL_NAMES[shape]} splits={splits} "
            f"nnz={sparse.nnz}")
    assert not out.isnan().any(), f"{what}: an output was not written (or is NaN); {diagnose(out, dense, sp)}"
    ref = dense + sp
    if sparse.nnz:
        assert sp.norm() >= 0.1 * ref.norm(), f"{what}: the sparse term is too small for this check to fail"
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel <= REL_TOL, f"{what}: relative error {rel:.2e}; {diagnose(out, dense, sp)}"


# -- GPU: agreement with the references ----------------------------------------------------------------
@on_gpu
@pytest.mark.parametrize("kind,group", KINDS, ids=lambda v: str(v))
@pytest.mark.parametrize("m", [1, 5, 8, 16, 33, 64])
@pytest.mark.parametrize("density", [0.0, 0.01, 0.05])
@pytest.mark.parametrize("splits", [1, 3])
def test_fused_matches_dense_plus_sparse(kind, group, m, density, splits, monkeypatch):
    check_fused(kind, group, m, N, K, density, splits, monkeypatch)


@on_gpu
@pytest.mark.parametrize("kind,group", KINDS, ids=lambda v: str(v))
@pytest.mark.parametrize("m", [1, 16, 33])
@pytest.mark.parametrize("splits", [None, 1, 5])  # None: the plan's own choice
def test_several_chunks_per_warp(kind, group, m, splits, monkeypatch):
    """K = 3000 (Kp 3008 or 3072): every k-slice warp walks several chunks, each with its buckets."""
    check_fused(kind, group, m, 200, 3000, 0.01, splits, monkeypatch)


@on_gpu
@pytest.mark.parametrize("kind,group", KINDS, ids=lambda v: str(v))
@pytest.mark.parametrize("m", [3, 16, 40])
@pytest.mark.parametrize("splits", [1, 3, 11])
def test_rows_not_a_multiple_of_four(kind, group, m, splits, monkeypatch):
    """N = 998: the epilogue's last vector of rows is partial (per-row stores); 11 splits:
    more than the epilogue reads at once."""
    check_fused(kind, group, m, 998, K, 0.01, splits, monkeypatch)


@on_gpu
@pytest.mark.parametrize("kind,group", KINDS, ids=lambda v: str(v))
@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("splits", [1, 3])
def test_full_and_empty_buckets(kind, group, m, splits, monkeypatch):
    """A bucket with all 2048 slots filled (512 entries) among many empty buckets."""
    check_fused(kind, group, m, N, K, 0.02, splits, monkeypatch, full_bucket=True, empty_every_other=True)


@pytest.fixture
def fused_staging():
    """Sets where the fused kernel stages its activations (cuda_ops.set_fused_staging) for one
    test, and puts the default back after it."""
    yield cuda_ops.set_fused_staging
    cuda_ops.set_fused_staging()


@on_gpu
@pytest.mark.parametrize("kind,group", KINDS, ids=lambda v: str(v))
@pytest.mark.parametrize("shape", [cuda_ops.STREAM, cuda_ops.STREAM_1X16, cuda_ops.STREAM_2X8],
                         ids=lambda v: cuda_ops.KERNEL_NAMES[v])
@pytest.mark.parametrize("m", [1, 8, 13, 16])
@pytest.mark.parametrize("staged", [False, True], ids=["unstaged", "staged"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("pattern", ["1%", "full-and-empty"])
def test_every_cta_shape_and_staging(kind, group, shape, m, staged, splits, pattern, monkeypatch, fused_staging):
    """Every CTA shape of the fused kernel (8 warps; 1 x 16 and 2 x 8 warps, NB = 1 and 2),
    with the activations staged in shared memory (from M = 8) or not. K = 3000: the warps walk
    one or two chunks (16 warps: the second round leaves some warps idle; with 3 splits, some
    warps get nothing); N = 1000: a partial row tile and CTA."""
    fused_staging(cuda_ops.FUSED_STAGE_ALWAYS if staged else cuda_ops.FUSED_STAGE_NEVER)
    extra = {"full_bucket": True, "empty_every_other": True} if pattern == "full-and-empty" else {}
    check_fused(kind, group, m, N, 3000, 0.01, splits, monkeypatch, shape=shape, **extra)


@on_gpu
@pytest.mark.parametrize("kind,group", KINDS, ids=lambda v: str(v))
@pytest.mark.parametrize("m", [1, 16, 64])
def test_no_outliers_is_the_dense_kernel_bit_for_bit(kind, group, m):
    """An empty section adds exactly nothing: the fused output equals the dense kernel's."""
    _, packed, w8, sparse, tc = section(kind, group, N, K, 0.0)
    assert sparse.nnz == 0 and tc[0].shape[0] == 0
    x_q, x_scale, x_rowsum = make_activations(m, K, w8.shape[1], seed=m)
    args = operands(kind, packed, x_q, x_scale, x_rowsum)
    fused = run_fused(kind, packed, tc, x_q, x_scale, x_rowsum, N)
    dense = cuda_ops.run_gemm(kind, *args, out_features=N)
    assert torch.equal(fused, dense), f"{int((fused != dense).sum())} outputs differ from the dense kernel's"


@on_gpu
def test_custom_ops_and_cuda_graph(monkeypatch):
    """The registered ops run the fused kernel, and a split-K launch replays correctly in a
    CUDA graph (its counters reset themselves; the fp32 partials are re-made each replay)."""
    kind, group, m = "per_group", 128, 1
    w, packed, w8, sparse, tc = section(kind, group, 4096, 4096, 0.01)
    monkeypatch.setattr(cuda_ops, "PLAN_OVERRIDE", stream_plan(m, 4))  # (the plan itself takes unsplit 1 x 16 CTAs)
    x_q, x_scale, _ = make_activations(m, 4096, 4096)
    op = torch.ops.qoqtool.w4a8_sparse_dense_gemm_per_group
    op(x_q, x_scale, *packed, *tc, 4096)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = op(x_q, x_scale, *packed, *tc, 4096)
    for seed in (2, 3):
        new_q, new_s, _ = make_activations(m, 4096, 4096, seed)
        x_q.copy_(new_q)
        x_scale.copy_(new_s)
        graph.replay()
        dense, sp = references(kind, w, w8, sparse, x_q, x_scale)
        rel = ((static_out.double() - dense - sp).norm() / (dense + sp).norm()).item()
        assert rel <= REL_TOL, f"replay {seed}: relative error {rel:.2e}; {diagnose(static_out, dense, sp)}"


@on_gpu
@pytest.mark.parametrize("kind,group", KINDS, ids=lambda v: str(v))
def test_packed_linear_uses_the_fused_kernel_up_to_fused_max_m(kind, group, monkeypatch):
    """PackedLinear with outliers on CUDA: fused (no separate sparse product) for M <=
    cuda_ops.FUSED_MAX_M, the separate product above; both agree with its exact reference path."""
    from qoqtool.runtime import packed_linear

    monkeypatch.setattr(cuda_ops, "FUSED_OUTLIERS", True)  # the default (QOQTOOL_FUSED_OUTLIERS=0 turns it off)
    w, _, w8, sparse, _ = section(kind, group, N, K, 0.01)
    module = packed_linear.PackedLinear.pack(w, None, 8, outliers=sparse).cuda()
    stopgap_calls = []
    original = packed_linear.PackedLinear._sparse_term
    monkeypatch.setattr(packed_linear.PackedLinear, "_sparse_term",
                        lambda self, ops, x, *rest: stopgap_calls.append(x.shape) or original(self, ops, x, *rest))
    top = cuda_ops.FUSED_MAX_M
    for m, fused in ((7, True), (top, True), (top + 1, False)):
        x = torch.randn(m, K, device="cuda", dtype=torch.float16, generator=torch.Generator("cuda").manual_seed(m))
        stopgap_calls.clear()
        packed_linear.path_calls.clear()
        with torch.no_grad():
            y, ref = module(x), module.reference()(x)
        assert module.use_kernels and packed_linear._kernels() is cuda_ops, "the kernel path did not run"
        assert (not stopgap_calls) == fused, f"M={m}: expected the {'fused kernel' if fused else 'stopgap'}"
        path = "fused sparse-dense kernel" if fused else "kernel + separate sparse product"
        assert packed_linear.path_calls == {path: 1}, f"M={m}: eval would report {dict(packed_linear.path_calls)}"
        rel = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
        assert rel <= REL_TOL, f"M={m}: relative error {rel:.2e} against the reference path"


@on_gpu
@pytest.mark.parametrize("kind,group", KINDS, ids=lambda v: str(v))
def test_sliced_fused_kernel_above_fused_max_m(kind, group, monkeypatch):
    """QOQTOOL_FUSED_SLICED: an input of more than FUSED_MAX_M tokens (and not a multiple of it)
    goes through the fused kernel slice by slice - no separate sparse product - and agrees with
    the exact reference path; each slice's rows equal the fused kernel on those rows alone."""
    from qoqtool.runtime import packed_linear

    monkeypatch.setattr(cuda_ops, "FUSED_OUTLIERS", True)
    monkeypatch.setattr(cuda_ops, "FUSED_SLICED", True)
    w, _, w8, sparse, _ = section(kind, group, N, K, 0.01)
    module = packed_linear.PackedLinear.pack(w, None, 8, outliers=sparse).cuda()
    monkeypatch.setattr(packed_linear.PackedLinear, "_sparse_term", lambda *a: pytest.fail("the separate product ran"))
    top = cuda_ops.FUSED_MAX_M
    x = torch.randn(2 * top + 5, K, device="cuda", dtype=torch.float16, generator=torch.Generator("cuda").manual_seed(3))
    packed_linear.path_calls.clear()
    with torch.no_grad():
        y, ref = module(x), module.reference()(x)
        last = module(x[2 * top:])  # the third slice on its own (M = 5)
    assert packed_linear._kernels() is cuda_ops, "the kernels are unavailable"
    assert packed_linear.path_calls == {"fused sparse-dense kernel": 2}, packed_linear.path_calls
    rel = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
    assert rel <= REL_TOL, f"relative error {rel:.2e} against the reference path"
    assert torch.equal(y[2 * top:], last), "a slice differs from the same rows run alone"


@on_gpu
def test_bad_sections_on_the_gpu_are_refused_before_launch():
    _, packed, w8, _, tc = section("per_group", 64, N, K, 0.01)
    x_q, x_scale, _ = make_activations(3, K, w8.shape[1])
    op = torch.ops.qoqtool.w4a8_sparse_dense_gemm_per_group
    bad = {
        "misaligned entries": ((misaligned(tc[0]), *tc[1:]), "aligned"),
        "entries on the CPU": ((tc[0].cpu(), *tc[1:]), "device"),
        "start of another K": ((tc[0], tc[1][:, :-1].contiguous(), tc[2]), "tc_start must have shape"),
    }
    for what, (section_args, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            op(x_q, x_scale, *packed, *section_args, N)
    with pytest.raises(ValueError, match="stream kernel only"):
        cuda_ops.PLAN_OVERRIDE = cuda_ops.Plan(cuda_ops.WGMMA, 1, 1)
        try:
            op(x_q, x_scale, *packed, *tc, N)
        finally:
            cuda_ops.PLAN_OVERRIDE = None
    torch.cuda.synchronize()  # nothing was launched, so nothing can have faulted
    op(x_q, x_scale, *packed, *tc, N)


# -- CPU: the checks and the dispatch rule ---------------------------------------------------------------
def test_kernel_buckets_are_the_packing_modules():
    assert cuda_ops.TILE_COO_BUCKET == (tile_coo.BUCKET_N, tile_coo.BUCKET_K)
    assert cuda_ops.TILE_COO_ENTRY_BYTES == tile_coo.ENTRY_BYTES


def test_bad_sections_and_shapes_are_refused_on_the_cpu():
    x_q = torch.zeros(3, 96, dtype=torch.int8)  # Kp = 96: 3 k-tiles, 2 buckets along K
    x_scale = torch.zeros(3, dtype=torch.float16)
    qweight = torch.zeros(2, 3, 32, 16, dtype=torch.uint8)  # 2 row tiles
    scale0 = torch.zeros(64, dtype=torch.float16)
    params = torch.zeros(2, 3, 32, dtype=torch.uint8)
    dense = (x_q, x_scale, qweight, scale0, params, params)
    entries = torch.zeros(5, 16, dtype=torch.uint8)
    buckets = torch.zeros(2, 2, dtype=torch.int32)
    cases = [
        ((entries.to(torch.int8), buckets, buckets), "tc_entries must be uint8"),
        ((entries[:, :8].contiguous(), buckets, buckets), r"tc_entries must have shape \[\*, 16\]"),
        ((entries, buckets[:, :1].contiguous(), buckets), r"tc_start must have shape \[2, 2\]"),
        ((entries, buckets, torch.zeros(3, 2, dtype=torch.int32)), r"tc_count must have shape \[2, 2\]"),
        ((entries, buckets.long(), buckets), "tc_start must be int32"),
        ((entries, buckets, buckets.t()), "tc_count must be contiguous"),
        ((entries, buckets, buckets), "CUDA"),  # all valid but on the CPU
    ]
    for section_args, message in cases:
        with pytest.raises(ValueError, match=message):
            cuda_ops.w4a8_sparse_dense_gemm_per_group(*dense, *section_args, 64)
    with pytest.raises(ValueError, match="qweight must have shape"):  # the dense operands are checked too
        cuda_ops.w4a8_sparse_dense_gemm_per_group(x_q, x_scale, qweight[:, :2], *dense[3:], entries, buckets, buckets, 64)
    with pytest.raises(ValueError, match="x_rowsum"):
        cuda_ops.w4a8_sparse_dense_gemm_per_channel(x_q, x_scale, x_scale, qweight, scale0, scale0.to(torch.uint8),
                                                    entries, buckets, buckets, 64)
    with pytest.raises(ValueError, match="per_group and per_channel"):
        cuda_ops.run_sparse_dense_gemm("w8a8", *dense[:4], tc=(entries, buckets, buckets), out_features=64)


def test_which_linears_fuse_their_outliers(monkeypatch):
    monkeypatch.setattr(cuda_ops, "FUSED_OUTLIERS", False)  # QOQTOOL_FUSED_OUTLIERS=0
    assert not cuda_ops.fuses_outliers(SimpleNamespace(kind="progressive", group_size=128, act_bits=8, has_outliers=True), 1)
    monkeypatch.setattr(cuda_ops, "FUSED_OUTLIERS", True)

    def module(kind="progressive", group_size=128, act_bits=8, has_outliers=True):
        return SimpleNamespace(kind=kind, group_size=group_size, act_bits=act_bits, has_outliers=has_outliers)

    assert cuda_ops.fuses_outliers(module(), 1) and cuda_ops.fuses_outliers(module(), cuda_ops.FUSED_MAX_M)
    assert cuda_ops.fuses_outliers(module("uint4", None), 16)
    assert not cuda_ops.fuses_outliers(module(), cuda_ops.FUSED_MAX_M + 1)  # the wgmma kernel: stopgap
    # ... and what eval reports for each call (cuda_ops.kernel_path)
    assert cuda_ops.kernel_path(module(), 1) == "fused sparse-dense kernel"
    assert cuda_ops.kernel_path(module(), cuda_ops.FUSED_MAX_M + 1) == "kernel + separate sparse product"
    assert cuda_ops.kernel_path(module(has_outliers=False), 1) == "kernel"
    assert cuda_ops.kernel_path(module("uint4", 128, act_bits=16), cuda_ops.W4A16_MAX_M + 1) == "reference path (W4A16 prefill)"
    monkeypatch.setattr(cuda_ops, "FUSED_SLICED", True)  # QOQTOOL_FUSED_SLICED=1: W4A8 fused at every M
    assert cuda_ops.fuses_outliers(module(), 4096) and cuda_ops.fuses_outliers(module("uint4", None), 4096)
    assert not cuda_ops.fuses_outliers(module("int8_channel", None), 4096)
    monkeypatch.setattr(cuda_ops, "FUSED_SLICED", False)
    assert not cuda_ops.fuses_outliers(module("int8_channel", None), 1)  # W8A8: stopgap
    assert not cuda_ops.fuses_outliers(module("uint4", 128), 1)  # no W4A8 kernel at all
    assert not cuda_ops.fuses_outliers(module(act_bits=16), 1)
    assert not cuda_ops.fuses_outliers(module(has_outliers=False), 1)
