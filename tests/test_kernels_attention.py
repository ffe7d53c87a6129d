"""The paged KV cache kernels on a GPU against the torch reference of the same layout.

Append: the bytes the kernel writes equal, bit for bit, those of `reference_append` (which
stores quantize_kv's codes, scales and zeros). Decode: within 1e-3 relative of fp32
attention over the dequantized cache, ragged lengths, every split and group size, every
output written. Bad input: a Python error before any launch. Generation: the paged cache on
the GPU against the CPU reference path.
"""

from __future__ import annotations

import math

import pytest
import torch

from qoqtool.runtime.kv_cache import KVCacheLayout, reference_append, reference_decode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the KV cache kernels)"),
]

FORMATS = [(bits, d) for bits in (4, 8, 16) for d in (64, 128)]


@pytest.fixture(scope="module")
def ops():
    from qoqtool.runtime import attention_ops, kernel_library

    if not kernel_library.available():
        pytest.skip("the kernel library could not be built or loaded")
    return attention_ops


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def make_cache(ops, layout: KVCacheLayout, lengths: list[int], seed: int = 0, dtype=torch.float16, spare_pages=3,
               v_scale: float = 1.0):
    """Sequences of random K/V (V times v_scale) appended by the kernel on shuffled pages; also
    returns the torch-reference pool built from the same data."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [math.ceil(n / layout.page_size) for n in lengths]
    order = torch.randperm(sum(per_seq) + spare_pages, generator=gen).tolist()
    num_pages = len(order)
    pool = torch.zeros(num_pages, layout.page_bytes, dtype=torch.uint8, device="cuda")
    ref_pool = torch.zeros(num_pages, layout.page_bytes, dtype=torch.uint8)
    table = torch.zeros(len(lengths), max(per_seq), dtype=torch.int32)
    for b, n in enumerate(lengths):
        pages = [order.pop() for _ in range(per_seq[b])]
        table[b, :len(pages)] = torch.tensor(pages)
        shape = (n, layout.num_kv_heads, layout.head_dim)
        k = (torch.randn(shape, generator=gen) * 2 + 0.5).to(dtype)
        v = (torch.randn(shape, generator=gen) * v_scale).to(dtype)
        slots = torch.tensor([pages[p // layout.page_size] * layout.page_size + p % layout.page_size
                              for p in range(n)], dtype=torch.int32)
        # k as a strided view (token stride != heads * dim): the kernel takes strides
        k_dev = k.transpose(0, 1).contiguous().cuda().transpose(0, 1)
        ops.kv_append(pool, layout, k_dev, v.cuda(), slots.cuda())
        reference_append(ref_pool, layout, k, v, slots)
    return pool, ref_pool, table.cuda(), torch.tensor(lengths, dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("bits, head_dim", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_append_is_bit_exact(ops, bits, head_dim, dtype):
    layout = KVCacheLayout(bits, head_dim, num_kv_heads=3, page_size=32)
    pool, ref_pool, _, _ = make_cache(ops, layout, [77, 1, 64, 31], dtype=dtype)
    torch.cuda.synchronize()
    mismatch = (pool.cpu() != ref_pool).nonzero()
    assert mismatch.numel() == 0, f"{len(mismatch)} bytes differ, first at page/byte {mismatch[0].tolist()}"


def decode_checked(ops, q, pool, layout, table, lens, **kwargs):
    """kv_decode with the output poisoned first: the op's output reuses the NaN block just freed."""
    torch.full_like(q, float("nan"))  # allocated and freed: the caching allocator hands it back next
    out = ops.kv_decode(q, pool, layout, table, lens, **kwargs)
    assert not out.isnan().any(), "some outputs were never written"
    return out


