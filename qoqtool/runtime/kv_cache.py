"""The paged KV cache: pages of 4-bit (KV4), 8-bit (KV8) or fp16 keys and values.

A layer's cache is one uint8 tensor [num_pages, num_kv_heads * head_bytes]; a page holds
`page_size` tokens (a power of two, at least 16: the kernel finds pages with shifts) of one sequence, and each sequence has a page table
(its pages in order) and a length. One (page, kv head) region holds, in bytes:

    K codes    page_size/16 blocks of 16 tokens, 2 * head_dim * bits bytes each
    V codes    the same
    K params   page_size x (fp16 scale, fp16 zero)      KV4 / KV8 only
    V params   the same

Quantization is per token and kv head, asymmetric, exactly `quantize_kv` of
qoqtool.quantizers.activations (the reference path's KV quantization).

Inside a block, codes are stored in the order of the decode kernel's tensor-core fragments
(kernels/kv_attention.cu explains why and how): K per 8-token tile, lane (g, t) holding token
g and head dims 16c + 8h + 2t + e; V per 16-token block, lane (g, t) holding head dims 8j + g
and tokens 8h + 2t + e; registers of two values, cut into 16-byte units stored unit-major.
`fragment_tables` gives that order as byte indices, the single Python statement of it: the
torch reference of the append kernel (`reference_append`), reading the cache back
(`gather`) and the reference decode attention (`reference_decode`) all use it, and the GPU
tests check the kernels byte for byte against them.

`PagedKVCache` is what a generation loop uses: it hands out pages, keeps each sequence's
page table and length on the host (so the page tables it uploads are valid by construction),
and runs the CUDA kernels on a GPU or the torch reference elsewhere.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from qoqtool.quantizers.activations import quantize_kv

BLOCK_TOKENS = 16  # the k extent of one P.V mma; page sizes are multiples of it
SUPPORTED_BITS = (4, 8, 16)
SUPPORTED_HEAD_DIMS = (64, 128)


@dataclass(frozen=True)
class KVCacheLayout:
    """Sizes and offsets of one layer's paged cache (see the module docstring)."""

    bits: int
    head_dim: int
    num_kv_heads: int
    page_size: int = 64

    def __post_init__(self):
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"KV cache entries are 4, 8 or 16 bits, not {self.bits}")
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"the KV cache kernels support head_dim 64 and 128, not {self.head_dim}")
        if self.num_kv_heads < 1:
            raise ValueError(f"num_kv_heads must be positive, got {self.num_kv_heads}")
        if self.page_size < BLOCK_TOKENS or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, at least {BLOCK_TOKENS}, got {self.page_size}")

    @property
    def quantized(self) -> bool:
        return self.bits < 16

    @property
    def block_bytes(self) -> int:
        """K (or V) codes of one 16-token block."""
        return 2 * self.head_dim * self.bits

    @property
    def v_codes_offset(self) -> int:
        return self.page_size // BLOCK_TOKENS * self.block_bytes

    @property
    def k_params_offset(self) -> int:
        return 2 * self.v_codes_offset

    @property
    def v_params_offset(self) -> int:
        return self.k_params_offset + 4 * self.page_size

    @property
    def head_bytes(self) -> int:
        """Bytes of one (page, kv head) region."""
        return self.v_params_offset + 4 * self.page_size if self.quantized else self.k_params_offset

    @property
    def page_bytes(self) -> int:
        return self.num_kv_heads * self.head_bytes

    @property
    def token_bytes(self) -> int:
        """Cache bytes of one token and kv head: K and V codes plus their (scale, zero)."""
        return self.head_bytes // self.page_size


