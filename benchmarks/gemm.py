"""GEMM benchmark (one GPU): our W4A8 and W8A8 kernels against cuBLAS, with the floors beside them.

    python benchmarks/gemm.py [--quick] [--explore] [--json PATH]
    python benchmarks/gemm.py --explore-stream [GROUP] [--json PATH]   stream splits vs bf16
    python benchmarks/gemm.py --explore-wgmma [--json PATH]            wgmma choices, M = 64..512
    python benchmarks/gemm.py --stage-ab [M,M,..] [--json PATH]        stream activations: global vs staged
    python benchmarks/gemm.py --explore-wide [--json PATH]             16-warp stream CTAs vs the plan
    python benchmarks/gemm.py --explore-plans [N:K,...] [--json PATH]  every stream plan vs the plan
    python benchmarks/gemm.py --graph-length [--json PATH]             small M against the calls per graph

For M in {1, 16, 64, 256, 1024, 4096, 8192} x (N, K) in the five shapes of issue 4:
  w4a8 per-group (QoQ progressive, g128), w4a8 per-channel, w8a8 (ours),
  bf16 torch.matmul (cuBLAS), INT8 torch._int_mm (cuBLASLt; it needs M > 16, so M <= 16
  is timed at M = 17 and marked so).
Timing: one CUDA graph holds R calls of an op, each on its own copy of the weights (for
small M the copies span more than twice the 60 MB L2, so every call streams its weights
from HBM, as in a real forward pass); triton.testing.do_bench replays it (median) and
the time per call is the replay time / R. Activations are shared (they are small and a
real layer finds them in L2 too).
Floors: max(bytes / 4.2 TB/s, ops / INT8 rate), bytes = packed weights + activations +
output, the INT8 rate = the best torch._int_mm rate measured in this run. --explore also
times each kernel choice for mid-sized M (what cuda_ops.plan picks between).
--explore-stream times, against cuBLAS bf16 in the same run: every GEMM kernel with and
without programmatic dependent launch; a decode step's rmsnorm_quantize + GEMM pair; the
stream kernel's split counts for M in {1, 8, 16, 32} on four shapes (is the plan's the best?);
and a line fit time = fixed + bytes / rate at M = 1 for ours and cuBLAS.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from qoqtool.runtime import cuda_ops

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (8192, 8192), (14336, 4096)]  # (N, K)
MS = [1, 16, 64, 256, 1024, 4096, 8192]
HBM_BYTES_PER_S = 4.2e12
L2_BYTES = 60e6
GROUP = 128


def copies_for(weight_bytes: int, m: int) -> int:
    """Weight copies per graph: > 2x L2 while weights dominate, else just enough to average."""
    if m >= 1024:
        return 2
    return max(4, min(32, math.ceil(2.5 * L2_BYTES / weight_bytes)))


def time_calls(calls) -> float:
    """Microseconds per call: all calls captured in one CUDA graph, replayed under do_bench."""
    for f in calls:  # warm up outside the capture (library load, cuBLAS handles, workspaces)
        f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in calls:
            f()
    from triton.testing import do_bench  # (triton comes with torch's CUDA builds: imported here, --help works anywhere)

    ms = do_bench(graph.replay, warmup=25, rep=100, return_mode="median")
    return ms * 1e3 / len(calls)


def bf16_calls(m: int, n: int, k: int, g) -> list:
    """cuBLAS bf16 (torch.matmul) on [m, k] x [n, k]^T, one call per weight copy (copies_for)."""
    xb = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(copies_for(n * k * 2, m))]
    return [lambda w=w: torch.matmul(xb, w.t()) for w in wb]


def bf16_us(m: int, n: int, k: int, g) -> float:
    """cuBLAS bf16 (bf16_calls), timed like our kernels (time_calls)."""
    return time_calls(bf16_calls(m, n, k, g))


def without_and_with_dependent_launch(calls) -> tuple[float, float]:
    """time_calls(calls) with programmatic dependent launch off, then on (left on, the default)."""
    times = []
    for enabled in (False, True):
        cuda_ops.set_dependent_launch(enabled)
        times.append(time_calls(calls))
    cuda_ops.set_dependent_launch(True)
    return times[0], times[1]


def time_with_plan(plan, calls) -> float:
    """time_calls(calls) with cuda_ops.PLAN_OVERRIDE = plan (the plan's own choice again after)."""
    cuda_ops.PLAN_OVERRIDE = plan
    try:
        return time_calls(calls)
    finally:
        cuda_ops.PLAN_OVERRIDE = None


def line_fit(points) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y = intercept + slope * x through [(x, y), ...]."""
    x = torch.tensor([a for a, _ in points], dtype=torch.float64)
    y = torch.tensor([b for _, b in points], dtype=torch.float64)
    slope = ((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()
    return float(y.mean() - slope * x.mean()), float(slope)


def rand_u8(shape, lo, hi, g):
    return torch.randint(lo, hi + 1, shape, dtype=torch.uint8, device="cuda", generator=g)


def w4_operands(n, k, kind, g, group=GROUP):
    """Random packed operands; values kept in the kernels' contract (s1 <= 16, z*s1 <= 128)."""
    nt, kt = n // 32, k // 32
    qweight = rand_u8((nt, kt, 32, 16), 0, 255, g)
    scale = (torch.rand(n, device="cuda", generator=g) * 1e-3 + 1e-4).half()
    if kind == "per_group":
        groups = k // group
        return qweight, scale, rand_u8((nt, groups, 32), 1, 8, g), rand_u8((nt, groups, 32), 0, 64, g)
    return qweight, scale, rand_u8((n,), 0, 15, g)


def w8_operands(n, k, g):
    """Random W8A8 operands: INT8 weights in the packed tile order, fp16 row scales."""
    return (torch.randint(-127, 128, (n // 32, k // 32, 32, 32), dtype=torch.int8, device="cuda", generator=g),
            (torch.rand(n, device="cuda", generator=g) * 1e-3).half())


def measure_shape(n: int, k: int, m: int, g) -> dict:
    row = {"M": m, "N": n, "K": k}
    w4_bytes = n * k // 2
    copies = copies_for(w4_bytes, m)
    x_q = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda", generator=g)
    x_scale = (torch.rand(m, device="cuda", generator=g) + 0.5).half()
    x_rowsum = x_q.sum(1, dtype=torch.int32)

    pg = [w4_operands(n, k, "per_group", g) for _ in range(copies)]
    row["per_group_us"] = time_calls([lambda w=w: per_group(x_q, x_scale, x_rowsum, *w, n) for w in pg])
    del pg
    pc = [w4_operands(n, k, "per_channel", g) for _ in range(copies)]
    row["per_channel_us"] = time_calls(
        [lambda w=w: torch.ops.qoqtool.w4a8_gemm_per_channel(x_q, x_scale, x_rowsum, *w, n) for w in pc])
    del pc

    copies8 = copies_for(n * k, m)
    w8 = [w8_operands(n, k, g) for _ in range(copies8)]
    row["w8a8_us"] = time_calls([lambda w=w: torch.ops.qoqtool.w8a8_gemm(x_q, x_scale, *w, n) for w in w8])
    # cuBLAS INT8 on the same bytes: _int_mm wants the weight column-major ([K, N] view of [N, K]).
    m8 = max(m, 17)
    a8 = torch.randint(-127, 128, (m8, k), dtype=torch.int8, device="cuda", generator=g)
    row["int_mm_M"] = m8
    row["int_mm_us"] = time_calls([lambda w=w: torch._int_mm(a8, w[0].view(n, k).t()) for w in w8])
    del w8

    row["bf16_us"] = bf16_us(m, n, k, g)

    row["bytes_w4"] = w4_bytes + 2 * n + m * k + 2 * m + 2 * m * n + (2 * n * k // GROUP)
    row["ops"] = 2 * m * n * k
    return row


def explore(g) -> list[dict]:
    """Each kernel choice (per-group, square shapes) for a few M: what the plan weighs."""
    out = []
    sms, hopper = cuda_ops._device_info(torch.cuda.current_device())
    cases = [(m, 4096) for m in (1, 16)] + [(m, 8192) for m in (1, 16, 32, 64, 128, 256, 512)]
    for m, n in cases:
        k = n
        x_q = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda", generator=g)
        x_scale = (torch.rand(m, device="cuda", generator=g) + 0.5).half()
        x_rowsum = x_q.sum(1, dtype=torch.int32)
        weights = [w4_operands(n, k, "per_group", g) for _ in range(copies_for(n * k // 2, m))]
        auto = cuda_ops.plan(m, n // 32, k // 32, sms, hopper)
        if m <= 16:
            choices = {auto} | {cuda_ops.Plan(cuda_ops.STREAM, auto.tile, s) for s in (1, 2, 4)}
        else:
            choices = {auto, cuda_ops.Plan(cuda_ops.STREAM, 8, 1), cuda_ops.Plan(cuda_ops.STREAM, 8, 2)}
        if hopper and m > 16:
            choices |= {cuda_ops.Plan(cuda_ops.WGMMA, 1, 1), cuda_ops.Plan(cuda_ops.WGMMA, 1, 2),
                        cuda_ops.Plan(cuda_ops.WGMMA, 2, 1), cuda_ops.Plan(cuda_ops.WGMMA, 2, 2)}
        for p in sorted(choices, key=lambda p: (p.kernel, p.tile, p.splits)):
            us = time_with_plan(p, [lambda w=w: per_group(x_q, x_scale, x_rowsum, *w, n) for w in weights])
            name = f"{'wgmma' if p.kernel else 'stream'} tile={p.tile} splits={p.splits}"
            out.append({"M": m, "N": n, "K": k, "plan": name, "auto": p == auto, "us": us})
            print(f"  explore M={m:5d} {n}x{k} {name:28s} {us:9.1f} us{'  <- plan' if p == auto else ''}", flush=True)
    return out


SMALL_SHAPES = [(8192, 8192), (4096, 4096), (14336, 4096), (4096, 14336)]  # (N, K)
SMALL_MS = [1, 8, 16, 32]


def per_group(x_q, x_scale, x_rowsum, *weights_and_n):
    """The per-group op with the activations' row sums (its option; what a packed model passes):
    called as the per-channel op is, (x_q, x_scale, x_rowsum, weight operands..., N)."""
    return torch.ops.qoqtool.w4a8_gemm_per_group(x_q, x_scale, *weights_and_n, x_rowsum=x_rowsum)


def w4_ops() -> dict:
    """The W4A8 GEMM ops by kind, both called with (x_q, x_scale, x_rowsum, weight operands..., N)."""
    return {"per_group": per_group, "per_channel": torch.ops.qoqtool.w4a8_gemm_per_channel}


def w4_calls(kind: str, acts: tuple, n: int, k: int, m: int, g, group: int = GROUP) -> list:
    """Our W4A8 GEMM of `kind` on the activation operands `acts` (small_m_cases), one call per
    weight copy (copies_for), each call bound to its own op and copy."""
    op = w4_ops()[kind]
    weights = [w4_operands(n, k, kind, g, group) for _ in range(copies_for(n * k // 2, m))]
    return [lambda w=w: op(*acts, *w, n) for w in weights]


def small_m_cases(g, ms=SMALL_MS, shapes=SMALL_SHAPES):
    """For `shapes` (default the four small ones) x `ms`: (N, K, M, the activation operands
    (x_q, x_scale, x_rowsum), cuBLAS bf16 us in this run, the plan's choice)."""
    sms, hopper = cuda_ops._device_info(torch.cuda.current_device())
    for n, k in shapes:
        for m in ms:
            x_q = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda", generator=g)
            x_scale = (torch.rand(m, device="cuda", generator=g) + 0.5).half()
            acts = (x_q, x_scale, x_q.sum(1, dtype=torch.int32))  # both kinds' activation operands (w4_ops)
            yield n, k, m, acts, bf16_us(m, n, k, g), cuda_ops.plan(m, n // 32, k // 32, sms, hopper)


def explore_stream(g, group: int = GROUP) -> list[dict]:
    """The stream kernel's split counts for M <= 32, both W4 kinds, with cuBLAS bf16 in the same
    run: whether the plan's choice is the best one."""
    op = w4_ops()
    rows = []
    for n, k, m, acts, bf16, auto in small_m_cases(g):
        plans = [auto] + [cuda_ops.Plan(cuda_ops.STREAM, auto.tile, s) for s in (1, 2, 4, 8)]
        for kind in op:
            calls = w4_calls(kind, acts, n, k, m, g, group)
            for p in dict.fromkeys(plans):
                us = time_with_plan(p, calls)
                rows.append({"kind": kind, "M": m, "N": n, "K": k, "tile": p.tile, "splits": p.splits,
                             "plan": p.name(), "auto": p == auto, "us": us, "bf16_us": bf16})
                print(f"  {kind:11s} M={m:2d} {n}x{k} {p.name():26s} {us:7.2f} us  bf16 {bf16:7.2f}  "
                      f"{bf16 / us:5.2f}x{'  <- plan' if p == auto else ''}", flush=True)
            del calls
            torch.cuda.empty_cache()
    return rows


def mode_ab(g, modes: dict, ms=SMALL_MS, group: int = GROUP) -> tuple[list[dict], list[str]]:
    """The stream kernel under each of `modes` ({name: function that sets it}, the first the
    baseline; each mode is left set after its timing, so the last should restore the
    default), for every split count in {1, 2, 3, 4, 6, 8} and the plan's, for each M of `ms`
    on four shapes, both W4 kinds: the modes timed back to back for each choice, cuBLAS bf16
    in the same run. Where the plan picks another kernel (wgmma at M > 32, a 16-warp stream shape),
    it is timed once as the plan."""
    op = w4_ops()
    names = list(modes)
    rows, table = [], [f"us: the plan under {names[0]}, the best over splits [splits] per mode; x = bf16 / us",
                       f"{'kind':11s} {'M':>2} {'N x K':>11} | {'bf16':>6} | {'plan':>14} | "
                       + " | ".join(f"{n + ' best':>17}" for n in names) + f" | plan / best {names[-1]}"]
    for n, k, m, acts, bf16, auto in small_m_cases(g, ms):
        for kind in op:
            calls = w4_calls(kind, acts, n, k, m, g, group)
            best, plan_us = {}, None
            if auto.kernel != cuda_ops.STREAM:
                modes[names[0]]()
                plan_us = time_calls(calls)
            for splits in sorted({1, 2, 3, 4, 6, 8} | ({auto.splits} if auto.kernel == cuda_ops.STREAM else set())):
                choice = cuda_ops.Plan(cuda_ops.STREAM, cuda_ops.stream_tile(m), splits)
                is_plan = auto == choice
                for mode in names:
                    modes[mode]()
                    us = time_with_plan(choice, calls)
                    rows.append({"kind": kind, "M": m, "N": n, "K": k, "tile": cuda_ops.stream_tile(m),
                                 "splits": splits, "mode": mode, "us": us, "bf16_us": bf16, "plan": is_plan})
                    if mode not in best or us < best[mode][0]:
                        best[mode] = (us, splits)
                    if mode == names[0] and is_plan:
                        plan_us = us
            if auto.kernel != cuda_ops.STREAM:
                rows.append({"kind": kind, "M": m, "N": n, "K": k, "plan_name": auto.name(), "us": plan_us,
                             "bf16_us": bf16, "plan": True, "mode": "plan"})
            cells = [f"{plan_us:6.2f} ({bf16 / plan_us:.2f}x)"] + [
                f"{best[md][0]:6.2f} [{best[md][1]}] {bf16 / best[md][0]:.2f}x" for md in names]
            table.append(f"{kind:11s} {m:2d} {n:>5}x{k:<5} | {bf16:6.2f} | " + " | ".join(cells)
                         + f" | {plan_us / best[names[-1]][0]:.3f}")
            print(table[-1], flush=True)
            del calls
            torch.cuda.empty_cache()
    return rows, table


# The shapes whose row tiles make no whole wave of the stream kernel's CTAs on 132 SMs: the
# other Llama-2-7B MLP shapes and the Qwen2.5-14B shapes of benchmarks/sparse_dense.py.
PLAN_SHAPES = [(11008, 4096), (4096, 11008), (14336, 4096), (5120, 5120), (13824, 5120), (5120, 13824)]


def every_stream_plan(tile: int) -> list:
    """The 8-warp CTAs with 1-8 K splits and the 16-warp shapes with 1-4, `tile` token blocks."""
    plans = [cuda_ops.Plan(cuda_ops.STREAM, tile, s) for s in (1, 2, 3, 4, 6, 8)]
    return plans + wide_stream_plans(tile, (1, 2, 3, 4))


def wide_stream_plans(tile: int, splits=(1, 2, 4)) -> list:
    """The 16-warp CTA shapes (1 x 16 and 2 x 8 row tiles x k-slices, one CTA per SM)."""
    return [cuda_ops.Plan(kernel, tile, s) for kernel in (cuda_ops.STREAM_1X16, cuda_ops.STREAM_2X8) for s in splits]


def explore_plans(g, shapes=PLAN_SHAPES, ms=(1, 8, 16), candidates=every_stream_plan) -> tuple[list[dict], list[str]]:
    """The stream-kernel plans `candidates(tile)` (default every one) against the plan's choice,
    for M in `ms` on `shapes`, both W4 kinds; cuBLAS bf16 in the same run. Where the plan is not
    the best, by how much."""
    op = w4_ops()
    rows, table = [], ["us (x bf16): the plan; the best of the other plans",
                       f"{'kind':11s} {'M':>2} {'N x K':>11} | {'bf16':>6} | {'plan':>30} | {'best':>30} | plan / best"]
    for n, k, m, acts, bf16, auto in small_m_cases(g, ms, shapes):
        plans = candidates(cuda_ops.stream_tile(m))
        for kind in op:
            calls = w4_calls(kind, acts, n, k, m, g)
            plan_us = time_calls(calls)
            best = (plan_us, auto.name())
            for p in plans:
                if p == auto:
                    continue
                us = time_with_plan(p, calls)
                rows.append({"kind": kind, "M": m, "N": n, "K": k, "plan": p.name(), "us": us, "bf16_us": bf16})
                best = min(best, (us, p.name()))
            rows.append({"kind": kind, "M": m, "N": n, "K": k, "plan": auto.name(), "us": plan_us, "bf16_us": bf16,
                         "auto": True})
            table.append(f"{kind:11s} {m:2d} {n:>5}x{k:<5} | {bf16:6.2f} | {auto.name():>22} {plan_us:6.2f} ({bf16 / plan_us:.2f}x) | "
                         f"{best[1]:>22} {best[0]:6.2f} ({bf16 / best[0]:.2f}x) | {plan_us / best[0]:.3f}")
            print(table[-1], flush=True)
            del calls
            torch.cuda.empty_cache()
    return rows, table


def graph_length(g, repeats=(1, 4, 8), ms=(1, 16)) -> tuple[list[dict], list[str]]:
    """How much of a small-M call's time is the harness's: the same calls (each on its own
    weight copy, the copies spanning > 2x L2) captured once per graph as in the table, then
    repeated `repeats` times in one graph, for cuBLAS bf16 and ours (both W4 kinds). The
    graph's own launch and the first call's start without an overlap are paid once per replay,
    so longer graphs approach the steady state that back-to-back layers see."""
    rows, table = [], ["us per call (x = bf16 / ours) for graphs of R x the table's calls",
                       f"{'M':>2} {'N x K':>11} {'copies':>6} | " + " | ".join(
                           f"R={r}: {'bf16':>6} {'g128':>6} {'chn':>6} (bf16 / g128, / chn)" for r in repeats)]
    for n, k, m, acts, _, _ in small_m_cases(g, ms, SMALL_SHAPES):
        bf16 = bf16_calls(m, n, k, g)
        ours = {kind: w4_calls(kind, acts, n, k, m, g) for kind in w4_ops()}
        cells = []
        for r in repeats:
            t = {"bf16": time_calls(bf16 * r), **{kind: time_calls(calls * r) for kind, calls in ours.items()}}
            rows.append({"M": m, "N": n, "K": k, "repeats": r, "copies": len(ours["per_group"]), **{f"{a}_us": b for a, b in t.items()}})
            cells.append(f"R={r}: {t['bf16']:6.2f} {t['per_group']:6.2f} {t['per_channel']:6.2f}"
                         f" ({t['bf16'] / t['per_group']:.2f}x / {t['bf16'] / t['per_channel']:.2f}x)")
        table.append(f"{m:2d} {n:>5}x{k:<5} {len(ours['per_group']):6d} | " + " | ".join(cells))
        print(table[-1], flush=True)
        del bf16, ours
        torch.cuda.empty_cache()
    return rows, table


def fixed_and_rate(g, n: int = 8192, ks=(2048, 4096, 8192, 16384, 32768)) -> list[str]:
    """M = 1 on N x K for growing K, ours (per-group, the plan) and cuBLAS bf16: a least-squares
    line time = fixed + bytes / rate splits each into a fixed cost per call and a streaming rate."""
    sms, hopper = cuda_ops._device_info(torch.cuda.current_device())
    pts = {"per_group": [], "bf16": []}
    for k in ks:
        x_q = torch.randint(-127, 128, (1, k), dtype=torch.int8, device="cuda", generator=g)
        x_scale = (torch.rand(1, device="cuda", generator=g) + 0.5).half()
        weights = [w4_operands(n, k, "per_group", g) for _ in range(copies_for(n * k // 2, 1))]
        us = time_calls([lambda w=w: torch.ops.qoqtool.w4a8_gemm_per_group(x_q, x_scale, *w, n) for w in weights])
        pts["per_group"].append((n * k // 2 + 2 * n * k // GROUP, us))
        del weights
        pts["bf16"].append((2 * n * k, bf16_us(1, n, k, g)))
        torch.cuda.empty_cache()
    lines = [f"M = 1, N = {n}, K in {list(ks)}: time = fixed + bytes / rate (least squares)"]
    for name, p in pts.items():
        fixed, slope = line_fit(p)
        lines.append(f"  {name:9s} fixed {fixed:6.2f} us, rate {1e-6 / slope:5.2f} TB/s; "
                     + ", ".join(f"{x / 1e6:.1f} MB {y:.2f} us" for x, y in p))
    return lines


def dependent_launch_ab(g) -> list[str]:
    """Each GEMM kernel under the plan, with and without programmatic dependent launch
    (cuda_ops.set_dependent_launch), cuBLAS bf16 in the same run: the stream kernel (W4A8 g128,
    M = 1 and 16, the four small shapes), the W4A16 stream kernel (M = 1, 16) and the wgmma
    kernel (W4A8 g128, M = 64, 256) on 4096x4096 and 8192x8192."""
    cases = [("w4a8", m, n, k) for n, k in SMALL_SHAPES for m in (1, 16)]
    cases += [(kind, m, n, k) for n, k in SMALL_SHAPES[:2] for kind, ms in (("w4a16", (1, 16)), ("w4a8", (64, 256)))
              for m in ms]
    lines = ["us (x bf16) without / with programmatic dependent launch; W4A8 per-group g128, W4A16 g128",
             f"{'kind':5s} {'M':>3} {'N x K':>11} | {'bf16':>7} | {'plain':>12} {'dependent':>12}"]
    for kind, m, n, k in cases:
        bf16 = bf16_us(m, n, k, g)
        if kind == "w4a8":
            x_q = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda", generator=g)
            x_scale = (torch.rand(m, device="cuda", generator=g) + 0.5).half()
            weights = [w4_operands(n, k, "per_group", g) for _ in range(copies_for(n * k // 2, m))]
            call = lambda w: torch.ops.qoqtool.w4a8_gemm_per_group(x_q, x_scale, *w, n)  # noqa: E731
        else:
            x = (torch.randn(m, k, device="cuda", generator=g) * 0.1).half()
            nt, groups = n // 32, k // GROUP
            weights = [(rand_u8((nt, k // 32, 32, 16), 0, 255, g),
                        (torch.rand(nt, groups, 32, device="cuda", generator=g) * 1e-2).half(),
                        rand_u8((nt, groups, 32), 0, 15, g)) for _ in range(copies_for(n * k // 2, m))]
            call = lambda w: torch.ops.qoqtool.w4a16_gemm(x, *w, n)  # noqa: E731
        times = without_and_with_dependent_launch([lambda w=w: call(w) for w in weights])
        cells = [f" {us:6.2f}({bf16 / us:.2f})" for us in times]
        del weights
        torch.cuda.empty_cache()
        lines.append(f"{kind:5s} {m:3d} {n:>5}x{k:<5} | {bf16:7.2f} |" + "".join(cells))
        print(lines[-1], flush=True)
    return lines


def decode_chain(g) -> list[str]:
    """A decode step's pattern at M = 1 on the four small shapes: rmsnorm_quantize, then the
    per-group GEMM, R times in one CUDA graph (each GEMM on its own weight copy), with and
    without programmatic dependent launch: how much of a GEMM's start the quantize kernel hides."""
    lines = ["rmsnorm_quantize + W4A8 g128 GEMM, M = 1: us per pair without / with dependent launch"]
    for n, k in SMALL_SHAPES:
        x = torch.randn(1, k, device="cuda", generator=g).half()
        norm = torch.rand(k, device="cuda", generator=g).half()
        weights = [w4_operands(n, k, "per_group", g) for _ in range(copies_for(n * k // 2, 1))]

        def pair(w):
            x_q, x_scale, _ = torch.ops.qoqtool.rmsnorm_quantize(x, norm, 1e-5, k)
            return torch.ops.qoqtool.w4a8_gemm_per_group(x_q, x_scale, *w, n)

        cells = without_and_with_dependent_launch([lambda w=w: pair(w) for w in weights])
        del weights
        torch.cuda.empty_cache()
        lines.append(f"  {n:>5}x{k:<5}  {cells[0]:6.2f}  {cells[1]:6.2f}  ({cells[0] - cells[1]:+.2f})")
        print(lines[-1], flush=True)
    return lines


WGMMA_SHAPES = [(4096, 4096), (8192, 8192), (14336, 4096), (4096, 11008)]  # (N, K)
WGMMA_MS = [64, 128, 256, 512]


def explore_wgmma(g, cases: list[tuple[int, int, int]] | None = None, kind: str = "per_group") -> tuple[list[dict], list[str]]:
    """The wgmma kernel for mid-sized M: every warpgroup count x split count (what cuda_ops.plan
    picks between), per-group g128 (or `kind`), cuBLAS bf16 and torch._int_mm in the same run;
    then a line fit over K (M = 128, N = 4096, one warpgroup, unsplit) of time = fixed + stages x
    cost. `cases` (M, N, K): only these, and no line fit."""
    op = w4_ops()[kind]
    sms, hopper = cuda_ops._device_info(torch.cuda.current_device())
    fit_line = cases is None
    cases = cases or [(m, n, k) for n, k in WGMMA_SHAPES for m in WGMMA_MS]
    rows = []
    for m, n, k in cases:
        x_q = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda", generator=g)
        x_scale = (torch.rand(m, device="cuda", generator=g) + 0.5).half()
        x_rowsum = x_q.sum(1, dtype=torch.int32)
        weights = [w4_operands(n, k, kind, g) for _ in range(copies_for(n * k // 2, m))]
        bf16 = bf16_us(m, n, k, g)
        w8 = [torch.randint(-127, 128, (k, n), dtype=torch.int8, device="cuda", generator=g).t().contiguous().t()
              for _ in range(copies_for(n * k, m))]
        int_mm = time_calls([lambda w=w: torch._int_mm(x_q, w) for w in w8])
        del w8
        auto = cuda_ops.plan(m, n // 32, k // 32, sms, hopper)
        forms = ((cuda_ops.WGMMA, 1), (cuda_ops.WGMMA, 2), (cuda_ops.WGMMA_K2, 1), (cuda_ops.WGMMA_K2_T64, 1),
                 (cuda_ops.WGMMA_M64, 3))
        plans = [auto] + [cuda_ops.Plan(form, tile, s) for form, tile in forms for s in (1, 2, 3, 4, 8)]
        plans = [p for p in plans if p.splits <= p.max_splits(math.ceil(k / 32))]
        for p in dict.fromkeys(plans):
            us = time_with_plan(p, [lambda w=w: op(x_q, x_scale, x_rowsum, *w, n) for w in weights])
            rows.append({"M": m, "N": n, "K": k, "kind": kind, "plan": p.name(), "tile": p.tile, "splits": p.splits,
                         "auto": p == auto, "us": us, "bf16_us": bf16, "int_mm_us": int_mm})
            print(f"  M={m:4d} {n:>5}x{k:<5} {p.name():26s} {us:8.2f} us  bf16 {bf16:7.2f} ({bf16 / us:4.2f}x)  "
                  f"int_mm {int_mm:7.2f} ({int_mm / us:4.2f}x){'  <- plan' if p == auto else ''}", flush=True)
        del weights
        torch.cuda.empty_cache()
    lines = [f"wgmma kernel, {kind} (g{GROUP}): plan's choice and the best of 1-2 warpgroups (or the K2 form, 128 or 64 "
             "tokens, or three 64-row warpgroups) x 1-8 splits",
             f"{'M':>4} {'N x K':>11} | {'bf16':>7} {'int_mm':>7} | {'plan':>26} {'us':>7} | {'best':>26} {'us':>7} | best/bf16"]
    for m, n, k in cases:
        rs = [r for r in rows if (r["M"], r["N"], r["K"]) == (m, n, k)]
        auto, best = next(r for r in rs if r["auto"]), min(rs, key=lambda r: r["us"])
        lines.append(f"{m:4d} {n:>5}x{k:<5} | {auto['bf16_us']:7.2f} {auto['int_mm_us']:7.2f} | {auto['plan']:>26} "
                     f"{auto['us']:7.2f} | {best['plan']:>26} {best['us']:7.2f} | {auto['bf16_us'] / best['us']:.2f}x")
    if not fit_line:
        return rows, lines
    # Fixed cost and cost per 128-wide pipeline stage of one CTA.
    m, n, pts = 128, 4096, []
    x_q = torch.randint(-127, 128, (m, 8192), dtype=torch.int8, device="cuda", generator=g)
    x_scale = (torch.rand(m, device="cuda", generator=g) + 0.5).half()
    for k in (512, 1024, 2048, 4096, 8192):
        weights = [w4_operands(n, k, "per_group", g) for _ in range(copies_for(n * k // 2, m))]
        xk = x_q[:, :k].contiguous()
        rk = xk.sum(1, dtype=torch.int32)
        pts.append((k // 128, time_with_plan(cuda_ops.Plan(cuda_ops.WGMMA, 1, 1),
                                             [lambda w=w: per_group(xk, x_scale, rk, *w, n)
                                              for w in weights])))
        del weights
    fixed, slope = line_fit(pts)
    lines += ["", f"wgmma, 1 warpgroup, unsplit, M = {m}, N = {n}: time = {fixed:.2f} us + "
              f"stages x {slope:.3f} us; " + ", ".join(f"{x} stages {y:.2f} us" for x, y in pts)]
    return rows, lines


def summarize_stream(rows: list[dict]) -> list[str]:
    """Per kind, M and shape: the plan's time and the best split count, as ratios to bf16."""
    lines = [f"{'kind':11s} {'M':>2} {'N x K':>11} | {'bf16':>7} {'plan':>7} {'best':>7} | {'plan x':>6} {'best x':>6}  best"]
    for key in dict.fromkeys((r["kind"], r["M"], r["N"], r["K"]) for r in rows):
        sel = [r for r in rows if (r["kind"], r["M"], r["N"], r["K"]) == key]
        a, b = next(r for r in sel if r["auto"]), min(sel, key=lambda r: r["us"])
        lines.append(f"{key[0]:11s} {key[1]:2d} {key[2]:>5}x{key[3]:<5} | {a['bf16_us']:7.2f} {a['us']:7.2f} {b['us']:7.2f} |"
                     f" {a['bf16_us'] / a['us']:6.2f} {b['bf16_us'] / b['us']:6.2f}  {b['plan']}")
    return lines


def fused(g) -> list[dict]:
    rows = []
    k = 4096
    weight = torch.rand(k, device="cuda", generator=g).half()
    for m in (1, 16, 4096):
        x = torch.randn(m, k, device="cuda", generator=g).half()
        up = torch.randn(m, k, device="cuda", generator=g).half()
        for name, f in (("quantize_per_token", lambda: torch.ops.qoqtool.quantize_per_token(x, k)),
                        ("rmsnorm_quantize", lambda: torch.ops.qoqtool.rmsnorm_quantize(x, weight, 1e-5, k)),
                        ("silu_mul_quantize", lambda: torch.ops.qoqtool.silu_mul_quantize(x, up, k))):
            us = time_calls([f] * 8)
            bytes_moved = m * k * (2 + 1) + (m * k * 2 if name == "silu_mul_quantize" else 0)
            rows.append({"op": name, "M": m, "K": k, "us": us, "GBps": bytes_moved / us / 1e3})
            print(f"  {name:20s} M={m:5d} K={k}: {us:7.2f} us  {bytes_moved / us / 1e3:8.1f} GB/s", flush=True)
    return rows


def summarize(rows: list[dict]) -> list[str]:
    int8_rate = max(r["ops"] / (r["int_mm_us"] * 1e-6) * r["int_mm_M"] / r["M"] for r in rows if r["M"] >= 4096)
    lines = [f"INT8 rate for the floors (best torch._int_mm here): {int8_rate / 1e12:.0f} TOP/s; HBM 4.2 TB/s",
             "",
             f"{'M':>5} {'N x K':>12} | {'bf16':>8} {'int_mm':>8} | {'w4 g128':>8} {'w4 chn':>8} {'w8a8':>8} |"
             f" {'g128/bf16':>9} {'chn/bf16':>8} {'g128/int8':>9} {'w8/int8':>8} | {'floor':>7} {'g128 eff':>8}"]
    for r in rows:
        floor = max(r["bytes_w4"] / HBM_BYTES_PER_S, r["ops"] / int8_rate) * 1e6
        r["floor_us"] = floor
        int_mm = f"{r['int_mm_us']:8.1f}" + ("*" if r["int_mm_M"] != r["M"] else " ")
        lines.append(
            f"{r['M']:5d} {r['N']:>5}x{r['K']:<6} | {r['bf16_us']:8.1f} {int_mm}| {r['per_group_us']:8.1f}"
            f" {r['per_channel_us']:8.1f} {r['w8a8_us']:8.1f} | {r['bf16_us'] / r['per_group_us']:9.2f}"
            f" {r['bf16_us'] / r['per_channel_us']:8.2f} {r['int_mm_us'] / r['per_group_us']:9.2f}"
            f" {r['int_mm_us'] / r['w8a8_us']:8.2f} | {floor:7.1f} {floor / r['per_group_us']:8.0%}")
    lines.append("(* torch._int_mm needs M > 16: timed at M = 17)")
    return lines


def targets(rows: list[dict]) -> list[str]:
    """The speed targets of issue 4, each with its measured worst case."""
    def worst(pred, key, base):
        sel = [r for r in rows if pred(r)]
        return min(r[base] / r[key] for r in sel) if sel else float("nan")

    checks = []
    for kind in ("per_group", "per_channel"):
        us = f"{kind}_us"
        checks += [
            (f"{kind}: >= 3.5x bf16 at M <= 16 on 8192x8192", worst(lambda r: r["M"] <= 16 and r["N"] == r["K"] == 8192, us, "bf16_us"), 3.5),
            (f"{kind}: >= 2.5x bf16 at M = 16 on 4096x4096", worst(lambda r: r["M"] == 16 and r["N"] == r["K"] == 4096, us, "bf16_us"), 2.5),
            (f"{kind}: >= 1.5x bf16 at M = 256 (all shapes)", worst(lambda r: r["M"] == 256, us, "bf16_us"), 1.5),
            (f"{kind}: >= 1.2x bf16 at M >= 4096 (all shapes)", worst(lambda r: r["M"] >= 4096, us, "bf16_us"), 1.2),
            (f"{kind}: >= 1.0x torch._int_mm at M >= 4096", worst(lambda r: r["M"] >= 4096, us, "int_mm_us"), 1.0),
        ]
    return [f"{'MET   ' if got >= need else 'MISSED'} {what}: worst {got:.2f}x" for what, got, need in checks]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="M in {1, 16, 256, 4096} on two shapes only")
    ap.add_argument("--explore", action="store_true", help="also time every kernel choice for mid-sized M")
    ap.add_argument("--explore-stream", type=int, nargs="?", const=GROUP, default=None, metavar="GROUP",
                    help="only the small-M studies against bf16 (dependent launch on/off, the decode pair, "
                         "the stream kernel's split counts with group size GROUP, the line fit)")
    ap.add_argument("--explore-wgmma", nargs="?", const="", default=None, metavar="M:N:K,...",
                    help="only the wgmma kernel's choices for M in {64..512} on four shapes (or for these cases) "
                         "against bf16 and int_mm, and its fixed cost (not with cases)")
    ap.add_argument("--wgmma-kind", choices=("per_group", "per_channel"), default="per_group",
                    help="the weights --explore-wgmma times (default per_group)")
    ap.add_argument("--stage-ab", nargs="?", const="1,8,16,32", default=None, metavar="M,M,...",
                    help="only the stream kernel with activations from global memory against staged in shared memory, "
                         "every split count, for these M (default 1,8,16,32) on four shapes")
    ap.add_argument("--explore-wide", action="store_true",
                    help="only the stream kernel's 16-warp CTA shapes against the plan at M in {1, 8, 16}")
    ap.add_argument("--explore-plans", nargs="?", const="", default=None, metavar="N:K,...",
                    help="only every stream-kernel plan against the plan's choice at M in {1, 8, 16}, on shapes "
                         "whose row tiles make no whole wave (or on these)")
    ap.add_argument("--graph-length", action="store_true",
                    help="only M in {1, 16} on four shapes with the table's calls repeated 1, 4, 8 times per graph")
    ap.add_argument("--json", default=None, help="write all numbers here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gemm.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    def finish(table: list[str], **numbers) -> None:  # the studies below: their JSON, then their table
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, **numbers,
                           "table": table}, f, indent=1)
        print("\n" + "\n".join(table))

    if args.explore_wgmma is not None:
        cases = [tuple(int(v) for v in c.split(":")) for c in args.explore_wgmma.split(",") if c]
        rows, table = explore_wgmma(g, cases or None, args.wgmma_kind)
        return finish(table, explore_wgmma=rows)
    if args.stage_ab:  # activations from global memory, then staged (the default)
        modes = {"global": lambda: cuda_ops.set_stage_activations(False),
                 "staged": lambda: cuda_ops.set_stage_activations(True)}
        rows, table = mode_ab(g, modes, [int(v) for v in args.stage_ab.split(",")])
        return finish(table, mode_ab=rows)
    if args.explore_plans is not None:
        shapes = [tuple(int(v) for v in c.split(":")) for c in args.explore_plans.split(",") if c]
        rows, table = explore_plans(g, shapes or PLAN_SHAPES)
        return finish(table, explore_plans=rows)
    if args.graph_length:
        rows, table = graph_length(g)
        return finish(table, graph_length=rows)
    if args.explore_wide:  # the 16-warp shapes with 1, 2 or 4 splits against the plan
        rows, table = explore_plans(g, SMALL_SHAPES, candidates=wide_stream_plans)
        return finish(table, explore_wide=rows)
    if args.explore_stream:
        ab = dependent_launch_ab(g) + [""] + decode_chain(g)
        rows = explore_stream(g, args.explore_stream)
        table = ab + [""] + summarize_stream(rows) + [""] + fixed_and_rate(g)
        return finish(table, group=args.explore_stream, explore_stream=rows)
    shapes, ms = (SHAPES[::3], [1, 16, 256, 4096]) if args.quick else (SHAPES, MS)
    rows = []
    for n, k in shapes:
        for m in ms:
            r = measure_shape(n, k, m, g)
            rows.append(r)
            print(f"M={m:5d} N={n:6d} K={k:6d}: bf16 {r['bf16_us']:8.1f}  int_mm {r['int_mm_us']:8.1f}  "
                  f"g128 {r['per_group_us']:8.1f}  chn {r['per_channel_us']:8.1f}  w8a8 {r['w8a8_us']:8.1f} us",
                  flush=True)
            torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "gemm": rows}
    print("\nfused quantization kernels:", flush=True)
    result["fused"] = fused(g)
    if args.explore:
        print("\nkernel choices by M (per-group):", flush=True)
        result["explore"] = explore(g)
    table = summarize(rows)
    result["table"], result["targets"] = table, targets(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print("\n" + "\n".join(table + [""] + result["targets"]))


if __name__ == "__main__":
    main()
