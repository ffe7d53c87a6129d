"""GEMM kernels under Nsight Compute (where the time goes; no timing here).

    ncu --kernel-name regex:"stream_kernel|wgmma_kernel" --section SpeedOfLight ... \
        python benchmarks/profile_gemm.py [--n 8192 --k 8192 --m 1] [--plan KERNEL,TILE,SPLITS]
                                          [--outliers DENSITY [--pattern uniform|clustered]]

Runs, twice each, the per-group and per-channel W4A8 and the W8A8 GEMMs with the plan
cuda_ops.plan picks (or --plan, e.g. 1,2,1 for wgmma with two warpgroups, unsplit), on random
operands; --outliers: the per-group dense GEMM and the fused sparse-dense one (issue 8) with
that share of Tile-COO outliers (benchmarks/sparse_dense.py's patterns), on the fused plan.
"""

from __future__ import annotations

import argparse

import torch
from gemm import per_group, w4_operands, w8_operands

from qoqtool.runtime import cuda_ops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--k", type=int, default=8192)
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--plan", default=None, help="KERNEL,TILE,SPLITS (cuda_ops.Plan) instead of the plan's choice")
    ap.add_argument("--outliers", type=float, default=None, metavar="DENSITY",
                    help="profile the dense and the fused sparse-dense per-group GEMMs with this share of outliers")
    ap.add_argument("--pattern", choices=["uniform", "clustered"], default="uniform")
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    x_q = torch.randint(-127, 128, (a.m, a.k), dtype=torch.int8, device="cuda", generator=g)
    x_scale = (torch.rand(a.m, device="cuda", generator=g) + 0.5).half()
    w = w4_operands(a.n, a.k, "per_group", g)
    wc = w4_operands(a.n, a.k, "per_channel", g)
    x_rowsum = x_q.sum(1, dtype=torch.int32)
    w8 = w8_operands(a.n, a.k, g)
    if a.outliers is not None:
        from sparse_dense import make_outliers

        tc, _ = make_outliers(a.n, a.k, a.outliers, a.pattern, g)
        calls = [("dense per_group", lambda: per_group(x_q, x_scale, x_rowsum, *w, a.n)),
                 ("fused per_group", lambda: torch.ops.qoqtool.w4a8_sparse_dense_gemm_per_group(x_q, x_scale, *w, *tc, a.n))]
        for label, call in calls:
            for _ in range(2):
                call()
            torch.cuda.synchronize()
            print(label, flush=True)
        return
    chosen = cuda_ops.Plan(*map(int, a.plan.split(","))) if a.plan else cuda_ops.plan(a.m, a.n // 32, a.k // 32, 132, True)
    cuda_ops.PLAN_OVERRIDE = chosen
    for label, call in [("per_group", lambda: per_group(x_q, x_scale, x_rowsum, *w, a.n)),
                        ("per_channel", lambda: torch.ops.qoqtool.w4a8_gemm_per_channel(x_q, x_scale, x_rowsum, *wc, a.n)),
                        ("w8a8", lambda: torch.ops.qoqtool.w8a8_gemm(x_q, x_scale, *w8, a.n))]:
        for _ in range(2):
            call()
        torch.cuda.synchronize()
        print(label, chosen.name(), flush=True)
    cuda_ops.PLAN_OVERRIDE = None


if __name__ == "__main__":
    main()
