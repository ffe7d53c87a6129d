"""The W4A8 / W8A8 GEMM kernels against exact integer references.

GPU tests (marked gpu, skipped without CUDA): on random codes in the packed layout, the
kernels' INT32 accumulations equal an integer matmul bit for bit, and the fp16 outputs are
within 1e-3 (relative Frobenius norm) of the float64 product of those integers and the
scales, for the benchmark shapes and for odd shapes (K not a multiple of 128, N not a
multiple of 32, M = 1, 3, 17, 129). Outputs are poisoned before each run. CPU tests: the
tile plan and the argument validation, which must reject bad input before any launch.
"""

from __future__ import annotations

import functools
import shutil
from types import SimpleNamespace

import pytest
import torch

from qoqtool.packing.layout import pack_group_params, pack_w4, pack_w8, pad_rows, padded_rows
from qoqtool.quantizers.activations import quantize_per_token
from qoqtool.quantizers.formats import Int8ChannelWeight, ProgressiveWeight, UInt4Weight, padded_size
from qoqtool.runtime import cuda_ops
from qoqtool.runtime.intmath import int8_matmul

HAS_CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (the kernels run there)")]


def on_gpu(f):
    for mark in gpu:
        f = mark(f)
    return f


BENCH_SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (8192, 8192), (14336, 4096)]  # (N, K)
BENCH_M = [1, 16, 64, 256, 1024, 4096, 8192]
KINDS = ["per_group", "per_channel", "w8a8"]
REL_TOL = 1e-3


