"""Timelines of back-to-back small-M GEMMs (the stream kernel) on one GPU: where a call's time goes.

    python benchmarks/gemm_timeline.py [--cases N:K:M,...] [--kind per_group|per_channel] [--plan K:T:S]
                                       [--outliers DENSITY] [--json PATH]

For each case, R calls of the W4A8 GEMM, each on its own copy of the weights (as in
benchmarks/gemm.py, so every call streams from HBM), are captured in one CUDA graph, each
call with its own trace buffer (cuda_ops.set_trace: thread 0 of every CTA stamps the GPU's
global timer at entry, after the dependent-launch wait, after its warp's first chunk, after
the main loop, after the k-slice and split-K reductions and after the stores; --outliers: the
fused sparse-dense kernel instead, with that share of uniform Tile-COO outliers). After warm-up
replays, one replay is read back. Printed per case:
  * the period (time per call in the steady state) with and without the stamps, and cuBLAS
    bf16's in the same harness;
  * for the calls in the middle of the chain, the median over calls of each phase boundary,
    relative to the call's first CTA entry: first / median / last CTA, in microseconds;
  * the gaps between consecutive calls: previous call's last store -> this call's first entry,
    first entry -> last entry (how long the grid takes to get onto the GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gemm import bf16_us, copies_for, time_calls, w4_operands, w4_ops  # noqa: E402

from qoqtool.runtime import cuda_ops  # noqa: E402

STAMPS = ["entry", "waited", "first chunk", "loop done", "slices reduced", "splits reduced", "stored"]
DEFAULT_CASES = "8192:8192:1,8192:8192:16,4096:4096:1,4096:4096:16,14336:4096:16"


def timeline(n: int, k: int, m: int, kind: str, g, calls: int = 16, outliers: float = 0.0) -> dict:
    sms, hopper = cuda_ops._device_info(torch.cuda.current_device())
    plan = cuda_ops.PLAN_OVERRIDE or cuda_ops.plan(m, n // 32, k // 32, sms, hopper)
    ctas = plan.grid_tiles(m, n // 32) * plan.splits
    op = w4_ops()[kind]
    x_q = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda", generator=g)
    x_scale = (torch.rand(m, device="cuda", generator=g) + 0.5).half()
    acts = (x_q, x_scale, x_q.sum(1, dtype=torch.int32))
    copies = max(calls, copies_for(n * k // 2, m))
    weights = [w4_operands(n, k, kind, g) for _ in range(copies)]
    if outliers:  # the fused kernel, each weight copy with its own section
        from sparse_dense import fused_op, make_outliers
        fused = fused_op(kind, n)
        rowsum = acts[2] if kind == "per_channel" else None  # (the fused per-group op takes none)
        runs = [lambda w=w, s=make_outliers(n, k, outliers, "uniform", g)[0]: fused(x_q, x_scale, rowsum, w, s)
                for w in weights]
    else:
        runs = [lambda w=w: op(*acts, *w, n) for w in weights]
    plain_us = time_calls(runs)

    traces = [torch.zeros(ctas, cuda_ops.TRACE_WORDS, dtype=torch.int64, device="cuda") for _ in weights]
    for run, t in zip(runs, traces):  # warm up outside the capture
        cuda_ops.set_trace(t)
        run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for run, t in zip(runs, traces):
            cuda_ops.set_trace(t)
            run()
    cuda_ops.set_trace(None)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    stamps = [t.cpu() for t in traces]  # [ctas, words] per call, of the last replay

    starts = [int(s[:, 0].min()) for s in stamps]
    period_us = (starts[-1] - starts[1]) / (len(starts) - 2) / 1e3
    middle = range(2, len(stamps) - 2)
    phases = {}
    for j, name in enumerate(STAMPS):
        rel = [sorted(((s[:, j] - starts[i]).double() / 1e3).tolist()) for i, s in ((i, stamps[i]) for i in middle)]
        phases[name] = [statistics.median(r[0] for r in rel), statistics.median(statistics.median(r) for r in rel),
                        statistics.median(r[-1] for r in rel)]
    gap = statistics.median((starts[i] - int(stamps[i - 1][:, 6].max())) / 1e3 for i in middle)
    spread = statistics.median((int(stamps[i][:, 0].max()) - starts[i]) / 1e3 for i in middle)
    per_sm = torch.bincount((stamps[len(stamps) // 2][:, 7] & 0xFFFFFFFF).long())
    return {"N": n, "K": k, "M": m, "kind": kind, "outliers": outliers, "plan": plan.name(), "ctas": ctas, "calls": len(stamps),
            "period_us": period_us, "plain_us": plain_us, "bf16_us": bf16_us(m, n, k, g), "phases_us": phases,
            "gap_prev_store_to_entry_us": gap, "entry_spread_us": spread,
            "ctas_per_sm": [int(per_sm.min()), int(per_sm.max())]}


def report(r: dict) -> list[str]:
    fused = f" fused {100 * r['outliers']:g}%" if r.get("outliers") else ""
    lines = [f"{r['kind']}{fused} M={r['M']} {r['N']}x{r['K']}  {r['plan']}, {r['ctas']} CTAs ({r['ctas_per_sm'][0]}-"
             f"{r['ctas_per_sm'][1]} per SM): period {r['period_us']:.2f} us with stamps, {r['plain_us']:.2f} without; "
             f"bf16 {r['bf16_us']:.2f}",
             f"  previous call's last store -> first entry {r['gap_prev_store_to_entry_us']:+.2f} us; "
             f"first -> last entry {r['entry_spread_us']:.2f} us",
             "  phase boundary (us after the call's first entry): first / median / last CTA"]
    for name, (lo, med, hi) in r["phases_us"].items():
        lines.append(f"    {name:15s} {lo:7.2f} {med:7.2f} {hi:7.2f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=DEFAULT_CASES, help=f"N:K:M,... (default {DEFAULT_CASES})")
    ap.add_argument("--kind", choices=["per_group", "per_channel"], default="per_group")
    ap.add_argument("--plan", default=None, metavar="KERNEL:TILE:SPLITS",
                    help="force this plan for every case instead of cuda_ops.plan's (e.g. stream1x8:2:1)")
    ap.add_argument("--outliers", type=float, default=0.0, metavar="DENSITY",
                    help="time the fused sparse-dense kernel with this share of uniform outliers (e.g. 0.01)")
    ap.add_argument("--library", default=None, metavar="PATH.so",
                    help="the timelines of this build of the kernel library (e.g. a baseline's) instead of this checkout's")
    ap.add_argument("--json", default=None, help="write all numbers here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gemm_timeline.py needs a CUDA GPU")
    if args.library:
        cuda_ops.use_library(args.library)
    if args.plan:
        try:
            cuda_ops.PLAN_OVERRIDE = cuda_ops.Plan.parse(args.plan)
        except ValueError as e:
            ap.error(f"--plan: {e}")
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    rows = []
    for case in args.cases.split(","):
        n, k, m = (int(v) for v in case.split(":"))
        rows.append(timeline(n, k, m, args.kind, g, outliers=args.outliers))
        print("\n".join(report(rows[-1])), flush=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