@pytest.mark.parametrize("bits, head_dim", FORMATS)
@pytest.mark.parametrize("q_heads, kv_heads", [(4, 4), (6, 2), (9, 3), (32, 4), (16, 1)])
def test_decode_matches_fp32_attention_over_the_cache(ops, bits, head_dim, q_heads, kv_heads):
    layout = KVCacheLayout(bits, head_dim, kv_heads, page_size=64)
    lengths = [1, 16, 64, 130, 1000, 517]  # ragged: one token, block and page edges, long
    pool, _, table, lens = make_cache(ops, layout, lengths, seed=q_heads)
    q = torch.randn(len(lengths), q_heads, head_dim, device="cuda").half()
    ref = reference_decode(q, pool, layout, table, lens)
    for splits in (None, 1, 3):  # planned, none, and forced flash-decoding splits
        kwargs = {}
        if splits is not None:
            per_split = math.ceil(math.ceil(max(lengths) / 16) / splits)  # odd: a split ends mid-step
            kwargs = dict(num_splits=math.ceil(math.ceil(max(lengths) / 16) / per_split), blocks_per_split=per_split)
        for step_blocks in (1, 2):  # both tilings of the kernel
            out = decode_checked(ops, q, pool, layout, table, lens, step_blocks=step_blocks, **kwargs)
            assert rel_err(out, ref) < 1e-3, f"splits={splits}, step_blocks={step_blocks}"


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("v_scale", [2.0**-12, 2.0**10], ids=["tiny-v", "large-v"])
def test_decode_precision_does_not_depend_on_the_magnitude_of_v(ops, bits, v_scale):
    """The kernel multiplies the V codes by P * (V scale) in fp16; a power of two keeps that
    product clear of fp16's subnormals for tiny V (scales ~1e-4) and of overflow for large V."""
    layout = KVCacheLayout(bits, 128, 2, page_size=64)
    pool, _, table, lens = make_cache(ops, layout, [700, 64, 3], dtype=torch.float32, v_scale=v_scale)
    q = torch.randn(3, 8, 128, device="cuda").half()
    ref = reference_decode(q, pool, layout, table, lens)
    for splits in (None, 1):
        kwargs = {} if splits is None else dict(num_splits=1, blocks_per_split=64)
        assert rel_err(decode_checked(ops, q, pool, layout, table, lens, **kwargs), ref) < 1e-3, f"splits={splits}"


def test_decode_peaky_softmax_and_scale(ops):
    layout = KVCacheLayout(4, 128, 2, page_size=16)
    pool, _, table, lens = make_cache(ops, layout, [300, 45])
    q = (torch.randn(2, 8, 128, device="cuda") * 8).half()  # scores of tens: the max moves, rescaling matters
    for scale in (None, 0.3):
        ref = reference_decode(q, pool, layout, table, lens, scale=scale)
        assert rel_err(decode_checked(ops, q, pool, layout, table, lens, scale=scale), ref) < 1e-3


def test_append_then_decode_through_paged_cache_object(ops):
    from qoqtool.runtime.kv_cache import PagedKVCache

    layout = KVCacheLayout(4, 64, 3, page_size=16)
    cache = PagedKVCache(layout, num_layers=2, num_pages=32, device="cuda")
    assert cache.use_kernels
    seqs = [cache.add_sequence() for _ in range(3)]
    plan = cache.plan(seqs, [40, 5, 17])
    k = torch.randn(62, 3, 64, device="cuda").half()
    v = torch.randn(62, 3, 64, device="cuda").half()
    cache.append(1, k, v, plan)
    for step in range(20):  # decode steps, one token each, pages allocated as they fill
        plan = cache.plan(seqs, [1, 1, 1])
        cache.append(1, torch.randn(3, 3, 64, device="cuda").half(), torch.randn(3, 3, 64, device="cuda").half(), plan)
    q = torch.randn(3, 9, 64, device="cuda").half()
    out = cache.attend(1, q, plan, scale=0.125)
    ref = reference_decode(q, cache.pool[1], layout, plan.page_table, plan.context_lens, scale=0.125)
    assert rel_err(out, ref) < 1e-3
    assert cache.lengths == {0: 60, 1: 25, 2: 37}


def test_decode_and_append_capture_in_a_cuda_graph(ops):
    layout = KVCacheLayout(4, 128, 8, page_size=64)
    pool, _, table, lens = make_cache(ops, layout, [500, 200])
    q = torch.randn(2, 32, 128, device="cuda").half()
    k = torch.randn(2, 8, 128, device="cuda").half()
    # the last slot of each sequence's last page: past its length, so decode does not read it
    last = [int(table[0, 7]), int(table[1, 3])]
    slots = torch.tensor([p * 64 + 63 for p in last], dtype=torch.int32, device="cuda")
    splits, per_split = 3, 11  # flash-decoding: combined in the launch through tickets
    args = dict(max_context_len=500, num_splits=splits, blocks_per_split=per_split, validate=False)
    eager = ops.kv_decode(q, pool, layout, table, lens, **args)  # also the warm-up
    torch.cuda.synchronize()
    before = pool.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.kv_append(pool, layout, k, k, slots, validate=False)
        out = ops.kv_decode(q, pool, layout, table, lens, **args)
    for _ in range(3):  # each launch must leave the tickets at 0 for the next one
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    assert not torch.equal(pool, before)  # the captured append did write


# ---- bad input: Python errors, never a launch ---------------------------------------------------
@pytest.fixture
def small(ops):
    layout = KVCacheLayout(4, 64, 2, page_size=16)
    pool, _, table, lens = make_cache(ops, layout, [20, 9])
    q = torch.randn(2, 4, 64, device="cuda").half()
    return layout, pool, table, lens, q