# -- random operands in the packed layout ---------------------------------------------------------
@functools.lru_cache(maxsize=32)  # ~150 MB each at most: every benchmark shape stays cached
def make_weight(kind: str, n: int, k: int, group: int, seed: int = 0):
    """(quantized weight [n, k] in its unpacked format, packed kernel operands, INT8 operand [n, Kp])."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randint(lo, hi, shape):  # hi inclusive; lo, hi tensors or ints
        u = torch.rand(shape, generator=g, device="cuda")
        return (lo + torch.floor(u * (torch.as_tensor(hi) - lo + 1))).to(torch.int16)

    np_ = padded_rows(n)
    if kind == "w8a8":
        codes = randint(-128, 127, (n, k)).to(torch.int8)
        codes = torch.nn.functional.pad(codes, (0, padded_size(k, 32) - k))
        scale = (torch.rand(n, generator=g, device="cuda") * 1e-2 + 1e-3).half()
        w = Int8ChannelWeight(codes, scale, k)
        ops = (pack_w8(pad_rows(codes, np_, 0)), pad_rows(scale, np_, 1.0))
        return w, ops, codes
    if kind == "per_channel":
        kp = padded_size(k, 32)
        zero = randint(0, 15, (n, 1))
        codes = randint(0, 15, (n, kp))
        codes[:, k:] = zero  # padded columns dequantize to zero
        scale = (torch.rand(n, 1, generator=g, device="cuda") * 1e-2 + 1e-3).half()
        w = UInt4Weight(codes.to(torch.uint8), scale, zero.to(torch.uint8), k, k)
        ops = (pack_w4(pad_rows(codes.to(torch.uint8), np_, 0)), pad_rows(scale[:, 0], np_, 1.0),
               pad_rows(zero[:, 0].to(torch.uint8), np_, 0))
        return w, ops, (codes - zero).to(torch.int8)
    # progressive: s1 in 1..16, z*s1 <= 128, codes only where (q - z)*s1 stays in [-128, 127]
    kp = padded_size(k, group)
    groups = kp // group
    s1 = randint(1, 16, (n, groups))
    z = randint(0, torch.clamp(128 // s1, max=15), (n, groups))
    lo, hi = (z - 128 // s1).clamp(min=0), (z + 127 // s1).clamp(max=15)
    expand = functools.partial(torch.repeat_interleave, repeats=group, dim=1)
    codes = randint(expand(lo), expand(hi), (n, kp))
    codes[:, k:] = expand(z)[:, k:]
    scale0 = (torch.rand(n, generator=g, device="cuda") * 1e-3 + 1e-4).half()
    u8 = functools.partial(torch.Tensor.to, dtype=torch.uint8)
    w = ProgressiveWeight(u8(codes), scale0, u8(s1), u8(z), group, k)
    ops = (pack_w4(pad_rows(u8(codes), np_, 0)), pad_rows(scale0, np_, 1.0),
           pack_group_params(pad_rows(u8(s1), np_, 1)), pack_group_params(pad_rows(u8(z * s1), np_, 0)))
    return w, ops, w.int8_operand()


def make_activations(m: int, k: int, kp: int, seed: int = 1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x_q = torch.randint(-127, 128, (m, kp), generator=g, device="cuda", dtype=torch.int8)
    x_q[:, k:] = 0  # padding past K, as the quantize kernel writes it
    x_scale = (torch.rand(m, generator=g, device="cuda") + 0.5).half()
    return x_q, x_scale, x_q.sum(1, dtype=torch.int32)


def operands(kind, packed, x_q, x_scale, x_rowsum):
    if kind == "per_channel":
        return (x_q, x_scale, x_rowsum, *packed)
    return (x_q, x_scale, *packed)


def check_gemm(kind: str, m: int, n: int, k: int, group: int = 128) -> None:
    w, packed, w8 = make_weight(kind, n, k, group)
    kp = w8.shape[1]
    x_q, x_scale, x_rowsum = make_activations(m, k, kp)
    args = operands(kind, packed, x_q, x_scale, x_rowsum)

    acc_ref = int8_matmul(x_q, w8)
    ref = acc_ref.double() * x_scale.double()[:, None] * w.row_scale().double()[None, :] if kind != "per_channel" \
        else acc_ref.double() * w.scale[:, 0].double()[None, :] * x_scale.double()[:, None]
    # per_group: also with the optional row sums (the wgmma kernel's UINT8 weights + 128 path)
    for extra in [{}] + ([{"x_rowsum": x_rowsum}] if kind == "per_group" else []):
        what = f"{kind}{' with x_rowsum' if extra else ''} M={m} N={n} K={k}"
        acc = torch.full((m, n), -(2**31) + 7, dtype=torch.int32, device="cuda")  # poison
        cuda_ops.run_gemm(kind, *args, out_features=n, out=acc, out_i32=True, **extra)
        mismatch = (acc != acc_ref).sum().item()
        assert mismatch == 0, f"{what}: {mismatch} INT32 accumulations differ"

        out = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")  # poison
        cuda_ops.run_gemm(kind, *args, out_features=n, out=out, **extra)
        assert not out.isnan().any(), f"{what}: an output was not written (or is NaN)"
        rel = ((out.double() - ref).norm() / ref.norm()).item()
        assert rel <= REL_TOL, f"{what}: relative error {rel:.2e}"


# -- GPU: exactness on the benchmark shapes and on odd ones --------------------------------------
@on_gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,k", BENCH_SHAPES)
@pytest.mark.parametrize("m", BENCH_M)
def test_benchmark_shapes_exact(kind, m, n, k):
    check_gemm(kind, m, n, k)


ODD_SHAPES = [  # (kind, N, K, group): K not a multiple of 128, N not a multiple of 32
    ("per_group", 1000, 600, 32),
    ("per_group", 576, 576, 64),
    ("per_group", 1000, 576, 128),  # K padded to 640
    ("per_channel", 576, 576, 0),
    ("per_channel", 1000, 1000, 0),  # K padded to 1024
    ("w8a8", 1000, 576, 0),
    ("w8a8", 192, 1536, 0),
]


@on_gpu
@pytest.mark.parametrize("kind,n,k,group", ODD_SHAPES)
@pytest.mark.parametrize("m", [1, 3, 17, 129])
def test_odd_shapes_exact(kind, n, k, group, m):
    check_gemm(kind, m, n, k, group or 128)


# The demo model's linears (SmolLM2-135M: q/o, k/v, gate/up, down) at the token counts of a
# prefill or an evaluation window, through whatever the plan picks for them (K = 576 is 4.5
# pipeline stages: the wgmma kernels' last stage is partial, and the K2 form's two warpgroups
# get three and two).
@on_gpu
@pytest.mark.parametrize("kind,group", [("per_group", 128), ("per_channel", 0)])
@pytest.mark.parametrize("n,k", [(576, 576), (192, 576), (1536, 576), (576, 1536)])
@pytest.mark.parametrize("m", [64, 256, 2048])
def test_demo_model_shapes_exact(kind, group, n, k, m):
    check_gemm(kind, m, n, k, group or 128)


# Every kernel instantiation and split count the plan can pick, on a shape that divides
# nothing evenly (M = 100 tokens, 23 k-tiles, 32 row tiles with a partial last one).
# The K2 form also at 5 splits of the 6 stages: splits of one stage leave its second
# warpgroup without work.
# The wgmma forms with 2 splits: their CTAs go out in pairs (clusters) and exchange partials
# through shared memory; with 3 or 5 through the workspace. The 192-row CTAs of three 64-row
# warpgroups leave the last one 2 of its 6 row tiles.
FORCED = [cuda_ops.Plan(cuda_ops.STREAM, nb, s) for nb in (1, 2, 4, 8) for s in (1, 3)] + [
    cuda_ops.Plan(cuda_ops.WGMMA, wgs, s) for wgs in (1, 2) for s in (1, 2, 3)
] + [cuda_ops.Plan(k2, 1, s) for k2 in (cuda_ops.WGMMA_K2, cuda_ops.WGMMA_K2_T64) for s in (1, 2, 3, 5)] + [
    cuda_ops.Plan(cuda_ops.WGMMA_M64, 3, s) for s in (1, 2, 3)] + [
    cuda_ops.Plan(wide, nb, s) for wide in (cuda_ops.STREAM_1X16, cuda_ops.STREAM_2X8) for nb in (1, 2) for s in (1, 3)]


# M = 17..32 on large W4 weights goes to the 64-token wgmma form (plan): exact there too, with
# the last token tile partial. (W8A8 keeps the stream kernel there: test_plan_covers_the_gpu.)
@on_gpu
@pytest.mark.parametrize("kind", ["per_group", "per_channel"])
@pytest.mark.parametrize("m", [17, 24, 32])
def test_small_batch_on_the_wgmma_kernel_exact(kind, m):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("wgmma needs a Hopper GPU")
    sms, hopper = cuda_ops._device_info(torch.cuda.current_device())
    assert cuda_ops.plan(m, 8192 // 32, 8192 // 32, sms, hopper).kernel == cuda_ops.WGMMA_K2_T64
    check_gemm(kind, m, 8192, 8192)


@on_gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("forced", FORCED, ids=lambda p: f"{cuda_ops.KERNEL_NAMES[p.kernel]}{p.tile}-split{p.splits}")
def test_every_configuration_exact(kind, forced, monkeypatch):
    if forced.kernel in cuda_ops.WGMMA_KERNELS and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("wgmma needs a Hopper GPU")
    monkeypatch.setattr(cuda_ops, "PLAN_OVERRIDE", forced)
    check_gemm(kind, 100, 1000, 736, 32)
    check_gemm(kind, 100, 998, 736, 32)  # N % 4 != 0: the epilogues' per-row stores instead of vector ones
    if forced.kernel in cuda_ops.WGMMA_KERNELS:
        check_gemm(kind, 256, 1000, 736, 32)  # whole token tiles: the wgmma epilogue's unchecked form
        check_gemm(kind, 100, 1000, 736, 128)  # one group a stage: parameter boxes of 32 bytes per row tile
        check_gemm(kind, 100, 1000, 640, 32)  # 5 stages: the one-pipeline forms' last step has no second stage


@pytest.fixture
def stage_activations():
    """cuda_ops.set_stage_activations for one test; the default (on) again after it."""
    yield cuda_ops.set_stage_activations
    cuda_ops.set_stage_activations(True)


@on_gpu
@pytest.mark.parametrize("group", [32, 64, 128, 256])
@pytest.mark.parametrize("m", [1, 16, 24])
@pytest.mark.parametrize("splits", [1, 3, 7])
@pytest.mark.parametrize("staged", [False, True], ids=["global", "staged"])
def test_stream_group_folds_exact(group, m, splits, staged, stage_activations, monkeypatch):
    """At M <= 16 the stream kernel folds progressive groups into its accumulators every
    min(group, 4 k-tiles, chunk) k-tiles and splits K on those units (M = 24 dequantizes per
    word instead): every group size and split count (7 on K = 1024 leaves some splits empty)
    must give the integer reference bit for bit, with the activations loaded from global
    memory or staged in shared memory."""
    stage_activations(staged)
    monkeypatch.setattr(cuda_ops, "PLAN_OVERRIDE", cuda_ops.Plan(cuda_ops.STREAM, cuda_ops.stream_tile(m), splits))
    check_gemm("per_group", m, 320, 1024, group)
    check_gemm("per_group", m, 96, 608, group)  # K padded to the group; a tail chunk in every warp


@pytest.fixture
def dependent_launch():
    """cuda_ops.set_dependent_launch for one test; the default (on) again after it."""
    yield cuda_ops.set_dependent_launch
    cuda_ops.set_dependent_launch(True)


@on_gpu
@pytest.mark.parametrize("enabled", [False, True])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("splits", [1, 3])
def test_dependent_launch_on_and_off_exact(enabled, kind, splits, dependent_launch, monkeypatch):
    """Programmatic dependent launch changes when a kernel starts, never its sums."""
    dependent_launch(enabled)
    for m in (1, 16):
        monkeypatch.setattr(cuda_ops, "PLAN_OVERRIDE", cuda_ops.Plan(cuda_ops.STREAM, cuda_ops.stream_tile(m), splits))
        check_gemm(kind, m, 1000, 736, 32)


@on_gpu
@pytest.mark.parametrize("splits", [1, 3])
def test_dependent_launches_keep_stream_order(splits, monkeypatch):
    """Back-to-back stream GEMMs launched as programmatic dependents (the second may start
    before the first ends) into the SAME output and split-K buffers, eagerly and replayed
    from a CUDA graph: the last write must win, and each must see the activations an
    ordinary kernel wrote just before it."""
    n, k = 4096, 4096
    _, first_w, _ = make_weight("per_group", n, k, 128, seed=0)
    _, second_w, _ = make_weight("per_group", n, k, 128, seed=1)
    x_q, x_scale, _ = make_activations(16, k, k)
    source, _, _ = make_activations(16, k, k, seed=5)
    monkeypatch.setattr(cuda_ops, "PLAN_OVERRIDE", cuda_ops.Plan(cuda_ops.STREAM, cuda_ops.stream_tile(16), splits))
    op = torch.ops.qoqtool.w4a8_gemm_per_group
    out = torch.empty(16, n, dtype=torch.float16, device="cuda")

    def chain():
        for _ in range(4):
            cuda_ops.run_gemm("per_group", x_q, x_scale, *first_w, out_features=n, out=out)
            cuda_ops.run_gemm("per_group", x_q, x_scale, *second_w, out_features=n, out=out)
        x_q.copy_(source)  # an ordinary kernel writes the activations the last GEMM reads
        cuda_ops.run_gemm("per_group", x_q, x_scale, *second_w, out_features=n, out=out)

    expected = op(source, x_scale, *second_w, n)
    original = x_q.clone()
    chain()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    x_q.copy_(original)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    x_q.copy_(original)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


@on_gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("nb", [1, 2, 4, 8])
@pytest.mark.parametrize("splits", [1, 3, 7])
@pytest.mark.parametrize("staged", [False, True], ids=["global", "staged"])
def test_stream_activation_paths_exact(kind, nb, splits, staged, stage_activations, monkeypatch):
    """Each chunk's activations copied into shared memory (cp.async, zero-filled past M and
    past the split; the default from M = 8) or loaded as B fragments from global memory: every
    token tile and split count gives the integer reference bit for bit, tokens past M and a
    partial last row tile included."""
    stage_activations(staged)
    monkeypatch.setattr(cuda_ops, "PLAN_OVERRIDE", cuda_ops.Plan(cuda_ops.STREAM, nb, splits))
    check_gemm(kind, 100, 1000, 736, 32)
    check_gemm(kind, max(8, 8 * nb - 3), 320, 4096, 128)


@on_gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("splits", [9, 23])
def test_stream_more_splits_than_the_epilogue_keeps_in_flight(kind, splits, monkeypatch):
    """The stream epilogue reads up to 8 other splits' partials at once and the rest one by
    one; a forced plan may split further (23: every k-tile its own split)."""
    monkeypatch.setattr(cuda_ops, "PLAN_OVERRIDE", cuda_ops.Plan(cuda_ops.STREAM, 2, splits))
    check_gemm(kind, 16, 998, 736, 32)


@on_gpu
@pytest.mark.parametrize("m,splits", [(1, 1), (16, 3)])
def test_trace_stamps_a_timeline_and_changes_nothing(m, splits, monkeypatch):
    """cuda_ops.set_trace: every CTA of a stream GEMM writes its timeline (stamps in order,
    its multiprocessor, whether it ran the epilogue: one CTA per output tile) and the INT32
    sums stay those of the reference."""
    monkeypatch.setattr(cuda_ops, "PLAN_OVERRIDE", cuda_ops.Plan(cuda_ops.STREAM, cuda_ops.stream_tile(m), splits))
    n, k = 320, 4096
    tiles = cuda_ops.PLAN_OVERRIDE.grid_tiles(m, n // 32)
    trace = torch.zeros(tiles * splits, cuda_ops.TRACE_WORDS, dtype=torch.int64, device="cuda")
    cuda_ops.set_trace(trace)
    try:
        check_gemm("per_group", m, n, k)
    finally:
        cuda_ops.set_trace(None)
    stamps = trace[:, :7].cpu()
    assert (stamps > 0).all(), "a CTA did not stamp"
    assert (stamps[:, 1:] >= stamps[:, :-1]).all(), "stamps out of order"
    assert int((trace[:, 7] >> 32).sum()) == tiles, "one epilogue per output tile"
    assert int((trace[:, 7] & 0xFFFFFFFF).max()) < torch.cuda.get_device_properties(0).multi_processor_count


def test_trace_buffer_is_checked_before_use():
    with pytest.raises(ValueError, match="CUDA int64"):
        cuda_ops.set_trace(torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="CUDA int64"):
        cuda_ops.set_trace("not a tensor")


@on_gpu
def test_use_library_runs_the_ops_on_another_build_and_back(tmp_path):
    """cuda_ops.use_library (benchmarks/library_ab.py) sends the ops to the library at a path
    - here a copy of this checkout's build, a separate load - with the same results, and None
    returns to the built one."""
    from qoqtool.kernels import build

    copy = tmp_path / "copy.so"
    shutil.copyfile(build.build(), copy)
    n, k = 512, 1024
    _, packed, _ = make_weight("per_group", n, k, 128)
    x_q, x_scale, _ = make_activations(16, k, k)
    op = torch.ops.qoqtool.w4a8_gemm_per_group
    built = op(x_q, x_scale, *packed, n)
    try:
        cuda_ops.use_library(copy)
        assert cuda_ops._lib() is not cuda_ops._load(None)
        assert torch.equal(op(x_q, x_scale, *packed, n), built)
    finally:
        cuda_ops.use_library(None)
    assert cuda_ops._lib() is cuda_ops._load(None)


@on_gpu
def test_split_k_counters_reset_under_cuda_graph():
    """A split-K GEMM captured in a CUDA graph gives the right answer on every replay (the
    counters are reset by the kernel itself), for new inputs copied into the static ones."""
    n, k = 2048, 4096  # (at 4096 x 4096 the plan runs unsplit 16-warp CTAs)
    w, packed, w8 = make_weight("per_group", n, k, 128)
    x_q, x_scale, _ = make_activations(1, k, k)
    assert cuda_ops.plan(1, n // 32, k // 32, *cuda_ops._device_info(0)).splits > 1
    op = torch.ops.qoqtool.w4a8_gemm_per_group
    replay_with_new_inputs(lambda: op(x_q, x_scale, *packed, n), x_q, x_scale, k)


def replay_with_new_inputs(call, x_q, x_scale, k, eager=None):
    """Captures call() in a CUDA graph (after one eager warm-up call, whose output it returns),
    then, for three new activation sets copied into x_q / x_scale, checks that each replay
    equals eager() (default: call() itself, run eagerly) on the same inputs."""
    first = call()  # warm up (library, counters) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = call()
    for seed in (2, 3, 4):
        new_q, new_s, _ = make_activations(x_q.shape[0], k, x_q.shape[1], seed)
        x_q.copy_(new_q)
        x_scale.copy_(new_s)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, (eager or call)())
    assert not torch.equal(static_out, first)  # the replays did see the new inputs
    return static_out


# -- GPU: the packed linear's forward pass -----------------------------------------------------------
def packed_module(kind: str, n: int, k: int, group: int, bias: bool):
    w, packed, _ = make_weight(kind, n, k, group)
    names = {"per_group": ("qweight", "scale0", "scale1", "zero_x_scale1"), "per_channel": ("qweight", "scale", "zero"),
             "w8a8": ("qweight", "scale")}[kind]
    fmt = {"per_group": "progressive", "per_channel": "uint4", "w8a8": "int8_channel"}[kind]
    module = SimpleNamespace(kind=fmt, act_bits=8, in_features=k, out_features=n, n_padded=padded_rows(n),
                             k_padded=packed[0].shape[1] * 32, group_size=group if kind == "per_group" else None,
                             bias=torch.randn(n, device="cuda") if bias else None, **dict(zip(names, packed)))
    return w, module


@on_gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_packed_linear_forward_matches_reference(kind, dtype):
    n, k = 1000, 576
    w, module = packed_module(kind, n, k, 64, bias=True)
    x = torch.randn(2, 5, k, device="cuda", dtype=dtype)
    y = cuda_ops.packed_linear_forward(module, x)
    assert y.dtype == dtype and y.shape == (2, 5, n)
    x16 = x.reshape(-1, k).half()
    codes, scales = quantize_per_token(x16)
    ref = w.linear_int8(codes, scales) + module.bias.float()
    rel = ((y.reshape(-1, n).double() - ref.double()).norm() / ref.double().norm()).item()
    assert rel <= (REL_TOL if dtype != torch.bfloat16 else 5e-3), f"relative error {rel:.2e}"  # bf16 output rounding


@on_gpu
@pytest.mark.parametrize("kind", KINDS)
def test_packed_linear_module_dispatches_to_the_kernels(kind):
    """qoqtool.runtime.packed_linear.PackedLinear on CUDA runs these kernels (not its fallback)
    and agrees with its own exact reference path."""
    packed_linear = pytest.importorskip("qoqtool.runtime.packed_linear")
    w, _, _ = make_weight(kind, 1000, 576, 64)
    module = packed_linear.PackedLinear.pack(w, None, 8).cuda()
    x = torch.randn(3, 576, device="cuda", dtype=torch.float16)
    y = module(x)
    assert packed_linear._kernels() is cuda_ops and module.use_kernels, "the kernel path did not run"
    ref = module.reference()(x)
    rel = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
    assert rel <= REL_TOL, f"relative error {rel:.2e}"


@on_gpu
def test_shared_input_quantization_follows_in_place_changes():
    """q/k/v share one quantization of their input, but never a stale one."""
    _, module = packed_module("per_group", 576, 576, 64, bias=False)
    x = torch.randn(4, 576, device="cuda", dtype=torch.float16)
    first = cuda_ops.packed_linear_forward(module, x)
    assert torch.equal(cuda_ops.packed_linear_forward(module, x), first)  # a cache hit, same answer
    x.mul_(2)  # bumps the version counter
    again = cuda_ops.packed_linear_forward(module, x)
    cuda_ops.clear_quantization_cache()
    assert torch.equal(again, cuda_ops.packed_linear_forward(module, x))
    assert not torch.equal(again, first)


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t whose data starts one byte past a 16-byte boundary."""
    buf = torch.empty(t.numel() * t.element_size() + 16, dtype=torch.uint8, device=t.device)
    view = buf[1 : 1 + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    return view.copy_(t)


@on_gpu
def test_bad_input_is_refused_before_launch():
    w, packed, _ = make_weight("per_group", 1000, 600, 32)
    x_q, x_scale, _ = make_activations(3, 600, 608)
    op = torch.ops.qoqtool.w4a8_gemm_per_group
    bad = {
        "non-contiguous x_q": ((torch.zeros(608, 3, dtype=torch.int8, device="cuda").t(), x_scale, *packed, 1000), "contiguous"),
        "x_q on the CPU": ((x_q.cpu(), x_scale, *packed, 1000), "device"),
        "qweight of the wrong dtype": ((x_q, x_scale, packed[0].to(torch.int8), *packed[1:], 1000), "uint8"),
        "K of x and W differ": ((x_q[:, :576].contiguous(), x_scale, *packed, 1000), "shape"),
        "x_scale fp32": ((x_q, x_scale.float(), *packed, 1000), "float16"),
        "too many outputs": ((x_q, x_scale, *packed, 1025), "out_features"),
        "misaligned qweight": ((x_q, x_scale, misaligned(packed[0]), *packed[1:], 1000), "aligned"),
    }
    for what, (args, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            op(*args)
    rowsum = x_q.sum(1, dtype=torch.int32)
    for bad_rowsum, message in [(rowsum.float(), "x_rowsum must be int32"), (rowsum[:2], "x_rowsum must have shape"),
                                (rowsum.cpu(), "device")]:
        with pytest.raises(ValueError, match=message):
            op(x_q, x_scale, *packed, 1000, x_rowsum=bad_rowsum)
    torch.cuda.synchronize()  # nothing was launched, so nothing can have faulted
    op(x_q, x_scale, *packed, 1000)
    op(x_q, x_scale, *packed, 1000, x_rowsum=rowsum)


# -- CPU: the plan and the validation -----------------------------------------------------------------
@pytest.mark.parametrize("n,k", BENCH_SHAPES + [(576, 576), (192, 576), (1000, 256), (32, 32)])
@pytest.mark.parametrize("m", [1, 3, 16, 17, 32, 33, 64, 256, 1024, 8192])
def test_plan_covers_the_gpu(m, n, k):
    sms = 132
    p = cuda_ops.plan(m, n // 32, k // 32, sms, hopper=True)
    ctas = p.grid_tiles(m, n // 32) * p.splits
    assert 1 <= p.splits <= cuda_ops.MAX_SPLITS and p.splits <= k // 32
    stream_kernels = (cuda_ops.STREAM, cuda_ops.STREAM_1X16, cuda_ops.STREAM_2X8)
    if m <= 16 or (m <= 32 and n * k // 2 < cuda_ops._WGMMA_NB4_MIN_BYTES):
        assert p.kernel in stream_kernels and 8 * p.tile >= m
    else:  # (M = 17..32 on large weights: the 64-token wgmma form)
        assert p.kernel in cuda_ops.WGMMA_KERNELS
    if n * k >= 4096 * 4096:
        assert ctas >= sms / 2  # enough CTAs to keep every multiprocessor busy
    assert cuda_ops.plan(m, n // 32, k // 32, sms, hopper=False).kernel in stream_kernels  # sm_80: mma.sync only
    if m <= 32:  # W8 weights: the stream kernel up to M = 32 on Hopper too
        assert cuda_ops.plan(m, n // 32, k // 32, sms, hopper=True, weight_bits=8).kernel in stream_kernels
    assert cuda_ops.plan(m, n // 32, k // 32, sms, hopper=False, wide=False).kernel == cuda_ops.STREAM


# The fastest configuration measured on the H200 for these cases (benchmarks/notes-gemm.md:
# the stream rows from version 9's --stage-ab (splits) and --explore-wide (16-warp CTAs), the
# wgmma rows from version 18's --explore-wgmma (M = 24..512, with the 64-token K2 form) and
# version 17's (M = 512 on 8192^2, M = 1024), which timed every warpgroup x split choice, and
# version 27's for the 192-row form (benchmarks/results/gemm-v27-h200/m64-explore*.txt)): the
# plan must keep picking it. (Not pinned: version 17's cases where the plan takes a choice up to
# 1.09x slower; M = 1024 on 14336 x 4096 is one, two row warpgroups and the K2 form within 0.1%
# there.)
MEASURED_BEST = [  # (M, N, K, kernel, tile, splits)
    (1, 4096, 4096, cuda_ops.STREAM_1X16, 1, 1),
    (16, 4096, 4096, cuda_ops.STREAM_1X16, 2, 1),
    (1, 8192, 8192, cuda_ops.STREAM_2X8, 1, 1),
    (16, 8192, 8192, cuda_ops.STREAM_2X8, 2, 1),
    (8, 4096, 14336, cuda_ops.STREAM_1X16, 1, 1),
    (16, 14336, 4096, cuda_ops.STREAM, 2, 1),
    (1, 11008, 4096, cuda_ops.STREAM, 1, 1),   # two splits (1.3 waves) took 1.27-1.46x as long at M = 1..16
    (16, 11008, 4096, cuda_ops.STREAM, 2, 1),
    (32, 8192, 8192, cuda_ops.WGMMA_K2_T64, 1, 2),
    (32, 4096, 4096, cuda_ops.STREAM, 4, 4),
    (24, 4096, 4096, cuda_ops.STREAM, 4, 4),
    (24, 14336, 4096, cuda_ops.WGMMA_K2_T64, 1, 1),
    (32, 4096, 14336, cuda_ops.WGMMA_K2_T64, 1, 4),
    (24, 5120, 5120, cuda_ops.WGMMA_K2_T64, 1, 3),
    (64, 4096, 4096, cuda_ops.WGMMA_K2_T64, 1, 4),
    (128, 4096, 4096, cuda_ops.WGMMA_K2_T64, 1, 2),
    (256, 4096, 4096, cuda_ops.WGMMA_K2, 1, 2),
    (512, 4096, 4096, cuda_ops.WGMMA_K2, 1, 1),
    (64, 8192, 8192, cuda_ops.WGMMA_K2_T64, 1, 2),
    (256, 8192, 8192, cuda_ops.WGMMA_K2, 1, 1),
    (512, 8192, 8192, cuda_ops.WGMMA, 2, 1),
    (64, 14336, 4096, cuda_ops.WGMMA_K2_T64, 1, 1),
    (256, 14336, 4096, cuda_ops.WGMMA, 2, 1),
    (64, 4096, 11008, cuda_ops.WGMMA_K2_T64, 1, 4),
    (128, 4096, 11008, cuda_ops.WGMMA_K2, 1, 4),
    (256, 4096, 11008, cuda_ops.WGMMA_K2, 1, 2),
    (64, 11008, 4096, cuda_ops.WGMMA_K2_T64, 1, 1),
    (128, 11008, 4096, cuda_ops.WGMMA_K2, 1, 1),
    (256, 11008, 4096, cuda_ops.WGMMA_M64, 3, 1),  # 116 CTAs of 192 rows: 1.10x (g128) / 1.14x the 86 of 256 rows (2026-12-04)
    (1024, 4096, 11008, cuda_ops.WGMMA, 2, 1),
    (384, 8192, 8192, cuda_ops.WGMMA_M64, 3, 1),
    (384, 4096, 11008, cuda_ops.WGMMA_M64, 3, 2),
    (768, 4096, 14336, cuda_ops.WGMMA_M64, 3, 1),
    (512, 5120, 5120, cuda_ops.WGMMA_M64, 3, 1),
]


@pytest.mark.parametrize("m,n,k,kernel,tile,splits", MEASURED_BEST)
def test_plan_picks_the_measured_best(m, n, k, kernel, tile, splits):
    assert cuda_ops.plan(m, n // 32, k // 32, 132, hopper=True) == cuda_ops.Plan(kernel, tile, splits)


@pytest.mark.parametrize("bad", [
    cuda_ops.Plan(cuda_ops.STREAM, 3, 1),   # NB 3
    cuda_ops.Plan(cuda_ops.STREAM, 1, 0),   # no split
    cuda_ops.Plan(cuda_ops.STREAM, 1, 24),  # more splits than k-tiles
    cuda_ops.Plan(7, 1, 1),                 # no such kernel
    cuda_ops.Plan(cuda_ops.WGMMA_K2_T64, 2, 1),  # the K2 form has one 128-row tile
    cuda_ops.Plan(cuda_ops.WGMMA_K2, 2, 1), # the K2 form has one 128-row tile
    cuda_ops.Plan(cuda_ops.STREAM_1X16, 4, 1),  # 16-warp stream CTAs exist for NB = 1, 2 only
    cuda_ops.Plan(cuda_ops.WGMMA, 3, 1),    # three warpgroups
    cuda_ops.Plan(cuda_ops.WGMMA, 1, 7),    # wgmma splits whole 4-k-tile stages
], ids=lambda p: f"kernel{p.kernel}-tile{p.tile}-splits{p.splits}")
def test_check_plan_refuses_what_no_kernel_runs(bad):
    with pytest.raises(ValueError):
        cuda_ops.check_plan(bad, 23)
    cuda_ops.check_plan(cuda_ops.Plan(cuda_ops.STREAM, 8, 23), 23)  # the same checks pass valid plans
    cuda_ops.check_plan(cuda_ops.Plan(cuda_ops.WGMMA, 2, 6), 23)


def test_plans_parse_from_their_command_line_form():
    for kernel, name in cuda_ops.KERNEL_NAMES.items():
        assert cuda_ops.Plan.parse(f"{name}:2:3") == cuda_ops.Plan(kernel, 2, 3)
    for bad in ("wgmma_m64:3", "wgmma_m64:3:1:1", "no_such_kernel:1:1", "wgmma:two:1", ""):
        with pytest.raises(ValueError, match="KERNEL:TILE:SPLITS"):
            cuda_ops.Plan.parse(bad)


def test_validation_rejects_bad_operands_on_the_cpu():
    x_q = torch.zeros(3, 64, dtype=torch.int8)
    x_scale = torch.zeros(3, dtype=torch.float16)
    qweight = torch.zeros(1, 2, 32, 16, dtype=torch.uint8)
    scale0 = torch.zeros(32, dtype=torch.float16)
    params = torch.zeros(1, 1, 32, dtype=torch.uint8)
    cases = [
        ((x_q.float(), x_scale, qweight, scale0, params, params, 32), "x_q must be int8"),
        ((x_q[:, :48].contiguous(), x_scale, qweight, scale0, params, params, 32), "multiple of 32"),
        ((x_q, x_scale[:2], qweight, scale0, params, params, 32), "x_scale must have shape"),
        ((x_q, x_scale, qweight[:, :1], scale0, params, params, 32), "qweight must have shape"),
        ((x_q, x_scale, qweight, scale0[:16], params, params, 32), "scale0 must have shape"),
        ((x_q, x_scale, qweight, scale0, params.repeat(1, 3, 1), params.repeat(1, 3, 1), 32), "group size"),
        ((x_q, x_scale, qweight, scale0, params, params, 33), "out_features"),
        ((x_q, x_scale, qweight, scale0, params, params, 32), "CUDA"),  # all valid but on the CPU
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            cuda_ops.w4a8_gemm_per_group(*args)
    with pytest.raises(ValueError, match="x_rowsum"):
        cuda_ops.w4a8_gemm_per_channel(x_q, x_scale, x_scale, qweight, scale0, scale0.to(torch.uint8), 32)
    with pytest.raises(ValueError, match="qweight must be int8"):
        cuda_ops.w8a8_gemm(x_q, x_scale, qweight, scale0, 32)


def test_formats_without_a_kernel_are_declined():
    module = SimpleNamespace(kind="progressive", act_bits=16, group_size=128)
    with pytest.raises(NotImplementedError):
        cuda_ops.packed_linear_forward(module, torch.zeros(1, 128))
    module = SimpleNamespace(kind="uint4", act_bits=8, group_size=128)
    with pytest.raises(NotImplementedError):
        cuda_ops.packed_linear_forward(module, torch.zeros(1, 128))
    # (the decode loop's fused quantization asks the same question before it quantizes)
    assert cuda_ops.int8_kernel_declines(module) == "no kernel for UINT4 weights with float group scales"
    assert cuda_ops.int8_kernel_declines(SimpleNamespace(kind="uint4", act_bits=8, group_size=None)) is None
