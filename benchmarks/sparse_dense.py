"""Fused sparse-dense W4A8 GEMM benchmark (issue 8, item 4, W4A8 part), one GPU.

    python benchmarks/sparse_dense.py [--quick | --targets | --explore | --explore-plans] [--kind per_group|per_channel] [--json PATH]

For M in {1, 8, 16, 32, 64} x outlier densities {0, 0.5, 1, 2, 5} % x the six (N, K) shapes
of Llama-3-8B and Qwen2.5-14B, with two outlier patterns (uniform; column-clustered: the
outliers fill ~25% of the rows of a random 4*density share of the columns, as activation
outlier channels do), it times:
  fused    qoqtool::w4a8_sparse_dense_gemm_*: dense INT4 + Tile-COO outliers, one kernel
  dense    our dense-only W4A8 kernel (the fused kernel's upper bound; no outliers)
  unfused  our dense kernel + a separate torch CSR SpMM (cuSPARSE) of the same outliers
           (fp16 values, fp16 activations xq * sx, pre-transposed outside the timing) + the add
  bf16     cuBLAS bf16 torch.matmul
Weights are progressive g128 (default) or per-channel UINT4, random codes in the kernels'
contract (benchmarks/gemm.py's w4_operands). Timing as benchmarks/gemm.py: each op is called
on R copies of its weights (and of its outliers) inside one CUDA graph, so that small-M
calls stream from HBM; triton's do_bench replays the graph (median). If an op cannot be
captured (a host sync inside torch.sparse), it is timed eagerly and marked so.

Correctness at every point: the fused output against our dense kernel's output plus the
float64 sparse reference sx * (S xq^T), relative Frobenius error (must be <= 1e-3).

The Tile-COO sections are built on the GPU by `encode_fast` (same byte format, validated
with tile_coo.validate in --quick; entries of a bucket in column order instead of
tile_coo.encode's bank-conflict / slot-colouring arrangement, which only a kernel gathering
activations from a shared-memory tile would need: this kernel scatters the entries into a
dense fp16 tile per bucket and multiplies it on the tensor cores, so entry order does not
matter to it). tile_coo.encode in Python would take ~10 minutes for these shapes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings

import torch
from gemm import GROUP, copies_for, every_stream_plan, per_group, w4_operands

from qoqtool.packing import tile_coo
from qoqtool.runtime import cuda_ops  # also registers the torch.ops.qoqtool ops

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (5120, 5120), (13824, 5120), (5120, 13824)]  # (N, K)
MS = [1, 8, 16, 32, 64]
DENSITIES = [0.0, 0.005, 0.01, 0.02, 0.05]
PATTERNS = ["uniform", "clustered"]


# -- outliers ----------------------------------------------------------------------------------------
def outlier_mask(n: int, k: int, density: float, pattern: str, g) -> torch.Tensor:
    if pattern == "uniform" or density == 0:
        return torch.rand(n, k, device="cuda", generator=g) < density
    cols = torch.randperm(k, device="cuda", generator=g)[: min(k, math.ceil(4 * density * k))]
    mask = torch.zeros(n, k, dtype=torch.bool, device="cuda")
    mask[:, cols] = torch.rand(n, cols.numel(), device="cuda", generator=g) < density * k / cols.numel()
    return mask


def encode_fast(mask: torch.Tensor, values: torch.Tensor, k_padded: int):
    """Tile-COO (docs/tile-coo.md) of the outliers at mask [N, K] with fp16 values, on the GPU:
    per (bucket, column), its rows in order, four per entry. Returns (entries, start, count)."""
    n, _ = mask.shape
    dev = mask.device
    bn, bk = tile_coo.BUCKET_N, tile_coo.BUCKET_K
    nbn, nbk = tile_coo.buckets_of(n, k_padded)
    rows, cols = mask.nonzero(as_tuple=True)
    vals = values[rows, cols].half()
    bucket = (rows // bn) * nbk + cols // bk
    order = torch.argsort(bucket * (bn * bk) + (cols % bk) * bn + rows % bn)
    rows, cols, vals, bucket = rows[order], cols[order], vals[order], bucket[order]
    cell = bucket * bk + cols % bk  # (bucket, column): one run of rows
    new_cell = torch.ones_like(cell, dtype=torch.bool)
    new_cell[1:] = cell[1:] != cell[:-1]
    run_start = torch.cummax(torch.where(new_cell, torch.arange(cell.numel(), device=dev), 0), 0).values
    rank = torch.arange(cell.numel(), device=dev) - run_start
    new_entry = new_cell | (rank % 4 == 0)
    entry = torch.cumsum(new_entry.long(), 0) - 1
    q = int(entry[-1]) + 1 if entry.numel() else 0
    slot = rank % 4
    table = torch.zeros(q, 16, dtype=torch.uint8, device=dev)
    value_bytes = vals.view(torch.int16).view(torch.uint8).view(-1, 2)
    table[entry, 2 * slot] = value_bytes[:, 0]
    table[entry, 2 * slot + 1] = value_bytes[:, 1]
    table[entry, 8 + slot] = (rows % bn).to(torch.uint8)
    table[entry, 12] = (cols % bk).to(torch.uint8)
    mask_bits = torch.zeros(q, dtype=torch.int32, device=dev).index_add_(0, entry, torch.bitwise_left_shift(torch.ones_like(slot), slot).int())
    table[:, 13] = mask_bits.to(torch.uint8)
    count = torch.zeros(nbn * nbk, dtype=torch.int32, device=dev)
    if q:
        entry_bucket = torch.zeros(q, dtype=torch.long, device=dev).index_copy_(0, entry, bucket)
        count.index_add_(0, entry_bucket, torch.ones(q, dtype=torch.int32, device=dev))
    start = (torch.cumsum(count, 0) - count).int()
    return table, start.reshape(nbn, nbk).contiguous(), count.reshape(nbn, nbk).contiguous()


SPMM_DTYPE = torch.float16  # the unfused SpMM's values and activations; float32 if cuSPARSE refuses fp16 here


def choose_spmm_dtype() -> torch.dtype:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for dtype in (torch.float16, torch.float32):
            try:
                eye = torch.eye(8, device="cuda", dtype=dtype).to_sparse_csr()
                torch.sparse.mm(eye, torch.ones(8, 2, device="cuda", dtype=dtype))
                return dtype
            except RuntimeError:
                continue
    raise RuntimeError("torch.sparse.mm with a CSR matrix does not run on this GPU")


def make_outliers(n: int, k: int, density: float, pattern: str, g, check: bool = False):
    """(Tile-COO tensors, fp16 CSR [N, K], fp32 dense S for the reference) of one random draw."""
    mask = outlier_mask(n, k, density, pattern, g)
    values = torch.randn(n, k, device="cuda", generator=g) * 2e-2  # ~ the dense weights' size: residuals of large weights
    tc = encode_fast(mask, values, k)
    if check:
        cpu = tuple(t.cpu() for t in tc)
        tile_coo.validate(tile_coo.TileCOO(*cpu, (n, k), k))
    rows, cols = mask.nonzero(as_tuple=True)
    with warnings.catch_warnings():  # "sparse CSR support is in beta"
        warnings.simplefilter("ignore", UserWarning)
        coo = torch.sparse_coo_tensor(torch.stack([rows, cols]), values[rows, cols].half().to(SPMM_DTYPE), (n, k))
        csr = coo.coalesce().to_sparse_csr()
    return tc, csr


# -- timing ------------------------------------------------------------------------------------------
def time_calls(calls, rep_ms: int) -> tuple[float, bool]:
    """(us per call, captured): all calls in one CUDA graph replayed under do_bench, or eagerly
    when the graph cannot be captured."""
    for f in calls:
        f()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for f in calls:
                f()
        run, captured = graph.replay, True
    except Exception:  # noqa: BLE001 - any capture failure: time it eagerly instead
        torch.cuda.synchronize()
        run, captured = (lambda: [f() for f in calls]), False
    from triton.testing import do_bench  # (triton comes with torch's CUDA builds: imported here, --help works anywhere)

    ms = do_bench(run, warmup=max(5, rep_ms // 4), rep=rep_ms, return_mode="median")
    return ms * 1e3 / len(calls), captured


# -- one shape -----------------------------------------------------------------------------------------
def w4a16_operands(n, k, g):
    """Random W4A16 operands: UINT4 codes, fp16 group scales, UINT4 zeros (group GROUP)."""
    nt, groups = n // 32, k // GROUP
    return (torch.randint(0, 256, (nt, k // 32, 32, 16), dtype=torch.uint8, device="cuda", generator=g),
            (torch.rand(nt, groups, 32, device="cuda", generator=g) * 2e-2 + 1e-3).half(),
            torch.randint(0, 16, (nt, groups, 32), dtype=torch.uint8, device="cuda", generator=g))


# For kind "w4a16" the activations x_q are fp16 and x_scale is all ones (W4A16 has no token scale).
def dense_op(kind, n):
    if kind == "w4a16":
        return lambda x_q, x_scale, x_rowsum, w: torch.ops.qoqtool.w4a16_gemm(x_q, *w, n)
    if kind == "per_group":
        return lambda x_q, x_scale, x_rowsum, w: per_group(x_q, x_scale, x_rowsum, *w, n)
    return lambda x_q, x_scale, x_rowsum, w: torch.ops.qoqtool.w4a8_gemm_per_channel(x_q, x_scale, x_rowsum, *w, n)


def fused_op(kind, n):
    if kind == "w4a16":
        return lambda x_q, x_scale, x_rowsum, w, tc: torch.ops.qoqtool.w4a16_sparse_dense_gemm(x_q, *w, *tc, n)
    if kind == "per_group":
        return lambda x_q, x_scale, x_rowsum, w, tc: torch.ops.qoqtool.w4a8_sparse_dense_gemm_per_group(
            x_q, x_scale, *w, *tc, n)
    return lambda x_q, x_scale, x_rowsum, w, tc: torch.ops.qoqtool.w4a8_sparse_dense_gemm_per_channel(
        x_q, x_scale, x_rowsum, *w, *tc, n)


def measure_shape(n, k, ms, densities, patterns, kind, g, rep_ms, check) -> list[dict]:
    copies = max(copies_for(n * k // 2, m) for m in ms)
    weights = [w4a16_operands(n, k, g) if kind == "w4a16" else w4_operands(n, k, kind, g) for _ in range(copies)]
    dense, fused = dense_op(kind, n), fused_op(kind, n)
    wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(copies_for(2 * n * k, 1))]
    acts = {}
    base = {}
    for m in ms:
        if kind == "w4a16":
            x_q = torch.randn(m, k, device="cuda", generator=g).half()
            x_scale, x_rowsum = torch.ones(m, device="cuda", dtype=torch.float16), None
        else:
            x_q = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda", generator=g)
            x_scale = (torch.rand(m, device="cuda", generator=g) * 0.02 + 0.01).half()
            x_rowsum = x_q.sum(1, dtype=torch.int32)
        x16_t = (x_q.float() * x_scale.float()[:, None]).half().to(SPMM_DTYPE).t().contiguous()  # [K, M] for the SpMM
        acts[m] = (x_q, x_scale, x_rowsum, x16_t)
        dense_us, _ = time_calls([lambda w=w: dense(x_q, x_scale, x_rowsum, w) for w in weights], rep_ms)
        xb = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        bf16_us, _ = time_calls([lambda w=w: torch.matmul(xb, w.t()) for w in wb], rep_ms)
        base[m] = (dense_us, bf16_us)
    del wb

    rows = []
    for pattern in patterns:
        for density in densities:
            if density == 0 and pattern != patterns[0]:
                continue  # no outliers: the pattern does not matter
            sections = [make_outliers(n, k, density, pattern, g, check and i == 0) for i in range(copies)]
            nnz = sections[0][1].values().numel()
            for m in ms:
                x_q, x_scale, x_rowsum, x16_t = acts[m]
                pairs = list(zip(weights, sections))
                fused_us, _ = time_calls([lambda w=w, s=s: fused(x_q, x_scale, x_rowsum, w, s[0]) for w, s in pairs], rep_ms)

                def unfused(w, csr):
                    y = dense(x_q, x_scale, x_rowsum, w)
                    return y + torch.sparse.mm(csr, x16_t).t().to(y.dtype)

                unfused_us, captured = time_calls([lambda w=w, s=s: unfused(w, s[1]) for w, s in pairs], rep_ms)
                # correctness: fused vs our dense kernel + the float64 sparse reference (copy 0)
                w0, (tc0, csr0) = pairs[0]
                out = fused(x_q, x_scale, x_rowsum, w0, tc0).double()
                sparse_ref = (csr0.to_dense().half().double() @ x_q.double().t()).t() * x_scale.double()[:, None]
                ref = dense(x_q, x_scale, x_rowsum, w0).double() + sparse_ref
                rel = ((out - ref).norm() / ref.norm()).item()
                dense_us, bf16_us = base[m]
                row = {"M": m, "N": n, "K": k, "kind": kind, "density": density, "pattern": pattern, "nnz": nnz,
                       "entries": int(sections[0][0][0].shape[0]), "fused_us": fused_us, "dense_us": dense_us,
                       "unfused_us": unfused_us, "unfused_captured": captured, "bf16_us": bf16_us, "rel_err": rel,
                       "copies": copies}
                rows.append(row)
                print(f"M={m:3d} {n:5d}x{k:<5d} {pattern:9s} {100 * density:4.1f}%: fused {fused_us:7.1f}  dense "
                      f"{dense_us:7.1f}  unfused {unfused_us:7.1f}{'' if captured else '(eager)'}  bf16 {bf16_us:7.1f} us"
                      f"  | unfused/fused {unfused_us / fused_us:5.2f}  fused/dense {fused_us / dense_us:5.2f}"
                      f"  bf16/fused {bf16_us / fused_us:5.2f}  rel err {rel:.1e}", flush=True)
            del sections
            torch.cuda.empty_cache()
    return rows


# -- summary -------------------------------------------------------------------------------------------
def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def targets(rows) -> list[str]:
    """Issue 8's speed targets at 1 % outliers, M = 8 and 16, geometric mean over the shapes."""
    lines = []
    for pattern in sorted({r["pattern"] for r in rows}):
        for m in (8, 16):
            sel = [r for r in rows if r["M"] == m and r["density"] == 0.01 and r["pattern"] == pattern]
            if not sel:
                continue
            checks = [("unfused / fused", geomean(r["unfused_us"] / r["fused_us"] for r in sel), ">=", 1.3),
                      ("fused / dense-only", geomean(r["fused_us"] / r["dense_us"] for r in sel), "<=", 1.15),
                      ("bf16 / fused", geomean(r["bf16_us"] / r["fused_us"] for r in sel), ">=", 2.5)]
            for what, got, op, need in checks:
                ok = got >= need if op == ">=" else got <= need
                lines.append(f"{'MET   ' if ok else 'MISSED'} M={m:2d} 1% {pattern:9s} {what} = {got:.3f} "
                             f"(want {op} {need}; geomean of {len(sel)} shapes)")
    bad = [r for r in rows if not r["rel_err"] <= 1e-3]
    lines.append(f"{'MET   ' if not bad else 'MISSED'} correctness: fused within 1e-3 of dense + sparse reference at "
                 f"{len(rows) - len(bad)} of {len(rows)} points" + (f" (worst {max(r['rel_err'] for r in bad):.1e})" if bad else ""))
    return lines