def test_page_table_pointing_past_the_cache_is_refused(ops, small):
    layout, pool, table, lens, q = small
    bad = table.clone()
    bad[0, 1] = pool.shape[0]
    with pytest.raises(ValueError, match="points outside the KV cache"):
        ops.kv_decode(q, pool, layout, bad, lens)


def test_context_longer_than_its_pages_is_refused(ops, small):
    layout, pool, table, lens, q = small
    with pytest.raises(ValueError, match="context length 33"):
        ops.kv_decode(q, pool, layout, table, torch.tensor([33, 9], dtype=torch.int32, device="cuda"))


def test_unsupported_head_dim_and_mismatched_shapes_are_refused(ops, small):
    layout, pool, table, lens, q = small
    with pytest.raises(ValueError, match="head_dim 64 and 128"):
        KVCacheLayout(4, 96, 2)
    with pytest.raises(ValueError, match="q has head_dim 128"):
        ops.kv_decode(torch.zeros(2, 4, 128, device="cuda", dtype=torch.float16), pool, layout, table, lens)
    with pytest.raises(ValueError, match="fp16"):
        ops.kv_decode(q.float(), pool, layout, table, lens)
    with pytest.raises(ValueError, match="need a multiple"):
        ops.kv_decode(q[:, :3].contiguous(), pool, layout, table, lens)
    with pytest.raises(ValueError, match="at most 4096"):  # the in-launch combine's limit
        ops.kv_decode(q, pool, layout, table, lens, num_splits=2049, blocks_per_split=1)
    with pytest.raises(ValueError, match="bytes per page"):
        ops.kv_decode(q, pool[:, :-16].contiguous(), layout, table, lens)
    with pytest.raises(ValueError, match="slot 9999"):
        ops.kv_append(pool, layout, torch.zeros(1, 2, 64, device="cuda"), torch.zeros(1, 2, 64, device="cuda"),
                      torch.tensor([9999], dtype=torch.int32, device="cuda"))


def test_memcheck_case(ops):
    """Small, every path once (also run under compute-sanitizer by benchmarks/gpu_attention_run.sh):
    append, decode with and without splits, and unvalidated out-of-range pages and slots,
    which the kernels must survive without touching memory outside the cache."""
    layout = KVCacheLayout(4, 128, 2, page_size=16)
    pool, _, table, lens = make_cache(ops, layout, [70, 3], spare_pages=0)
    q = torch.randn(2, 6, 128, device="cuda").half()
    ops.kv_decode(q, pool, layout, table, lens)
    ops.kv_decode(q, pool, layout, table, lens, num_splits=3, blocks_per_split=2)
    bad = table.clone()
    bad[0, 2] = 1 << 20
    ops.kv_decode(q, pool, layout, bad, lens, max_context_len=70, validate=False)
    ops.kv_append(pool, layout, torch.zeros(2, 2, 128, device="cuda"), torch.zeros(2, 2, 128, device="cuda"),
                  torch.tensor([-5, 1 << 30], dtype=torch.int32, device="cuda"), validate=False)
    torch.cuda.synchronize()


# ---- generation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("key_rotation", [False, True], ids=["plain", "key-rotation"])
def test_generation_on_gpu_agrees_with_the_cpu_reference(ops, key_rotation):
    from qoqtool.models.adapter import ModelAdapter
    from qoqtool.runtime.attention import enable_key_rotation, enable_kv_quantization
    from qoqtool.runtime.generate import explain, generate_paged, generate_reference
    from test_kv_cache import tiny_decoder  # tests/ is on sys.path under pytest

    model = tiny_decoder("llama")
    if key_rotation:  # the -keyrot recipes: the paged cache must store rotated keys, as the reference does
        enable_key_rotation(model, ModelAdapter(model).head_dim, seed=2)
    enable_kv_quantization(model, 4)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 23, 12, 40, 7)]
    reference = generate_reference(model, prompts, 24, keep_logits=True)
    model.cuda()
    kernels = generate_paged(model, prompts, 24, page_size=16, keep_logits=True)
    torch_path = generate_paged(model, prompts, 24, page_size=16, keep_logits=True, use_kernels=False)
    scale = max(float(r.abs().max()) for r in reference.logits)
    for row in explain(reference, kernels):  # greedy tokens part only at near-ties of the reference
        assert row["diverges_at"] is None or row["rounding"], row
    # Against the cache's fp32 torch path on the same GPU (the same codes) only the kernel's fp16
    # query and P.V differ: 3e-4 relative per attention, which this random model amplifies to
    # ~1.3% of the logits' range (seen on the CPU emulation of the kernel). A wrong page, head
    # or token would move them by their whole range.
    for row in explain(torch_path, kernels):
        assert row["max_logit_diff"] < 5e-2 * scale, row