def _register_bytes(reg: torch.Tensor, e: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte (in the lane's fragment) and bit shift of element e of fp16-pair register `reg`."""
    if bits == 16:
        return 4 * reg + 2 * e, torch.zeros_like(reg)
    if bits == 8:
        return 2 * reg + e, torch.zeros_like(reg)
    nibble = reg % 4 + 4 * e  # KV4: registers r%4 and r%4 + 4 of word r/4 share one LOP3
    return 4 * (reg // 4) + nibble // 2, 4 * (nibble % 2)


def _fragment_offset(cb: torch.Tensor, lane: torch.Tensor, lane_bytes: int) -> torch.Tensor:
    """Where byte cb of a lane's fragment lies in its tile: unit u of all 32 lanes together."""
    unit = min(16, lane_bytes)
    return (cb // unit * 32 + lane) * unit + cb % unit


@functools.lru_cache(maxsize=None)
def fragment_tables(bits: int, head_dim: int) -> dict[str, torch.Tensor]:
    """Byte offset (inside a block's K or V codes) and nibble shift of every (token, dim).

    Returns int64 tensors [16, head_dim]: k_byte, k_shift, v_byte, v_shift (for fp16 the
    byte offset of the value's first byte, shift 0).
    """
    d_dim = head_dim
    tok = torch.arange(BLOCK_TOKENS)[:, None]
    d = torch.arange(d_dim)[None, :]
    # K: S = Q K^T per 8-token tile, tokens along the mma N (lane group g), dims along k.
    k_lane = 4 * (tok % 8) + (d % 8) // 2
    k_reg = 2 * (d // 16) + (d // 8) % 2
    k_cb, k_shift = _register_bytes(k_reg, (d % 2).expand_as(k_reg), bits)
    k_byte = (tok // 8) * (d_dim * bits) + _fragment_offset(k_cb, k_lane, d_dim * bits // 32)
    # V: O = P V per 16-token block, dims along the mma N (lane group g), tokens along k.
    v_lane = 4 * (d % 8) + (tok % 8) // 2
    v_reg = (tok // 8) * (d_dim // 8) + d // 8
    v_cb, v_shift = _register_bytes(v_reg, (tok % 2).expand_as(v_reg), bits)
    v_byte = _fragment_offset(v_cb, v_lane, d_dim * bits // 16)
    return {"k_byte": k_byte, "k_shift": k_shift.expand_as(k_byte).contiguous(),
            "v_byte": v_byte, "v_shift": v_shift.expand_as(v_byte).contiguous()}


def _codes(x: torch.Tensor, layout: KVCacheLayout):
    """What the append kernel stores for x [T, H, D]: (codes or fp16 bits as int64, scale, zero)."""
    if layout.quantized:
        codes, scale, zero = quantize_kv(x, layout.bits)
        return codes.long(), scale, zero
    return x.half().view(torch.int16).long() & 0xFFFF, None, None


def reference_append(pool: torch.Tensor, layout: KVCacheLayout, k: torch.Tensor, v: torch.Tensor,
                     slots: torch.Tensor) -> None:
    """The append kernel in torch: quantize k, v [T, kv_heads, head_dim] into `pool` at `slots`.

    pool is one layer's cache [num_pages, page_bytes] uint8; slots [T] = page * page_size +
    position in the page. Each token owns whole bytes, so its bytes are cleared and its
    nibbles added in.
    """
    t, heads, d = k.shape
    tables = fragment_tables(layout.bits, layout.head_dim)
    slots = slots.long().cpu()
    page, pos = slots // layout.page_size, slots % layout.page_size
    head_base = (page[:, None] * layout.page_bytes + torch.arange(heads)[None, :] * layout.head_bytes)  # [T, H]
    block_base = head_base + (pos // BLOCK_TOKENS * layout.block_bytes)[:, None]
    tok = (pos % BLOCK_TOKENS)[:, None]
    flat = pool.view(-1)
    device = pool.device
    for x, region, name in ((k, 0, "k"), (v, layout.v_codes_offset, "v")):
        codes, scale, zero = _codes(x.detach().cpu(), layout)
        byte = (block_base + region)[..., None] + tables[f"{name}_byte"][tok]  # [T, H, D]
        if layout.bits == 16:
            flat16 = pool.view(-1).view(torch.int16)
            flat16[(byte // 2).reshape(-1).to(device)] = codes.reshape(-1).to(torch.int16).to(device)
            continue
        shift = tables[f"{name}_shift"][tok]
        idx = byte.reshape(-1).to(device)
        flat[idx] = 0
        flat.index_put_((idx,), (codes << shift).reshape(-1).to(torch.uint8).to(device), accumulate=True)
        params = layout.k_params_offset if name == "k" else layout.v_params_offset
        at = (head_base + params + 4 * pos[:, None]) // 2  # in fp16 units
        flat16 = pool.view(-1).view(torch.float16)
        flat16[at.reshape(-1).to(device)] = scale.reshape(-1).to(device)
        flat16[(at + 1).reshape(-1).to(device)] = zero.reshape(-1).to(device)


def gather(pool: torch.Tensor, layout: KVCacheLayout, pages: torch.Tensor, length: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Read a sequence back: its pages (in order) and length -> dequantized K, V float32
    [kv_heads, length, head_dim], x' = code * scale + zero (what the decode kernel attends to)."""
    n = -(-length // layout.page_size)
    pages = pages[:n].long().to(pool.device)
    region = pool[pages].view(n, layout.num_kv_heads, layout.head_bytes)
    tables = {name: t.to(pool.device) for name, t in fragment_tables(layout.bits, layout.head_dim).items()}
    nb = layout.page_size // BLOCK_TOKENS
    out = []
    for name, start in (("k", 0), ("v", layout.v_codes_offset)):
        blocks = region[..., start:start + layout.v_codes_offset].reshape(n, layout.num_kv_heads, nb, layout.block_bytes)
        byte = tables[f"{name}_byte"]
        if layout.bits == 16:
            lo, hi = blocks[..., byte].long(), blocks[..., byte + 1].long()
            values = (lo | (hi << 8)).to(torch.int16).view(torch.float16).float()
        else:
            values = ((blocks[..., byte].long() >> tables[f"{name}_shift"]) & (2**layout.bits - 1)).float()
            offset = layout.k_params_offset if name == "k" else layout.v_params_offset
            params = region[..., offset:offset + 4 * layout.page_size].contiguous().view(torch.float16).float()
            params = params.view(n, layout.num_kv_heads, nb, BLOCK_TOKENS, 2)
            values = values * params[..., 0:1] + params[..., 1:2]
        # [n, H, nb, 16, D] -> [H, n * page_size, D]
        values = values.permute(1, 0, 2, 3, 4).reshape(layout.num_kv_heads, n * layout.page_size, layout.head_dim)
        out.append(values[:, :length])
    return out[0], out[1]


def reference_decode(q: torch.Tensor, pool: torch.Tensor, layout: KVCacheLayout, page_table: torch.Tensor,
                     context_lens: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """fp32 decode attention over the dequantized cache: q [B, Hq, D] -> [B, Hq, D] float32."""
    batch, q_heads, d = q.shape
    scale = d**-0.5 if scale is None else scale
    group = q_heads // layout.num_kv_heads
    out = torch.empty(batch, q_heads, d, dtype=torch.float32, device=q.device)
    for b, length in enumerate(context_lens.tolist()):
        k, v = gather(pool, layout, page_table[b], int(length))
        k = k.to(q.device).repeat_interleave(group, dim=0)
        v = v.to(q.device).repeat_interleave(group, dim=0)
        scores = torch.einsum("hd,hld->hl", q[b].float(), k) * scale
        out[b] = torch.einsum("hl,hld->hd", scores.softmax(dim=-1), v)
    return out


@dataclass
class StepPlan:
    """The device tensors one step's appends and attention share across layers."""

    seqs: list[int]
    slots: torch.Tensor         # [new tokens] int32: where each new token goes
    page_table: torch.Tensor | None  # [len(seqs), max_pages] int32 (None: unchanged, see plan)
    context_lens: torch.Tensor  # [len(seqs)] int32, after the append
    max_len: int
    num_splits: int = 1
    blocks_per_split: int = 1


class PagedKVCache:
    """Pages for `num_layers` layers; sequences are added, grown and freed on the host."""

    def __init__(self, layout: KVCacheLayout, num_layers: int, num_pages: int, device="cpu",
                 use_kernels: bool | None = None):
        if num_pages < 1 or num_pages * layout.page_size >= 2**31:
            raise ValueError(f"num_pages must be in 1 .. {2**31 // layout.page_size - 1}, got {num_pages}")
        self.layout = layout
        self.device = torch.device(device)
        # Zeroed once: a block's tokens past a sequence's end are never garbage NaNs.
        self.pool = torch.zeros(num_layers, num_pages, layout.page_bytes, dtype=torch.uint8, device=self.device)
        self.use_kernels = self.device.type == "cuda" if use_kernels is None else use_kernels
        self._free = list(range(num_pages - 1, -1, -1))
        self.pages: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self._next_id = 0

    @staticmethod
    def pages_for(tokens: int, page_size: int) -> int:
        return -(-tokens // page_size)

    def add_sequence(self) -> int:
        seq = self._next_id
        self._next_id += 1
        self.pages[seq], self.lengths[seq] = [], 0
        return seq

    def free_sequence(self, seq: int) -> None:
        self._free.extend(reversed(self.pages.pop(seq)))
        del self.lengths[seq]

    def plan(self, seqs: list[int], new_tokens: list[int], table: bool = True) -> StepPlan:
        """Make room for new_tokens[i] more tokens of seqs[i] and describe the step. table=False:
        the page table only if a sequence took a new page (else None), for a caller that keeps
        the previous step's (a graphed decode loop: building it is most of a step's host time)."""
        size = self.layout.page_size
        needs = [self.pages_for(self.lengths[seq] + n, size) - len(self.pages[seq]) for seq, n in zip(seqs, new_tokens)]
        if sum(needs) > len(self._free):  # (before any sequence grows: a refused step leaves the cache as it was)
            raise ValueError(f"the KV cache is full: this step needs {sum(needs)} more pages, "
                             f"{len(self._free)} are free; allocate more pages")
        slots, grew = [], False
        for seq, n, need in zip(seqs, new_tokens, needs):
            start = self.lengths[seq]
            self.pages[seq].extend(self._free.pop() for _ in range(need))
            grew |= need > 0
            slots.extend(self.pages[seq][p // size] * size + p % size for p in range(start, start + n))
            self.lengths[seq] = start + n
        lens = [self.lengths[s] for s in seqs]
        page_table = None
        if table or grew:
            width = max(1, max(len(self.pages[s]) for s in seqs))
            rows = [self.pages[s] + [0] * (width - len(self.pages[s])) for s in seqs]
            page_table = torch.tensor(rows, dtype=torch.int32, device=self.device)
        plan = StepPlan(
            seqs=list(seqs),
            slots=torch.tensor(slots, dtype=torch.int32, device=self.device),
            page_table=page_table,
            context_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
            max_len=max(lens),
        )
        if self.use_kernels:
            from qoqtool.runtime.attention_ops import plan_splits

            plan.num_splits, plan.blocks_per_split = plan_splits(
                len(seqs), self.layout.num_kv_heads, plan.max_len, self.device)
        return plan

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: StepPlan) -> None:
        """Write the step's new keys and values [new tokens, kv_heads, head_dim] of one layer."""
        if self.use_kernels:
            from qoqtool.runtime.attention_ops import kv_append

            kv_append(self.pool[layer], self.layout, k, v, plan.slots, validate=False)
        else:
            reference_append(self.pool[layer], self.layout, k, v, plan.slots)

    def attend(self, layer: int, q: torch.Tensor, plan: StepPlan, scale: float) -> torch.Tensor:
        """Decode attention of one query token per planned sequence: q [B, Hq, D] -> [B, Hq, D]
        in q's dtype (the kernel takes the query in fp16)."""
        if self.use_kernels:
            from qoqtool.runtime.attention_ops import kv_decode

            out = kv_decode(q.to(torch.float16).contiguous(), self.pool[layer], self.layout, plan.page_table,
                            plan.context_lens, scale=scale, max_context_len=plan.max_len,
                            num_splits=plan.num_splits, blocks_per_split=plan.blocks_per_split, validate=False)
            return out.to(q.dtype)
        out = reference_decode(q, self.pool[layer], self.layout, plan.page_table, plan.context_lens, scale)
        return out.to(q.dtype)

    def keys_values(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's dequantized K, V [kv_heads, length, head_dim] float32, as decode reads them."""
        pages = torch.tensor(self.pages[seq], dtype=torch.long)
        return gather(self.pool[layer], self.layout, pages, self.lengths[seq])

    @property
    def free_pages(self) -> int:
        return len(self._free)


def pages_needed(lengths: list[int], page_size: int) -> int:
    return sum(math.ceil(n / page_size) for n in lengths)
