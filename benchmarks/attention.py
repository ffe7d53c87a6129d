"""Decode attention over the paged KV cache on one GPU: our KV4, KV8 and fp16-cache kernels
against torch SDPA on fp16 K/V (issue 7). Run by benchmarks/gpu_attention_run.sh.

For B in {1, 16, 64} x L in {1024, 4096, 16384} x heads (32 q / 32 kv, 32 / 8, head_dim 128)
and SmolLM2-135M's (9 / 3, head_dim 64), one query token per sequence:

- correctness: ||out - ref|| / ||ref|| against fp32 attention over the dequantized cache
  (qoqtool.runtime.kv_cache.reference_decode), at full and at ragged (random) lengths;
- time: median of CUDA-graph replays (triton.testing.do_bench) of a graph that calls the op
  once on each of several copies of the cache, like the layers of a model, so that no copy
  is still in the 60 MB L2 when it is read again; microseconds per call;
- effective bandwidth: the bytes of cache each call must read (codes and scales; K and V for
  SDPA) over its time.

Pages are assigned in random order (a fragmented cache). Writes results.json and results.md
to --out; prints the table last.

    python benchmarks/attention.py --out DIR [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from qoqtool.runtime import attention_ops as ops
from qoqtool.runtime.kv_cache import KVCacheLayout, reference_decode

BATCHES = (1, 16, 64)
LENGTHS = (1024, 4096, 16384)
SHAPES = ((32, 32, 128), (32, 8, 128), (9, 3, 64))  # (q heads, kv heads, head_dim)
FORMATS = (4, 8, 16)
PAGE_SIZE = 64
ROTATE_BYTES = 256 << 20  # every timed graph reads >= 4x the L2
MAX_COPIES = 32
SWEEP_SPLITS = (1, 2, 4, 8, 16, 32, 64)  # --sweep: forced split counts at B = 1 and 16


def bench_us(calls: list) -> float:
    """Median µs per call of a CUDA graph that runs every callable once."""
    import triton.testing

    for call in calls:  # warm-up (and any lazy initialisation) outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    ms = triton.testing.do_bench(graph.replay, warmup=5, rep=40, return_mode="median")
    return ms * 1000 / len(calls)


def copies_for(nbytes: int) -> int:
    return max(1, min(MAX_COPIES, math.ceil(ROTATE_BYTES / nbytes)))


class PagedCase:
    """One format's cache holding `copies` copies of the same K/V on shuffled pages."""

    def __init__(self, bits: int, k: torch.Tensor, v: torch.Tensor, copies: int, gen: torch.Generator):
        batch, kv_heads, length, head_dim = k.shape
        self.layout = KVCacheLayout(bits, head_dim, kv_heads, PAGE_SIZE)
        per_seq = math.ceil(length / PAGE_SIZE)
        per_copy = batch * per_seq
        self.pool = torch.empty(copies * per_copy, self.layout.page_bytes, dtype=torch.uint8, device="cuda")
        order = torch.randperm(per_copy, generator=gen).view(batch, per_seq)
        self.tables = [(order + c * per_copy).to(torch.int32).cuda() for c in range(copies)]
        positions = torch.arange(length)
        for b in range(batch):  # fill copy 0 through the append kernel, one sequence at a time
            pages = self.tables[0][b].cpu().long()
            slots = (pages[positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE).to(torch.int32).cuda()
            ops.kv_append(self.pool, self.layout, k[b].transpose(0, 1), v[b].transpose(0, 1), slots, validate=False)
        for c in range(1, copies):
            self.pool[c * per_copy:(c + 1) * per_copy].copy_(self.pool[:per_copy])

    def call(self, q, lens, max_len, copy=0, splits=None, step_blocks=ops.STEP_BLOCKS):
        plan = ops.plan_splits(q.shape[0], self.layout.num_kv_heads, max_len) if splits is None else splits
        return lambda: ops.kv_decode(q, self.pool, self.layout, self.tables[copy], lens, max_context_len=max_len,
                                     num_splits=plan[0], blocks_per_split=plan[1], step_blocks=step_blocks,
                                     validate=False)

    def bytes_read(self, lens: torch.Tensor) -> int:
        return int(lens.sum()) * self.layout.num_kv_heads * self.layout.token_bytes


def force_splits(max_len: int, splits: int) -> tuple[int, int]:
    blocks = math.ceil(max_len / 16)
    per_split = math.ceil(blocks / splits)
    return math.ceil(blocks / per_split), per_split


def sdpa_us(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    """SDPA on fp16 K/V [B, kv_heads, L, D] with [B, heads, 1, D] queries, over copies of K/V."""
    n = copies_for(2 * k.numel() * 2)
    ks = [k] + [k.clone() for _ in range(n - 1)]
    vs = [v] + [v.clone() for _ in range(n - 1)]
    q4, gqa = q[:, :, None], q.shape[1] != k.shape[1]
    return bench_us([lambda i=i: F.scaled_dot_product_attention(q4, ks[i], vs[i], enable_gqa=gqa) for i in range(n)])


def run_shape(batch, length, q_heads, kv_heads, head_dim, gen, sweep: bool) -> dict:
    k = torch.randn(batch, kv_heads, length, head_dim, device="cuda", dtype=torch.float16)
    v = torch.randn(batch, kv_heads, length, head_dim, device="cuda", dtype=torch.float16)
    q = torch.randn(batch, q_heads, head_dim, device="cuda", dtype=torch.float16)
    full = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    ragged = torch.randint(1, length + 1, (batch,), generator=gen, dtype=torch.int32).cuda()
    row = {"B": batch, "L": length, "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim}

    kv_bytes = 2 * k.numel() * 2
    row["sdpa_us"] = sdpa_us(q, k, v)
    row["sdpa_tbs"] = kv_bytes / row["sdpa_us"] / 1e6

    for bits in FORMATS:
        nbytes = batch * kv_heads * length * KVCacheLayout(bits, head_dim, kv_heads, PAGE_SIZE).token_bytes
        case = PagedCase(bits, k, v, copies_for(nbytes), gen)
        errors = []
        for lens in (full, ragged):
            out = case.call(q, lens, int(lens.max()))()
            ref = reference_decode(q, case.pool, case.layout, case.tables[0], lens)
            errors.append(float((out.float() - ref).norm() / ref.norm()))
            if out.isnan().any():  # a NaN norm would hide in max(); flag it
                errors[-1] = float("nan")
        us = bench_us([case.call(q, full, length, copy=c) for c in range(len(case.tables))])
        name = {4: "kv4", 8: "kv8", 16: "fp16cache"}[bits]
        row[f"{name}_us"] = us
        row[f"{name}_tbs"] = case.bytes_read(full) / us / 1e6
        row[f"{name}_err"] = float("nan") if any(math.isnan(e) for e in errors) else max(errors)
        row[f"{name}_splits"] = ops.plan_splits(batch, kv_heads, length)[0]
        if bits < 16:  # the kernel's other tiling (one 16-token block per warp step)
            other = 3 - ops.STEP_BLOCKS
            row[f"{name}_step{other}_us"] = bench_us([case.call(q, full, length, copy=c, step_blocks=other)
                                                      for c in range(len(case.tables))])
        if sweep and bits == 4:
            row["kv4_sweep"] = {s: bench_us([case.call(q, full, length, copy=c, splits=force_splits(length, s))
                                             for c in range(len(case.tables))])
                                for s in SWEEP_SPLITS}
        del case
    torch.cuda.empty_cache()
    return row


def profile_case(gen: torch.Generator, batch=16, length=4096, heads=32, head_dim=128) -> None:
    k, v = (torch.randn(batch, heads, length, head_dim, device="cuda", dtype=torch.float16) for _ in range(2))
    q = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.float16)
    full = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    case = PagedCase(4, k, v, 1, gen)
    for _ in range(20):
        case.call(q, full, length)()
    torch.cuda.synchronize()


def markdown(rows: list[dict]) -> str:
    other = 3 - ops.STEP_BLOCKS
    lines = [
        f"| heads q/kv, d | B | L | SDPA fp16 µs | KV4 µs | KV4 × SDPA | KV4 µs, step {other} | KV8 µs | KV8 × SDPA "
        f"| KV8 µs, step {other} | fp16-cache µs | TB/s SDPA / KV4 / KV8 | rel. err KV4 / KV8 / fp16 | KV4 splits |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['q_heads']}/{r['kv_heads']}, {r['head_dim']} | {r['B']} | {r['L']} | {r['sdpa_us']:.1f} "
            f"| {r['kv4_us']:.1f} | {r['sdpa_us'] / r['kv4_us']:.2f} | {r[f'kv4_step{other}_us']:.1f} "
            f"| {r['kv8_us']:.1f} | {r['sdpa_us'] / r['kv8_us']:.2f} | {r[f'kv8_step{other}_us']:.1f} "
            f"| {r['fp16cache_us']:.1f} | {r['sdpa_tbs']:.2f} / {r['kv4_tbs']:.2f} / {r['kv8_tbs']:.2f} "
            f"| {r['kv4_err']:.1e} / {r['kv8_err']:.1e} / {r['fp16cache_err']:.1e} | {r['kv4_splits']} |")
    sweeps = [r for r in rows if "kv4_sweep" in r]
    if sweeps:
        lines += ["", "KV4 µs by forced split count (planned count in the table above):", "",
                  "| heads q/kv, d | B | L | " + " | ".join(f"{s} splits" for s in sweeps[0]["kv4_sweep"]) + " |",
                  "|---|---|---|" + "---|" * len(sweeps[0]["kv4_sweep"])]
        for r in sweeps:
            lines.append(f"| {r['q_heads']}/{r['kv_heads']}, {r['head_dim']} | {r['B']} | {r['L']} | "
                         + " | ".join(f"{us:.1f}" for us in r["kv4_sweep"].values()) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--quick", action="store_true", help="B=16, L=4096 only")
    parser.add_argument("--sweep", action="store_true", help="also time KV4 at forced split counts (B=1, 16)")
    parser.add_argument("--profile", action="store_true",
                        help="only call KV4 decode at B=16, L=4096, 32/32 heads 20 times (to run under ncu)")
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if args.profile:
        profile_case(gen)
        return
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}", flush=True)
    rows = []
    grid = [(16, 4096)] if args.quick else [(b, n) for b in BATCHES for n in LENGTHS]
    for q_heads, kv_heads, head_dim in SHAPES:
        for batch, length in grid:
            start = time.time()
            sweep = args.sweep and batch < 64
            row = run_shape(batch, length, q_heads, kv_heads, head_dim, gen, sweep)
            rows.append(row)
            print(f"{q_heads}/{kv_heads} d{head_dim} B={batch} L={length}: SDPA {row['sdpa_us']:.1f} µs, "
                  f"KV4 {row['kv4_us']:.1f} µs ({row['kv4_tbs']:.2f} TB/s, err {row['kv4_err']:.1e}; "
                  f"other step {row[f'kv4_step{3 - ops.STEP_BLOCKS}_us']:.1f}), "
                  f"KV8 {row['kv8_us']:.1f} µs, fp16-cache {row['fp16cache_us']:.1f} µs "
                  f"[{time.time() - start:.1f} s]", flush=True)
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    table = markdown(rows)
    (args.out / "results.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
