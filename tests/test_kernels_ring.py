"""The ring kernel (kernels/stream_ring.cuh): the small-M GEMM whose weights arrive by bulk
copies into a shared-memory ring per warp.

GPU tests (marked gpu; the kernel needs a Hopper GPU): for every weight kind, ring shape,
token count M in 1, 3, 8, 16, 17, 32, K not a multiple of 128, N not a multiple of 32, and
every split count the plan can produce, the INT32 accumulations equal an integer matmul
bit for bit and the fp16 outputs equal the stream kernel's bit for bit (both kernels share
the epilogue, so any difference is a main-loop bug). Long K wraps each warp's ring several
times (the barrier phases alternate); outputs are poisoned before every run. CPU tests: the
plan's ring choice and the plan validation.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_kernels_gemm import BENCH_SHAPES, make_activations, make_weight, on_gpu, operands, replay_with_new_inputs

from qoqtool.runtime import cuda_ops
from qoqtool.runtime.cuda_ops import RING, RING_NB, RING_SHAPES, STREAM, Plan, ring_nb_shape, ring_tile
from qoqtool.runtime.intmath import int8_matmul

KINDS = ["per_group", "per_channel", "w8a8"]
SHAPES = range(len(RING_SHAPES))


def hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def needs_hopper():
    if not hopper():
        pytest.skip("the ring kernel runs on Hopper (sm_90a) only; elsewhere cuda_ops runs the stream kernel")


@contextlib.contextmanager
def forced(p: Plan):
    old, cuda_ops.PLAN_OVERRIDE = cuda_ops.PLAN_OVERRIDE, p
    try:
        yield
    finally:
        cuda_ops.PLAN_OVERRIDE = old


def nb_for(m: int) -> int:
    return 1 if m <= 8 else 2 if m <= 16 else 4


def check_ring(kind: str, m: int, n: int, k: int, group: int, p: Plan) -> None:
    """INT32 sums of plan p (a ring plan) == integer reference; fp16 == the stream kernel's."""
    assert p.kernel == RING
    _, packed, w8 = make_weight(kind, n, k, group)
    x_q, x_scale, x_rowsum = make_activations(m, k, w8.shape[1])
    args = operands(kind, packed, x_q, x_scale, x_rowsum)
    what = f"{kind} M={m} N={n} K={k} {p.name()}"

    acc = torch.full((m, n), -(2**31) + 7, dtype=torch.int32, device="cuda")  # poison
    with forced(p):
        cuda_ops.run_gemm(kind, *args, out_features=n, out=acc, out_i32=True)
    mismatch = (acc != int8_matmul(x_q, w8)).sum().item()
    assert mismatch == 0, f"{what}: {mismatch} INT32 accumulations differ"

    ring, stream = (torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda") for _ in range(2))
    with forced(p):
        cuda_ops.run_gemm(kind, *args, out_features=n, out=ring)
    with forced(Plan(STREAM, ring_nb_shape(p.tile)[0], p.splits)):
        cuda_ops.run_gemm(kind, *args, out_features=n, out=stream)
    assert not ring.isnan().any(), f"{what}: an output was not written"
    assert torch.equal(ring, stream), f"{what}: fp16 outputs differ from the stream kernel's"


# Odd shapes per kind (N, K, group): K not a multiple of 128 (the packed K pads to the group),
# N not a multiple of 32; groups of 32 and 64 make chunks straddle groups.
ODD = {
    "per_group": [(1000, 736, 32), (1000, 600, 64), (1000, 1000, 128)],
    "per_channel": [(1000, 1000, 0), (576, 576, 0)],
    "w8a8": [(1000, 576, 0), (192, 1536, 0)],
}
ODD_CASES = [(kind, *shape) for kind, shapes in ODD.items() for shape in shapes]


@on_gpu
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 8, 16, 17, 32])
@pytest.mark.parametrize("kind,n,k,group", ODD_CASES, ids=lambda v: str(v))
def test_ring_exact_on_odd_shapes(kind, n, k, group, m, shape):
    needs_hopper()
    check_ring(kind, m, n, k, group or 128, Plan(RING, ring_tile(nb_for(m), shape), 1))


@on_gpu
@pytest.mark.parametrize("splits", range(1, cuda_ops.MAX_SPLITS + 1))  # every count plan_ring can pick
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
def test_ring_exact_for_every_split(kind, shape, splits):
    """23 k-tiles in up to 8 splits: splits start anywhere in a chunk and in a group of 32,
    many warps get no chunk, and most chunks are tails."""
    needs_hopper()
    check_ring(kind, 17, 1000, 736, 32, Plan(RING, ring_tile(4, shape), splits))


@on_gpu
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
def test_ring_exact_when_the_ring_wraps(kind, shape, splits):
    """K = 14000 (438-440 k-tiles): every warp reuses each slot several times, so the slot
    barriers go through both parities; 3 row tiles leave the 2-row-tile shape a half CTA."""
    needs_hopper()
    for nb in RING_NB:
        check_ring(kind, 5, 96, 14000, 128, Plan(RING, ring_tile(nb, shape), splits))


