"""Per-linear agreement of the paths of a packed model with outliers, on real decode inputs.

    python benchmarks/linear_paths.py PACKED_DIR DATA_DIR OUT.json [--device cpu]

Decodes one step of 16 WikiText-2 windows (every linear at M = 16) and keeps each PackedLinear's
input. On cuda (default) it compares on those inputs the fused sparse-dense kernel, the dense
kernel + the separate sparse product (QOQTOOL_FUSED_OUTLIERS=0's path) and the exact reference
linear (QuantLinear, fp32, same device) - relative Frobenius differences, worst linears first -
then sums the NLL of 39 decode steps through each GPU path. On cpu it compares the reference
linear on each input against the same linear on the input rounded to fp16, which is what the
kernels quantize (cuda_ops.packed_linear_forward). Written to tell a kernel error from a model
that amplifies rounding (benchmarks/RESULTS.md, issue 8, version 13).
"""

import argparse
import json
import math

import torch

from qoqtool.eval.perplexity import wikitext2_test_ids
from qoqtool.runtime import cuda_ops
from qoqtool.runtime.generate import score_paged
from qoqtool.runtime.loading import load_any
from qoqtool.runtime.packed_linear import PackedLinear


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(max(v, 1e-12)) for v in values) / len(values))


@torch.no_grad()
def main(path: str, data_dir: str, out: str, device: str) -> None:
    loaded = load_any(path, device=device)
    model = loaded.model
    ids = wikitext2_test_ids(loaded.tokenizer, data_dir)
    windows = torch.stack([ids[w * 256 : (w + 1) * 256] for w in range(16)])

    inputs: dict[str, torch.Tensor] = {}

    def keep_first(name):
        def hook(module, args, output):
            if name not in inputs and args[0].numel() // args[0].shape[-1] == 16:
                inputs[name] = args[0].detach().clone()

        return hook

    linears = {n: m for n, m in model.named_modules() if isinstance(m, PackedLinear)}
    hooks = [m.register_forward_hook(keep_first(n)) for n, m in linears.items()]
    score_paged(model, windows[:, :2])  # one decode step
    for h in hooks:
        h.remove()

    if device == "cpu":
        rows = []
        for name, module in linears.items():
            x = inputs[name].float()
            rows.append((name, rel(module.reference()(x.half().float()), module.reference()(x))))
        rows.sort(key=lambda r: -r[1])
        for name, diff in rows[:10]:
            print(f"{name:40s} reference(fp16(x)) vs reference(x) {diff:.2e}")
        print(f"linears {len(rows)} geomean {geomean([r[1] for r in rows]):.2e} max {rows[0][1]:.2e}")
        with open(out, "w") as f:
            json.dump(rows, f)
        return

    rows = []
    for name, module in linears.items():
        if name not in inputs:
            continue
        x = inputs[name]
        cuda_ops.FUSED_OUTLIERS = True
        fused = module(x)
        cuda_ops.FUSED_OUTLIERS = False
        unfused = module(x)
        cuda_ops.FUSED_OUTLIERS = True
        reference = module.reference()(x.float())
        rows.append((name, rel(fused, reference), rel(unfused, reference), rel(fused, unfused), module.has_outliers))
    rows.sort(key=lambda r: -r[1])
    for name, fr, ur, fu, outliers in rows[:12]:
        print(f"{name:40s} fused-ref {fr:.2e}  unfused-ref {ur:.2e}  fused-unfused {fu:.2e}  outliers {outliers}")
    means = [geomean([r[i] for r in rows]) for i in (1, 2, 3)]
    print(f"linears {len(rows)} geomean fused-ref {means[0]:.2e} unfused-ref {means[1]:.2e} fused-unfused {means[2]:.2e}")
    print(f"max fused-ref {max(r[1] for r in rows):.2e} unfused-ref {max(r[2] for r in rows):.2e}")
    with open(out, "w") as f:
        json.dump(rows, f)
    for fused_path in (True, False):
        cuda_ops.FUSED_OUTLIERS = fused_path
        print("fused" if fused_path else "unfused", "nll40", float(score_paged(model, windows[:, :40]).sum()))
    cuda_ops.FUSED_OUTLIERS = True


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("packed", help="a packed folder with outliers")
    ap.add_argument("data_dir", help="the folder holding wikitext-2-raw")
    ap.add_argument("out", help="JSON file for the per-linear differences")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = ap.parse_args()
    main(args.packed, args.data_dir, args.out, args.device)
