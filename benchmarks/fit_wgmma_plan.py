"""Fit cuda_ops.plan's wgmma cost model to `gemm.py --explore-wgmma` measurements (no GPU needed).

    python benchmarks/fit_wgmma_plan.py EXPLORE.json [MORE.json ...] [--forms wgmma1,wgmma2,wgmma_k21]

The model (qoqtool/runtime/cuda_ops.py, plan): a choice of kernel form, warpgroups and K splits
costs waves x (fixed + stages one warpgroup walks x the form's cost per stage) + (splits - 1) x
(a cost per split + a cost per MB of INT32 partials). It is linear in its constants, so they are
fitted by least squares on the relative error over every timed choice. Printed: the constants
(to paste into cuda_ops), and for each case the model's pick against the measured best.
"""

from __future__ import annotations

import argparse
import json

import torch

from qoqtool.runtime import cuda_ops

SMS = 132


def form_of(row) -> tuple[int, int]:
    name = row["plan"].split(" ")[0]
    return next(k for k, known in cuda_ops.KERNEL_NAMES.items() if known == name), row["tile"]


def features(row, forms) -> list[float]:
    """The model's terms for one timed choice: [waves, waves x walked (one column per form), split terms]."""
    kernel, tile = form_of(row)
    plan = cuda_ops.Plan(kernel, tile, row["splits"])
    waves, walked, extra, partials_mb = cuda_ops.wgmma_cost_terms(plan, row["M"], row["N"] // 32, row["K"] // 32, SMS)
    per_form = [waves * walked if (kernel, tile) == f else 0.0 for f in forms]
    return [waves, *per_form, extra, extra * partials_mb]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+")
    ap.add_argument("--forms", default=None, help="kernel-name + tile of the forms the plan chooses between "
                    "(e.g. wgmma1,wgmma2,wgmma_k21,wgmma_k2t641); default: every wgmma form measured")
    args = ap.parse_args()
    rows = [r for path in args.json for r in json.load(open(path))["explore_wgmma"]]
    measured = sorted({form_of(r) for r in rows if form_of(r)[0] in cuda_ops.WGMMA_KERNELS})  # (not the stream plans of M <= 32)
    if args.forms:
        by_name = {f"{cuda_ops.KERNEL_NAMES[k]}{t}": (k, t) for k, t in measured}
        forms = [by_name[f] for f in args.forms.split(",")]
    else:
        forms = measured
    rows = [r for r in rows if form_of(r) in forms]
    a = torch.tensor([features(r, forms) for r in rows], dtype=torch.float64)
    y = torch.tensor([r["us"] for r in rows], dtype=torch.float64)
    theta = torch.linalg.lstsq(a / y[:, None], torch.ones_like(y)[:, None]).solution[:, 0]
    names = ["wave"] + [f"stage {cuda_ops.KERNEL_NAMES[k]} tile={t}" for k, t in forms] + ["split", "split per MB"]
    for name, value in zip(names, theta.tolist()):
        print(f"{name:28s} {value:7.3f} us")
    err = (a @ theta / y - 1).abs()
    print(f"relative error: median {err.median():.3f}, max {err.max():.3f} over {len(rows)} timed choices")
    cases = sorted({(r.get("kind", "per_group"), r["M"], r["N"], r["K"]) for r in rows})
    hits = 0
    for case in cases:
        idx = [i for i, r in enumerate(rows) if (r.get("kind", "per_group"), r["M"], r["N"], r["K"]) == case]
        pick = min(idx, key=lambda i: float(a[i] @ theta))
        best = min(idx, key=lambda i: rows[i]["us"])
        hits += pick == best
        loss = rows[pick]["us"] / rows[best]["us"]
        print(f"{case[0]:11s} M={case[1]:5d} {case[2]:>5}x{case[3]:<5} model {rows[pick]['plan']:28s} {rows[pick]['us']:7.2f} us"
              f" | best {rows[best]['plan']:28s} {rows[best]['us']:7.2f} us{'' if pick == best else f'  ({loss:.3f}x)'}")
    print(f"the model picks the measured best in {hits} of {len(cases)} cases")


if __name__ == "__main__":
    main()