@on_gpu
@pytest.mark.parametrize("m", [1, 16, 32])
@pytest.mark.parametrize("n,k", [s for s in BENCH_SHAPES if s != (11008, 4096)] + [(4096, 14336)])
@pytest.mark.parametrize("kind", KINDS)
def test_ring_exact_on_benchmark_shapes(kind, n, k, m):
    """The plan's own ring choice (shape RING_SHAPE, its split count) on the benchmark shapes."""
    needs_hopper()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    check_ring(kind, m, n, k, 128, cuda_ops.plan(m, n // 32, k // 32, sms, hopper=True, ring=True))


@on_gpu
def test_ring_split_k_under_cuda_graph():
    """A split ring GEMM captured in a CUDA graph is right on every replay (the split-K
    counters reset themselves; the mbarriers are initialised per launch)."""
    needs_hopper()
    n, k = 4096, 4096
    _, packed, _ = make_weight("per_group", n, k, 128)
    x_q, x_scale, _ = make_activations(1, k, k)
    op = torch.ops.qoqtool.w4a8_gemm_per_group

    def stream():
        with forced(Plan(STREAM, 1, 1)):
            return op(x_q, x_scale, *packed, n)

    with forced(Plan(RING, ring_tile(1, 0), 3)):
        replay_with_new_inputs(lambda: op(x_q, x_scale, *packed, n), x_q, x_scale, k, eager=stream)


# -- CPU: the plan ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n,k", BENCH_SHAPES + [(4096, 14336), (576, 576), (32, 32)])
@pytest.mark.parametrize("m", [1, 3, 8, 16, 17, 32])
def test_ring_plan(m, n, k):
    sms = 132
    p = cuda_ops.plan(m, n // 32, k // 32, sms, hopper=True, ring=True)
    nb, shape = ring_nb_shape(p.tile)
    assert p.kernel == RING and shape == cuda_ops.RING_SHAPE and nb in RING_NB and 8 * nb >= m
    cuda_ops.check_plan(p, k // 32)
    _, wk, u, _ = RING_SHAPES[shape]
    assert p.splits == 1 or (k // 32) // p.splits >= wk * u  # a split gives every warp a full chunk
    if p.splits > 1:
        assert Plan(RING, p.tile, p.splits - 1).grid_tiles(m, n // 32) * (p.splits - 1) < sms  # split only to fill
    if n * k >= 4096 * 4096:
        assert p.grid_tiles(m, n // 32) * p.splits >= 0.9 * sms  # every multiprocessor has a CTA
    # Elsewhere the ring is not planned: without Hopper, without the switch, or past 32 tokens.
    assert cuda_ops.plan(m, n // 32, k // 32, sms, hopper=False, ring=True).kernel == STREAM
    assert cuda_ops.plan(m, n // 32, k // 32, sms, hopper=True, ring=False).kernel == STREAM
    assert cuda_ops.plan(33, n // 32, k // 32, sms, hopper=True, ring=True).kernel == cuda_ops.WGMMA


def test_ring_switch_follows_use_ring(monkeypatch):
    monkeypatch.setattr(cuda_ops, "USE_RING", True)
    assert cuda_ops.plan(1, 256, 256, 132, hopper=True).kernel == RING
    monkeypatch.setattr(cuda_ops, "USE_RING", False)
    assert cuda_ops.plan(1, 256, 256, 132, hopper=True).kernel == STREAM


def test_ring_tile_encodes_nb_and_shape():
    tiles = {ring_tile(nb, s) for nb in RING_NB for s in SHAPES}
    assert len(tiles) == len(RING_NB) * len(RING_SHAPES)
    assert all(ring_nb_shape(ring_tile(nb, s)) == (nb, s) for nb in RING_NB for s in SHAPES)


@pytest.mark.parametrize("bad", [
    Plan(RING, 3, 1),                              # NB 3
    Plan(RING, ring_tile(8, 0), 1),                # NB 8: the ring serves at most 32 tokens per CTA
    Plan(RING, ring_tile(1, len(RING_SHAPES)), 1),  # no such shape
    Plan(RING, ring_tile(1, 0), 0),                # no split
    Plan(RING, ring_tile(1, 0), 24),               # more splits than k-tiles
    Plan(3, 1, 1),                                 # no such kernel
    Plan(cuda_ops.WGMMA, 1, 7),                    # wgmma splits whole 4-k-tile stages
], ids=lambda p: f"kernel{p.kernel}-tile{p.tile}-splits{p.splits}")
def test_check_plan_refuses_what_no_kernel_runs(bad):
    with pytest.raises(ValueError):
        cuda_ops.check_plan(bad, 23)
    cuda_ops.check_plan(Plan(RING, ring_tile(4, 4), 23), 23)  # the same checks pass a valid plan
