"""qoqtool::qk_norm_rope (kernels/qk_rope.cu) against the torch path it replaces in the
paged-cache loop: runtime.fusion.rotary_queries_and_keys with the kernel switched off, i.e.
transformers' Qwen3RMSNorm, apply_rotary_pos_emb's arithmetic, the key rotation and the key
shift as separate fp16 ops. Without a norm or rotation the kernel rounds exactly as those ops
do (bit for bit); the norm's sum of squares and the rotation's products sum in another order,
so with them the outputs agree up to a few fp16 ulps. GPU tests are marked gpu; the
validation tests run on the CPU.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from qoqtool.runtime import cuda_ops, fusion
from qoqtool.runtime.attention import KEY_SHIFT, set_key_shift

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the kernels run there)")

CASES = [  # batch, tokens, query heads, kv heads, head_dim
    (1, 1, 9, 3, 64),      # smollm2's decode step
    (5, 1, 32, 8, 128),    # Llama-3-8B / Qwen3-8B decode, a batch
    (2, 7, 4, 2, 96),      # a prefill; head_dim 96: RoPE's partner element in another lane
    (3, 2, 2, 1, 32),      # the smallest head
    (2, 3, 4, 4, 256),     # the largest head (no rotation above 128)
    (1, 300, 16, 4, 128),  # more rows than the grid's warps: each warp walks several
]


def layer_parts(dim: int, kv_heads: int, norms: bool, rotate: bool, shift: bool, seed: int = 0) -> SimpleNamespace:
    """The parts of a layer that rotary_queries_and_keys reads: the attention module (its key
    rotation and shift buffers) and Qwen3's q/k norms, fp16 on the GPU."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from qoqtool.transforms.hadamard import random_hadamard

    g = torch.Generator().manual_seed(seed)
    attn = nn.Module()
    if rotate:
        attn.register_buffer("qoq_key_rotation", random_hadamard(dim, seed).half())
    if shift:
        set_key_shift(attn, torch.randn(kv_heads, dim, generator=g) * 0.5)
    q_norm = k_norm = None
    if norms:
        q_norm, k_norm = Qwen3RMSNorm(dim, eps=1e-6), Qwen3RMSNorm(dim, eps=1e-6)
        for norm in (q_norm, k_norm):
            norm.weight.data = 1 + torch.randn(dim, generator=g) * 0.3
            norm.half()
    parts = SimpleNamespace(attn=attn.cuda(), q_norm=q_norm and q_norm.cuda(), k_norm=k_norm and k_norm.cuda())
    return parts


