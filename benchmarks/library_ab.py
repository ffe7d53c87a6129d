"""Two builds of the kernel library timed against each other in one process (one GPU).

    python benchmarks/library_ab.py BASELINE.so [--candidate PATH.so] [--ms 1,8,16,32] [--json PATH]

A change to the kernels is kept or dropped by this A/B, not by comparing tables from
different machine sessions (clocks and neighbours differ by a few percent between them).
BASELINE is a libqoqkernels.so built from other sources (e.g. the last commit's, carried to the
GPU machine); the candidate defaults to the library of this checkout. Cases:
  * the W4A8 GEMM (both kinds; --w8a8: and the W8A8 GEMM) under the plan of this checkout, M in
    --ms on the four small shapes of benchmarks/gemm.py (--shapes: others, e.g. all five of
    issue 4 with --shapes all); a plan whose tile or kernel the baseline lacks fails there;
  * the fused sparse-dense GEMM (per group) at 1% outliers, uniform (--patterns: and/or
    column-clustered), M in {8, 16}, on the six shapes of benchmarks/sparse_dense.py
    (--no-fused skips them; --no-gemm the dense cases).
Both libraries run with their own launch settings and defaults only if at least one of them was
built with -fno-gnu-unique (kernels/build.py, since 2026-12-01 13:00 UTC): before,
the settings were inline-function statics unified across the process, so the candidate ran
with the baseline's defaults (e.g. when to stage the fused kernel's activations).
Each case is timed as benchmarks/gemm.py times (R calls on R weight copies in one CUDA graph,
do_bench median) under baseline, candidate, baseline, candidate; each library's faster run is
kept. Printed: both times, cuBLAS bf16 in the same run, and baseline / candidate (> 1: the
candidate is faster), with the geometric mean per group of cases. --compare-outputs also runs
each case's first call once under each library and says whether the two fp16 outputs are
identical bit for bit (a change that only moves work around must leave them so). --plan
KERNEL:TILE:SPLITS puts every dense case on that one kernel form (e.g. wgmma_m64:3:1), to time a
form on shapes the plan gives to others.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gemm import SHAPES, SMALL_SHAPES, copies_for, small_m_cases, time_calls, w4_operands, w4_ops, w8_operands  # noqa: E402
from sparse_dense import SHAPES as SPARSE_SHAPES  # noqa: E402
from sparse_dense import PATTERNS, fused_op, make_outliers  # noqa: E402

from qoqtool.runtime import cuda_ops  # noqa: E402

LIBRARIES = ("baseline", "candidate")


def ab(calls, paths: dict) -> dict:
    """{library: us per call}: the faster of two runs each, the libraries alternating."""
    best = {}
    for _ in range(2):
        for name in LIBRARIES:
            cuda_ops.use_library(paths[name])
            us = time_calls(calls)
            best[name] = min(us, best.get(name, math.inf))
    cuda_ops.use_library(None)
    return best


def differing_outputs(call, paths: dict) -> int:
    """How many elements of call()'s output differ between the two libraries (0: bit-identical)."""
    outs = {}
    for name in LIBRARIES:
        cuda_ops.use_library(paths[name])
        outs[name] = call().clone()
    cuda_ops.use_library(None)
    a, b = outs["baseline"].view(torch.int16), outs["candidate"].view(torch.int16)
    return int((a != b).sum())


def report(group: str, label: str, times: dict, bf16: float, rows: list[dict], differing: int | None = None,
           **fields) -> None:
    ratio = times["baseline"] / times["candidate"]
    rows.append({"group": group, **fields, **{f"{k}_us": v for k, v in times.items()}, "bf16_us": bf16,
                 "baseline_over_candidate": ratio, **({} if differing is None else {"differing_outputs": differing})})
    same = "" if differing is None else " | outputs identical" if differing == 0 else f" | {differing} OUTPUTS DIFFER"
    print(f"{group:7s} {label:32s} | bf16 {bf16:7.2f} | baseline {times['baseline']:7.2f} ({bf16 / times['baseline']:.2f}x)"
          f" | candidate {times['candidate']:7.2f} ({bf16 / times['candidate']:.2f}x) | {ratio:.3f}{same}", flush=True)