def density_curve(rows) -> list[str]:
    """Time against density at M = 16 (uniform): fused should grow more slowly than unfused."""
    lines = [f"{'N x K':>12} | " + " ".join(f"{f'{100 * d:.1f}%':>11}" for d in DENSITIES) + "   (fused us / unfused us, M=16, uniform)"]
    for n, k in SHAPES:
        sel = {r["density"]: r for r in rows if r["N"] == n and r["K"] == k and r["M"] == 16 and r["pattern"] == "uniform"}
        if sel:
            lines.append(f"{n:>5}x{k:<6} | " + " ".join(
                f"{sel[d]['fused_us']:5.1f}/{sel[d]['unfused_us']:<5.1f}" if d in sel else "   -   " for d in DENSITIES))
    return lines


def explore(kind: str, g, rep_ms: int) -> list[dict]:
    """--explore: the fused kernel's CTA shape and activation staging at the target points (six
    shapes, M = 8 and 16, 0 and 1 % uniform outliers): the 8-warp plan and, where the plan has
    one, the 16-warp plan, each with the activations staged and not, against the dense plan."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    modes = {"unstaged": cuda_ops.FUSED_STAGE_NEVER, "staged": cuda_ops.FUSED_STAGE_ALWAYS}
    rows = []
    for n, k in SHAPES:
        copies = copies_for(n * k // 2, 8)
        weights = [w4_operands(n, k, kind, g) for _ in range(copies)]
        dense, fused = dense_op(kind, n), fused_op(kind, n)
        sections = {d: [make_outliers(n, k, d, "uniform", g)[0] for _ in range(copies)] for d in (0.0, 0.01)}
        for m in (8, 16):
            x_q = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda", generator=g)
            x_scale = (torch.rand(m, device="cuda", generator=g) * 0.02 + 0.01).half()
            x_rowsum = x_q.sum(1, dtype=torch.int32)
            dense_us, _ = time_calls([lambda w=w: dense(x_q, x_scale, x_rowsum, w) for w in weights], rep_ms)
            plans = {cuda_ops.plan(m, n // 32, k // 32, sms, hopper=False, wide=w) for w in (False, True)}
            cells = []
            for p in sorted(plans, key=lambda p: p.kernel):
                for label, mode in modes.items():
                    cuda_ops.set_fused_staging(mode)
                    cuda_ops.PLAN_OVERRIDE = p
                    for d, secs in sections.items():
                        us, _ = time_calls([lambda w=w, s=s: fused(x_q, x_scale, x_rowsum, w, s) for w, s in zip(weights, secs)],
                                           rep_ms)
                        rows.append({"M": m, "N": n, "K": k, "kind": kind, "plan": p.name(), "staging": label,
                                     "density": d, "fused_us": us, "dense_us": dense_us})
                        cells.append(f"{p.name()} {label} {100 * d:.0f}%: {us:6.2f} ({us / dense_us:.2f}x)")
                    cuda_ops.PLAN_OVERRIDE = None
            cuda_ops.set_fused_staging()
            print(f"M={m:2d} {n:5d}x{k:<5d} dense {dense_us:6.2f} us | " + " | ".join(cells), flush=True)
        del weights, sections
        torch.cuda.empty_cache()
    return rows


def explore_plans(kind: str, g, rep_ms: int) -> list[str]:
    """--explore-plans: every stream plan (8-warp CTAs with 1-8 K splits, the 16-warp shapes with
    1-4) for the fused kernel at the target points (six shapes, M = 8 and 16, 1% outliers of each
    pattern), against the plan's choice; the dense kernel under its plan beside them."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lines = [f"{'M':>2} {'N x K':>11} {'pattern':9s} | {'dense':>6} | {'plan':>28} | {'best':>28} | plan / best"]
    for n, k in SHAPES:
        copies = copies_for(n * k // 2, 8)
        weights = [w4_operands(n, k, kind, g) for _ in range(copies)]
        dense, fused = dense_op(kind, n), fused_op(kind, n)
        for m in (8, 16):
            x_q = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda", generator=g)
            x_scale = (torch.rand(m, device="cuda", generator=g) * 0.02 + 0.01).half()
            x_rowsum = x_q.sum(1, dtype=torch.int32)
            dense_us, _ = time_calls([lambda w=w: dense(x_q, x_scale, x_rowsum, w) for w in weights], rep_ms)
            plans = every_stream_plan(cuda_ops.stream_tile(m))
            auto = cuda_ops.plan(m, n // 32, k // 32, sms, hopper=False, wide=True)
            for pattern in PATTERNS:
                secs = [make_outliers(n, k, 0.01, pattern, g)[0] for _ in range(copies)]
                calls = [lambda w=w, s=s: fused(x_q, x_scale, x_rowsum, w, s) for w, s in zip(weights, secs)]
                times = {}
                for p in [auto] + [p for p in plans if p != auto]:
                    cuda_ops.PLAN_OVERRIDE = p
                    times[p.name()], _ = time_calls(calls, rep_ms)
                cuda_ops.PLAN_OVERRIDE = None
                best = min(times, key=times.get)
                lines.append(f"{m:2d} {n:5d}x{k:<5d} {pattern:9s} | {dense_us:6.2f} | {auto.name():>22} {times[auto.name()]:6.2f}"
                             f" ({times[auto.name()] / dense_us:.2f}) | {best:>22} {times[best]:6.2f} ({times[best] / dense_us:.2f})"
                             f" | {times[auto.name()] / times[best]:.3f}")
                print(lines[-1], flush=True)
                del secs, calls
        del weights
        torch.cuda.empty_cache()
    return lines


def explore_summary(rows) -> list[str]:
    """Per (M, density, plan shape, staging): the geometric mean of fused / dense over the shapes
    where that choice exists, and how often it was the fastest fused choice."""
    lines = ["fused / dense-only, geometric mean over the shapes with that choice (fastest: shapes where it won)"]
    keys = sorted({(r["M"], r["density"], r["plan"].split()[0], r["staging"]) for r in rows})
    for m, d, shape, staging in keys:
        sel = [r for r in rows if (r["M"], r["density"], r["plan"].split()[0], r["staging"]) == (m, d, shape, staging)]
        wins = sum(r["fused_us"] == min(o["fused_us"] for o in rows if (o["M"], o["N"], o["K"], o["density"])
                                          == (r["M"], r["N"], r["K"], r["density"])) for r in sel)
        lines.append(f"  M={m:2d} {100 * d:.0f}% {shape:11s} {staging:9s}: {geomean(r['fused_us'] / r['dense_us'] for r in sel):.3f}"
                     f"  (fastest in {wins} of {len(sel)})")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 shapes, M in {1, 16}, 0 and 1%% uniform; sections validated")
    ap.add_argument("--targets", action="store_true", help="the issue's target points only: 6 shapes, M in {8, 16}, 0 and 1%%")
    ap.add_argument("--explore", action="store_true",
                    help="the fused kernel's CTA shapes x activation staging at the target points (no unfused, no bf16)")
    ap.add_argument("--explore-plans", action="store_true",
                    help="every stream plan (CTA shape x K splits) for the fused kernel at the target points, against "
                         "the plan's choice (no unfused, no bf16)")
    ap.add_argument("--kind", choices=["per_group", "per_channel", "w4a16"], default="per_group",
                    help="W4A8 progressive g128 or per-channel, or W4A16 with fp16 group-128 scales")
    ap.add_argument("--global-activations", action="store_true",
                    help="the W4A8 stream kernels load their activations from global memory instead of staging them "
                         "in shared memory (cuda_ops.set_stage_activations(False))")
    ap.add_argument("--json", default=None, help="write all numbers here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/sparse_dense.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(0)
    cuda_ops.set_stage_activations(not args.global_activations)
    global SPMM_DTYPE
    SPMM_DTYPE = choose_spmm_dtype()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  kind {args.kind}  "
          f"unfused SpMM in {SPMM_DTYPE}", flush=True)
    if args.explore:
        if args.kind == "w4a16":
            sys.exit("--explore times the W4A8 fused kernel: --kind per_group or per_channel")
        rows = explore(args.kind, g, 25)
        summary = explore_summary(rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "kind": args.kind, "rows": rows, "summary": summary}, f,
                          indent=1)
        print("\n" + "\n".join(summary))
        return
    if args.explore_plans:
        if args.kind == "w4a16":
            sys.exit("--explore-plans times the W4A8 fused kernel: --kind per_group or per_channel")
        lines = explore_plans(args.kind, g, 25)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "kind": args.kind, "table": lines}, f, indent=1)
        print("\n" + "\n".join(lines))
        return
    if args.quick:
        shapes, ms, densities, patterns, rep_ms = SHAPES[:2], [1, 16], [0.0, 0.01], ["uniform"], 40
    elif args.targets:
        shapes, ms, densities, patterns, rep_ms = SHAPES, [8, 16], [0.0, 0.01], PATTERNS, 25
    else:
        shapes, ms, densities, patterns, rep_ms = SHAPES, MS, DENSITIES, PATTERNS, 25
    rows = []
    for n, k in shapes:
        rows += measure_shape(n, k, ms, densities, patterns, args.kind, g, rep_ms, check=args.quick)
        torch.cuda.empty_cache()
    summary = targets(rows) + [""] + density_curve(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "kind": args.kind,
                       "staged_activations": not args.global_activations, "spmm_dtype": str(SPMM_DTYPE),
                       "rows": rows, "summary": summary}, f, indent=1)
    print("\n" + "\n".join(summary))


if __name__ == "__main__":
    main()