def projections(batch: int, steps: int, q_heads: int, kv_heads: int, dim: int, seed: int = 0):
    """q [B, T, Hq, D] and k [B, T, Hkv, D] as views into one q/k/v GEMM output (strided rows),
    and transformers-style cos, sin [B, T, D] for random positions."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = torch.randn(batch, steps, (q_heads + 2 * kv_heads) * dim, generator=g, device="cuda").half() * 3
    q, k, _ = out.split([q_heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    positions = torch.randint(0, 4096, (batch, steps), generator=g, device="cuda").float()
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, dim, 2, device="cuda").float() / dim))
    freqs = positions[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (q.view(batch, steps, q_heads, dim), k.view(batch, steps, kv_heads, dim),
            emb.cos().half(), emb.sin().half())


def both_paths(parts, q, k, cos, sin):
    """(the kernel's queries and keys, the torch path's), each [B, heads, T, D]."""
    fused = fusion.rotary_queries_and_keys(parts, q, k, cos, sin)
    fusion.ROPE = False
    try:
        reference = fusion.rotary_queries_and_keys(parts, q, k, cos, sin)
    finally:
        fusion.ROPE = True
    return fused, reference


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("batch,steps,q_heads,kv_heads,dim", CASES)
@pytest.mark.parametrize("shift", [False, True], ids=["", "shift"])
def test_rope_alone_is_the_torch_path_bit_for_bit(batch, steps, q_heads, kv_heads, dim, shift):
    parts = layer_parts(dim, kv_heads, norms=False, rotate=False, shift=shift)
    (q, k), (q_ref, k_ref) = both_paths(parts, *projections(batch, steps, q_heads, kv_heads, dim))
    assert q.shape == q_ref.shape == (batch, q_heads, steps, dim) and k.shape == k_ref.shape == (batch, kv_heads, steps, dim)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("batch,steps,q_heads,kv_heads,dim", CASES)
@pytest.mark.parametrize("norms,rotate", [(True, False), (False, True), (True, True)],
                         ids=["norms", "rotation", "norms+rotation"])
def test_norms_and_rotation_match_the_torch_path(batch, steps, q_heads, kv_heads, dim, norms, rotate):
    rotate = rotate and cuda_ops.qk_rope_fits(dim, rotated=True)
    parts = layer_parts(dim, kv_heads, norms=norms, rotate=rotate, shift=rotate)
    projected = projections(batch, steps, q_heads, kv_heads, dim, seed=1)
    (q, k), (q_ref, k_ref) = both_paths(parts, *projected)
    for got, want in ((q, q_ref), (k, k_ref)):
        assert got.shape == want.shape and torch.isfinite(got).all()
        # A few fp16 ulps of the values (|values| up to ~8), on a small fraction of them.
        torch.testing.assert_close(got, want, rtol=4e-3, atol=4e-3)
        assert (got != want).float().mean() < 0.05
    if norms:  # the norm did something: without it the keys are another tensor
        plain = layer_parts(dim, kv_heads, norms=False, rotate=rotate, shift=rotate)
        assert not torch.allclose(fusion.rotary_queries_and_keys(plain, *projected)[1].float(), k.float(), atol=0.1)


@gpu
@pytest.mark.gpu
def test_decode_rows_come_out_contiguous_for_the_cache():
    """A decode step's [B, H, 1, D] queries and keys are contiguous [B, H, D] rows once the token
    axis is dropped: the cache append and the decode kernel take them without a copy."""
    parts = layer_parts(128, 8, norms=True, rotate=True, shift=True)
    q, k = fusion.rotary_queries_and_keys(parts, *projections(4, 1, 32, 8, 128))
    assert q[:, :, 0].is_contiguous() and k[:, :, 0].is_contiguous()


@gpu
@pytest.mark.gpu
def test_qk_norm_rope_under_cuda_graph():
    parts = layer_parts(64, 3, norms=True, rotate=True, shift=True)
    q, k, cos, sin = projections(2, 1, 9, 3, 64)
    fusion.rotary_queries_and_keys(parts, q, k, cos, sin)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fusion.rotary_queries_and_keys(parts, q, k, cos, sin)
    fresh = projections(2, 1, 9, 3, 64, seed=7)
    for t, new in zip((q, k, cos, sin), fresh):
        t.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(static, fusion.rotary_queries_and_keys(parts, q, k, cos, sin)):
        assert torch.equal(a, b)


def test_qk_norm_rope_validation_rejects_bad_input_on_the_cpu():
    def qk(batch=2, steps=3, q_heads=4, kv_heads=2, dim=64, dtype=torch.float16):
        return (torch.zeros(batch, steps, q_heads, dim, dtype=dtype), torch.zeros(batch, steps, kv_heads, dim, dtype=dtype),
                torch.zeros(batch, steps, dim, dtype=torch.float16), torch.zeros(batch, steps, dim, dtype=torch.float16))

    w = torch.ones(64, dtype=torch.float16)
    op = cuda_ops.qk_norm_rope
    cases = [
        (dict(dtype=torch.float32), (None, None, 0.0, None, None), "fp16 tensor"),
        (dict(dim=48), (None, None, 0.0, None, None), "multiple of 32"),
        (dict(dim=288), (None, None, 0.0, None, None), "multiple of 32 up to 256"),
        (dict(dim=256), (None, None, 0.0, torch.zeros(256, 256, dtype=torch.float16), None), "128 with a key rotation"),
        ({}, (w, None, 1e-6, None, None), "come together"),
        ({}, (w, torch.ones(32, dtype=torch.float16), 1e-6, None, None), r"k_weight must have shape \[64\]"),
        ({}, (None, None, 0.0, torch.zeros(64, 64), None), "rotation must be float16"),
        ({}, (None, None, 0.0, None, torch.zeros(3, 64)), r"key_shift must have shape \[2, 64\]"),
        ({}, (w, w, 1e-6, None, None), "CUDA"),  # all well formed: the CPU is what is wrong
    ]
    for shape, rest, message in cases:
        with pytest.raises(ValueError, match=message):
            op(*qk(**shape), *rest)
    q, k, cos, sin = qk()
    with pytest.raises(ValueError, match="must agree on B, T and head_dim"):
        op(q, k[:, :2], cos, sin, None, None, 0.0, None, None)
    with pytest.raises(ValueError, match="heads must be contiguous"):
        op(q.transpose(2, 3).contiguous().transpose(2, 3), k, cos, sin, None, None, 0.0, None, None)
    with pytest.raises(ValueError, match="evenly spaced"):
        op(torch.zeros(3, 2, 4, 64, dtype=torch.float16).transpose(0, 1), k, cos, sin, None, None, 0.0, None, None)
    with pytest.raises(ValueError, match=r"cos must have shape \[2, 3, 64\]"):
        op(q, k, cos[:, :1], sin, None, None, 0.0, None, None)


def test_the_loop_keeps_the_torch_path_on_the_cpu():
    """On the CPU (and wherever the kernel does not apply) rotary_queries_and_keys is the norms,
    then attention.rotary_queries_and_cached_keys: the same queries and keys as transformers'
    Qwen3 attention computes before its cache, rotated and shifted."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from qoqtool.runtime.attention import queries_and_cached_keys

    g = torch.Generator().manual_seed(3)
    attn = nn.Module()
    attn.register_buffer("qoq_key_rotation", torch.linalg.qr(torch.randn(64, 64, generator=g))[0])
    set_key_shift(attn, torch.randn(2, 64, generator=g))
    q_norm, k_norm = Qwen3RMSNorm(64), Qwen3RMSNorm(64)
    k_norm.weight.data = torch.rand(64, generator=g) + 0.5
    parts = SimpleNamespace(attn=attn, q_norm=q_norm, k_norm=k_norm)
    q, k = torch.randn(2, 5, 4, 64, generator=g), torch.randn(2, 5, 2, 64, generator=g)
    cos, sin = torch.randn(2, 5, 64, generator=g), torch.randn(2, 5, 64, generator=g)
    want = queries_and_cached_keys(attn, *apply_rotary_pos_emb(q_norm(q).transpose(1, 2), k_norm(k).transpose(1, 2),
                                                               cos, sin))
    assert getattr(attn, KEY_SHIFT) is not None
    for got, ref in zip(fusion.rotary_queries_and_keys(parts, q, k, cos, sin), want):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