def gemm_cases(g, ms, paths, rows, w8a8: bool = False, shapes=SMALL_SHAPES, compare: bool = False) -> None:
    op = w4_ops()
    if w8a8:  # called as the W4 ops are: (x_q, x_scale, x_rowsum, weights..., N); W8A8 takes no row sums
        op["w8a8"] = lambda x_q, x_scale, x_rowsum, *w: torch.ops.qoqtool.w8a8_gemm(x_q, x_scale, *w)
    for n, k, m, acts, bf16, plan in small_m_cases(g, ms, shapes):
        plan = cuda_ops.PLAN_OVERRIDE or plan
        for kind in op:
            w8 = kind == "w8a8"
            weights = [w8_operands(n, k, g) if w8 else w4_operands(n, k, kind, g)
                       for _ in range(copies_for(n * k if w8 else n * k // 2, m))]
            calls = [lambda w=w: op[kind](*acts, *w, n) for w in weights]
            differing = differing_outputs(calls[0], paths) if compare else None
            times = ab(calls, paths)
            report("gemm", f"{kind} M={m:<2d} {n}x{k} {plan.name()}", times, bf16, rows, differing,
                   kind=kind, M=m, N=n, K=k, plan=plan.name())
            del weights
            torch.cuda.empty_cache()


def fused_cases(g, ms, patterns, paths, rows, compare: bool = False) -> None:
    for pattern, (n, k) in itertools.product(patterns, SPARSE_SHAPES):
        op = fused_op("per_group", n)
        copies = copies_for(n * k // 2, min(ms))
        weights = [w4_operands(n, k, "per_group", g) for _ in range(copies)]
        sections = [make_outliers(n, k, 0.01, pattern, g)[0] for _ in range(copies)]
        for m in ms:
            x_q = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda", generator=g)
            x_scale = (torch.rand(m, device="cuda", generator=g) * 0.02 + 0.01).half()
            xb = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
            wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(copies_for(2 * n * k, m))]
            bf16 = time_calls([lambda w=w: torch.matmul(xb, w.t()) for w in wb])
            del wb
            calls = [lambda w=w, s=s: op(x_q, x_scale, None, w, s) for w, s in zip(weights, sections)]
            differing = differing_outputs(calls[0], paths) if compare else None
            times = ab(calls, paths)
            report(f"fused-{pattern[:5]}", f"1% M={m:<2d} {n}x{k}", times, bf16, rows, differing, M=m, N=n, K=k,
                   pattern=pattern)
        del weights, sections
        torch.cuda.empty_cache()


def parse_shape(text: str) -> tuple[int, int]:
    """'NxK' -> (N, K); ValueError otherwise."""
    n, k = (int(d) for d in text.split("x"))  # (ValueError for a count other than two, too)
    return n, k


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("baseline", help="the baseline build's libqoqkernels.so")
    ap.add_argument("--candidate", default=None, help="the candidate's library (default: this checkout's build)")
    ap.add_argument("--ms", default="1,8,16,32", help="GEMM token counts (default 1,8,16,32)")
    ap.add_argument("--fused-ms", default="8,16", help="fused sparse-dense token counts (default 8,16)")
    ap.add_argument("--no-fused", action="store_true", help="skip the fused sparse-dense cases")
    ap.add_argument("--patterns", default="uniform", help="fused outlier patterns: uniform and/or clustered (default uniform)")
    ap.add_argument("--no-gemm", action="store_true", help="skip the dense GEMM cases")
    ap.add_argument("--shapes", default=None,
                    help="dense GEMM shapes as NxK,NxK or 'all' (issue 4's five; default: the four small ones)")
    ap.add_argument("--w8a8", action="store_true", help="time the W8A8 GEMM too (its plan may differ from the printed W4 one)")
    ap.add_argument("--compare-outputs", action="store_true",
                    help="also check that both libraries give bit-identical outputs on every case")
    ap.add_argument("--plan", default=None, metavar="KERNEL:TILE:SPLITS",
                    help="every dense GEMM on this plan instead of the checkout's choice (e.g. wgmma_m64:3:1), "
                         "to time one kernel form on shapes the plan gives to others")
    ap.add_argument("--json", default=None, help="write all numbers here")
    args = ap.parse_args()
    if args.plan:
        try:
            cuda_ops.PLAN_OVERRIDE = cuda_ops.Plan.parse(args.plan)
        except ValueError as e:
            ap.error(f"--plan: {e}")
    patterns = args.patterns.split(",")
    if not set(patterns) <= set(PATTERNS):
        ap.error(f"--patterns: {args.patterns!r}; choose from {','.join(PATTERNS)}")
    try:
        shapes = SMALL_SHAPES if args.shapes is None else SHAPES if args.shapes == "all" else [
            parse_shape(s) for s in args.shapes.split(",")]
    except ValueError:
        ap.error(f"--shapes: {args.shapes!r}; give NxK,NxK (e.g. 4096x4096,11008x4096) or all")
    if not torch.cuda.is_available():
        sys.exit("library_ab.py needs a CUDA GPU")
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    paths = {"baseline": args.baseline, "candidate": args.candidate}
    g = torch.Generator(device="cuda").manual_seed(0)
    rows: list[dict] = []
    if not args.no_gemm:
        gemm_cases(g, [int(m) for m in args.ms.split(",")], paths, rows, args.w8a8, shapes, args.compare_outputs)
    if not args.no_fused:
        fused_cases(g, [int(m) for m in args.fused_ms.split(",")], patterns, paths, rows, args.compare_outputs)
    print("\ngeometric mean of baseline / candidate (> 1: the candidate is faster)")
    groups = {}
    for r in rows:
        groups.setdefault((r["group"], r.get("kind", "per_group"), r["M"]), []).append(r["baseline_over_candidate"])
    for (group, kind, m), ratios in groups.items():
        mean = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        print(f"  {group:11s} {kind:11s} M={m:<2d}: {mean:.3f}  "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f}, {len(ratios)} shapes)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "baseline": args.baseline, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
