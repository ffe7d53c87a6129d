"""Torch ops of the paged KV cache kernels (kernels/kv_attention.cu).

Two custom ops, registered with torch.library so they compose with CUDA graphs and
torch.compile (fake implementations give their output shapes):

    qoqtool::kv_append(cache, k, v, slots, bits, head_dim, page_size)     writes `cache`
    qoqtool::kv_decode(q, cache, page_table, context_lens, bits, page_size,
                       num_kv_heads, num_splits, blocks_per_split, scale) -> out

and the functions callers use, `kv_append` and `kv_decode`, which check every input in
Python before anything is launched: dtypes, shapes, devices and contiguity always; with
`validate=True` (the default) also the values that decide where the kernels read and write
(page indices, context lengths, slots), at the price of one device-to-host copy. The paged
cache (qoqtool.runtime.kv_cache.PagedKVCache) builds its page tables on the host, valid by
construction, and skips that copy. The kernels never fault even on unchecked input: an
out-of-range page reads page 0, an out-of-range slot is not written.

`plan_splits` chooses the flash-decoding split of the context (a cost model: splits while the
batch leaves multiprocessors idle, none once it fills the chip). The splits are combined
inside the same launch: the last split of each sequence and kv head to finish does it, found
through a ticket counter (`_tickets`).
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch

from qoqtool.runtime import kernel_library as kl
from qoqtool.runtime.kv_cache import BLOCK_TOKENS, KVCacheLayout

_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
MAX_GROUP = 16          # query heads per kv head: two 8-column tiles of the kernel's mma
STEP_BLOCKS = 2         # 16-token blocks per warp step of the decode kernel (1 or 2)
ROUND_BLOCKS = 4 * STEP_BLOCKS  # one step for each of the kernel's 4 warps: splits are whole rounds
MIN_SPLIT_BLOCKS = 8    # 128 tokens: below that a split's fixed costs dominate
MAX_CTAS_PER_SM = 4     # decode CTAs resident on one multiprocessor (registers and shared memory)
SPLIT_COST_BLOCKS = 2   # a split's fixed costs and its part of the combine, in blocks (fit, see plan_splits)
MAX_SPLIT_ROWS = 4096   # num_splits * (q_heads / kv_heads): the combine's weights in shared memory


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    lib = kl.library()
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.qoq_kv_head_bytes.argtypes = [i32, i32, i32]
    lib.qoq_kv_head_bytes.restype = i64
    lib.qoq_kv_append.argtypes = [p, p, i32, i64, i64, i64, i64, p, p, i32, i32, i32, i32, i32, i32, p]
    lib.qoq_kv_append.restype = i32
    lib.qoq_kv_decode.argtypes = [p, p, p, p, p, p, p, p] + [i32] * 11 + [ctypes.c_float, p]
    lib.qoq_kv_decode.restype = i32
    # The layout is written twice (here in torch, there in CUDA): make sure the sizes agree.
    for bits in (4, 8, 16):
        for head_dim in (64, 128):
            ours = KVCacheLayout(bits, head_dim, 1, 64).head_bytes
            theirs = lib.qoq_kv_head_bytes(bits, head_dim, 64)
            if ours != theirs:
                raise RuntimeError(f"kernel library disagrees on the KV cache layout (bits={bits}, "
                                   f"head_dim={head_dim}: {theirs} != {ours} bytes); rebuild it")
    return lib


_TICKETS: dict[tuple[int, int], torch.Tensor] = {}


def _tickets(device: torch.device, count: int) -> torch.Tensor:
    """The split tickets of decode launches on the current stream of `device`: int32 zeros that
    every launch leaves zero again (also inside CUDA graphs), so one buffer serves every call
    made in stream order. Grown by doubling; allocated on first use (under graph capture, from
    the graph's pool, which this reference keeps alive). Two CUDA graphs captured on the same
    stream share it: replay them in order, not concurrently on two streams."""
    key = (device.index, torch.cuda.current_stream(device).cuda_stream)
    buf = _TICKETS.get(key)
    if buf is None or buf.numel() < count:
        buf = torch.zeros(max(1024, 1 << (count - 1).bit_length()), dtype=torch.int32, device=device)
        _TICKETS[key] = buf
    return buf


# ---- custom ops ------------------------------------------------------------------------------
@torch.library.custom_op("qoqtool::kv_append", mutates_args=("cache",), device_types="cuda")
def _append_op(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
               bits: int, head_dim: int, page_size: int) -> None:
    status = _lib().qoq_kv_append(
        kl.ptr(k), kl.ptr(v), _DTYPE_CODES[k.dtype], k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kl.ptr(slots), kl.ptr(cache), k.shape[0], k.shape[1], head_dim, bits, page_size, cache.shape[0],
        kl.stream_of(cache))
    kl.check(status, "qoqtool::kv_append")


@torch.library.custom_op("qoqtool::kv_decode", mutates_args=(), device_types="cuda")
def _decode_op(q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor, context_lens: torch.Tensor,
               bits: int, page_size: int, num_kv_heads: int, num_splits: int, blocks_per_split: int,
               step_blocks: int, scale: float) -> torch.Tensor:
    batch, q_heads, head_dim = q.shape
    out = torch.empty_like(q)
    acc = ml = tickets = None
    if num_splits > 1:  # flash-decoding workspace: each split's unnormalized output, max and sum
        acc = torch.empty(batch, q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        ml = torch.empty(batch, q_heads, num_splits, 2, dtype=torch.float32, device=q.device)
        tickets = _tickets(q.device, batch * num_kv_heads)
    status = _lib().qoq_kv_decode(
        kl.ptr(q), kl.ptr(out), kl.ptr(cache), kl.ptr(page_table), kl.ptr(context_lens), kl.ptr_or_null(acc),
        kl.ptr_or_null(ml), kl.ptr_or_null(tickets), batch, q_heads, num_kv_heads, head_dim, bits, page_size,
        page_table.shape[1], cache.shape[0], num_splits, blocks_per_split, step_blocks, scale, kl.stream_of(q))
    kl.check(status, "qoqtool::kv_decode")
    return out


@_decode_op.register_fake
def _(q, cache, page_table, context_lens, bits, page_size, num_kv_heads, num_splits, blocks_per_split, step_blocks,
      scale):
    return torch.empty_like(q)


# ---- validation -----------------------------------------------------------------------------
def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_cache(cache: torch.Tensor, layout: KVCacheLayout) -> None:
    _expect(cache.is_cuda, f"the KV cache must be a CUDA tensor, got one on {cache.device}")
    _expect(cache.dtype == torch.uint8 and cache.dim() == 2 and cache.is_contiguous(),
            f"the KV cache of one layer is a contiguous uint8 [num_pages, page_bytes] tensor, "
            f"got {cache.dtype} {tuple(cache.shape)}")
    _expect(cache.shape[1] == layout.page_bytes,
            f"the KV cache has {cache.shape[1]} bytes per page, its layout {layout} needs {layout.page_bytes}")
    _expect(cache.shape[0] * layout.page_size < 2**31, "the KV cache has too many pages for 32-bit slot indices")


def _check_int_vector(t: torch.Tensor, name: str, n: int, device: torch.device) -> None:
    _expect(t.dtype == torch.int32 and t.dim() == 1 and t.shape[0] == n and t.is_contiguous(),
            f"{name} must be a contiguous int32 vector of {n}, got {t.dtype} {tuple(t.shape)}")
    _expect(t.device == device, f"{name} is on {t.device}, the KV cache on {device}")


def check_slots(slots: torch.Tensor, num_pages: int, page_size: int) -> None:
    """Every slot inside the cache (one device-to-host copy)."""
    if slots.numel():
        low, high = (int(x) for x in torch.stack([slots.min(), slots.max()]).tolist())
        _expect(low >= 0 and high < num_pages * page_size,
                f"slot {low if low < 0 else high} is outside the KV cache of {num_pages} pages x {page_size} tokens")


def check_page_table(page_table: torch.Tensor, context_lens: torch.Tensor, num_pages: int, page_size: int,
                     max_context_len: int | None = None) -> None:
    """Every context length inside its page-table row, every page it uses inside the cache."""
    lens = context_lens.long()
    used = (lens + page_size - 1) // page_size  # pages each sequence reads
    width = page_table.shape[1]
    bad_len = (lens < 1) | (used > width)
    if max_context_len is not None:
        bad_len |= lens > max_context_len
    cols = torch.arange(width, device=page_table.device)[None, :]
    bad_page = (cols < used[:, None]) & ((page_table < 0) | (page_table >= num_pages))
    flags = torch.stack([bad_len.any(), bad_page.any()]).tolist()
    if flags[0]:
        seq = int(bad_len.nonzero()[0, 0])
        limit = width * page_size if max_context_len is None else min(width * page_size, max_context_len)
        raise ValueError(f"context length {int(lens[seq])} of sequence {seq} is outside 1 .. {limit} "
                         f"(its page-table row covers {width} pages of {page_size} tokens)")
    if flags[1]:
        seq, col = (int(x) for x in bad_page.nonzero()[0])
        raise ValueError(f"page table entry [{seq}, {col}] = {int(page_table[seq, col])} points outside the "
                         f"KV cache of {num_pages} pages")


# ---- public API -------------------------------------------------------------------------------
def kv_append(cache: torch.Tensor, layout: KVCacheLayout, k: torch.Tensor, v: torch.Tensor,
              slots: torch.Tensor, validate: bool = True) -> None:
    """Quantize k, v [tokens, kv_heads, head_dim] (fp16, bf16 or fp32; any token and head
    strides) into one layer's cache at `slots` (int32, page * page_size + position)."""
    _check_cache(cache, layout)
    shape = (k.shape[0], layout.num_kv_heads, layout.head_dim)
    for name, x in (("k", k), ("v", v)):
        _expect(x.dim() == 3 and tuple(x.shape) == shape,
                f"{name} must be [tokens, {layout.num_kv_heads} kv heads, {layout.head_dim}], got {tuple(x.shape)}")
        _expect(x.dtype in _DTYPE_CODES, f"{name} must be fp16, bf16 or fp32, got {x.dtype}")
        _expect(x.device == cache.device, f"{name} is on {x.device}, the KV cache on {cache.device}")
        _expect(x.stride(2) == 1, f"{name}'s head_dim must be contiguous (stride 1), got stride {x.stride(2)}")
    _expect(k.dtype == v.dtype, f"k and v must share a dtype, got {k.dtype} and {v.dtype}")
    _check_int_vector(slots, "slots", k.shape[0], cache.device)
    if validate:
        check_slots(slots, cache.shape[0], layout.page_size)
    if k.shape[0]:
        _append_op(cache, k, v, slots, layout.bits, layout.head_dim, layout.page_size)


def plan_splits(batch: int, kv_heads: int, max_context_len: int, device=None) -> tuple[int, int]:
    """(num_splits, blocks_per_split) for a decode of `batch` sequences of up to max_context_len.

    A cost model fit to the split sweeps of benchmarks/RESULTS.md (issue 7; on all their rows
    but one it picks the fastest count or one within 3%): a decode takes as long as its busiest
    multiprocessor, which runs ceil(CTAs / SMs) CTAs of blocks_per_split blocks, counted as at
    least two (one CTA of 4 warps cannot keep a multiprocessor busy), plus SPLIT_COST_BLOCKS per
    split (its fixed costs and its part of the combine, which the last split of each sequence
    and kv head does alone). Splits are whole rounds of the 4 warps' steps, at least
    MIN_SPLIT_BLOCKS long, and there are never more CTAs than fit on the chip at once."""
    blocks = max(1, math.ceil(max_context_len / BLOCK_TOKENS))
    sms = torch.cuda.get_device_properties(device).multi_processor_count if torch.cuda.is_available() else 132
    return _plan_splits(max(1, batch * kv_heads), blocks, sms)


@functools.lru_cache(maxsize=4096)
def _plan_splits(seq_heads: int, blocks: int, sms: int) -> tuple[int, int]:
    most = max(1, min(blocks // MIN_SPLIT_BLOCKS, MAX_CTAS_PER_SM * sms // seq_heads, MAX_SPLIT_ROWS // MAX_GROUP))
    best = None
    for wanted in range(1, most + 1):
        per_split = -(-math.ceil(blocks / wanted) // ROUND_BLOCKS) * ROUND_BLOCKS  # the 4 warps equally busy
        splits = math.ceil(blocks / per_split)
        busiest = max(math.ceil(seq_heads * splits / sms), 2) * per_split + SPLIT_COST_BLOCKS * splits
        if best is None or busiest < best[0]:
            best = (busiest, splits, per_split)
    return best[1], best[2]


def kv_decode(q: torch.Tensor, cache: torch.Tensor, layout: KVCacheLayout, page_table: torch.Tensor,
              context_lens: torch.Tensor, scale: float | None = None, max_context_len: int | None = None,
              num_splits: int | None = None, blocks_per_split: int | None = None,
              step_blocks: int = STEP_BLOCKS, validate: bool = True) -> torch.Tensor:
    """Decode attention: q [B, q_heads, head_dim] fp16, one token per sequence, over the
    context_lens[b] cached tokens of sequence b (pages page_table[b]) -> [B, q_heads, head_dim] fp16.

    max_context_len bounds context_lens (computed with a device sync when not given); the
    split is planned from it unless num_splits and blocks_per_split are given. step_blocks
    (1 or 2) is the kernel's tiling: 16-token blocks per warp step.
    """
    _check_cache(cache, layout)
    _expect(q.is_cuda and q.device == cache.device, f"q is on {q.device}, the KV cache on {cache.device}")
    _expect(q.dtype == torch.float16 and q.dim() == 3 and q.is_contiguous(),
            f"q must be a contiguous fp16 [batch, q_heads, head_dim] tensor, got {q.dtype} {tuple(q.shape)}")
    batch, q_heads, head_dim = q.shape
    _expect(head_dim == layout.head_dim, f"q has head_dim {head_dim}, the KV cache {layout.head_dim}")
    _expect(q_heads % layout.num_kv_heads == 0 and q_heads // layout.num_kv_heads <= MAX_GROUP,
            f"{q_heads} query heads over {layout.num_kv_heads} kv heads: need a multiple, at most "
            f"{MAX_GROUP} query heads per kv head")
    _expect(batch < 65536 and layout.num_kv_heads < 65536, "at most 65535 sequences and kv heads per launch")
    _expect(page_table.dtype == torch.int32 and page_table.dim() == 2 and page_table.shape[0] == batch
            and page_table.is_contiguous() and page_table.shape[1] >= 1,
            f"page_table must be a contiguous int32 [{batch}, max_pages] tensor, got {page_table.dtype} "
            f"{tuple(page_table.shape)}")
    _expect(page_table.device == cache.device, f"page_table is on {page_table.device}, the KV cache on {cache.device}")
    _check_int_vector(context_lens, "context_lens", batch, cache.device)
    if validate:
        check_page_table(page_table, context_lens, cache.shape[0], layout.page_size, max_context_len)
    if batch == 0:
        return torch.empty_like(q)
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    if num_splits is None or blocks_per_split is None:
        num_splits, blocks_per_split = plan_splits(batch, layout.num_kv_heads, max_context_len, q.device)
    _expect(num_splits * blocks_per_split * BLOCK_TOKENS >= max_context_len,
            f"{num_splits} splits of {blocks_per_split} blocks do not cover {max_context_len} tokens")
    group = q_heads // layout.num_kv_heads
    _expect(num_splits * group <= MAX_SPLIT_ROWS,
            f"{num_splits} splits x {group} query heads per kv head: at most {MAX_SPLIT_ROWS}")
    _expect(step_blocks in (1, 2), f"step_blocks is 1 or 2, got {step_blocks}")
    scale = head_dim**-0.5 if scale is None else float(scale)
    return _decode_op(q, cache, page_table, context_lens, layout.bits, layout.page_size, layout.num_kv_heads,
                      num_splits, blocks_per_split, step_blocks, scale)
