"""The small fused kernels between the GEMMs, one op at a time, at decode batch sizes (one GPU).

    python benchmarks/fused_ops.py [--shapes llama3-8b,qwen3-8b] [--batches 1,16,64] [--ops NAME,...]
                                   [--baseline PATH.so] [--json PATH]

A decode step runs each of these ops once per layer, on that layer's own operands, between two
GEMMs. Here each case is `--layers` calls, each on its own copy of the operands (activations,
norm weights, rotation factors and signs), captured in one CUDA graph and replayed under
do_bench (benchmarks/gemm.py's time_calls): microseconds per call, launch included, with the
operands in L2 (in a decode step the GEMMs' weight stream evicts them, so the step's kernels
are slower than these; decode.py --profile lists those). The ops, per shape (the hidden size H
and the MLP's intermediate size I of benchmarks/decode.py's SHAPES):
  quantize            quantize_per_token of [batch, H]            (o_proj's input)
  rmsnorm_quantize    RMSNorm + quantization of [batch, H]        (the first layer's norm)
  add_rmsnorm_quantize  the residual add, RMSNorm, quantization    (every other norm)
  silu_mul_quantize   silu(gate) * up + quantization of [batch, I] (down_proj's input)
  rotate_cuda_cores / rotate_tensor_cores
                      the same with the default recipe's online down_proj rotation, by the fp32
                      factor on the CUDA cores and by its sign bits on the tensor cores, where
                      the kernel takes the rotation's form (runtime.fusion picks between them)
--baseline PATH.so times every case also on another build of the kernel library
(cuda_ops.use_library), the two alternating twice (each one's faster run kept), and says whether
the first call's outputs are identical bit for bit: a change that only reorganizes a kernel
must leave them so.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from decode import SHAPES  # noqa: E402
from gemm import time_calls  # noqa: E402

from qoqtool.runtime import cuda_ops, mlp  # noqa: E402


def cases(shape: str, batch: int, layers: int, g: torch.Generator) -> dict:
    """{op name: [a call per layer]} for one shape and batch."""
    config = SHAPES[shape]
    h, n = config["hidden_size"], config["intermediate_size"]
    hp, np_ = math.ceil(h / 128) * 128, math.ceil(n / 128) * 128  # the GEMMs' padded K

    def randn(*size, scale=1.0):
        return (scale * torch.randn(*size, generator=g, device="cuda")).half()

    ops = torch.ops.qoqtool
    xs = [randn(batch, h) for _ in range(layers)]
    deltas = [randn(batch, h, scale=0.1) for _ in range(layers)]
    weights = [randn(h, scale=0.1) + 1 for _ in range(layers)]
    gates = [randn(batch, n) for _ in range(layers)]
    ups = [randn(batch, n) for _ in range(layers)]
    out = {
        "quantize": [lambda x=x: ops.quantize_per_token(x, hp) for x in xs],
        "rmsnorm_quantize": [lambda x=x, w=w: ops.rmsnorm_quantize(x, w, 1e-6, hp) for x, w in zip(xs, weights)],
        "add_rmsnorm_quantize": [lambda x=x, d=d, w=w: ops.add_rmsnorm_quantize(x, d, w, 1e-6, hp)
                                 for x, d, w in zip(xs, deltas, weights)],
        "silu_mul_quantize": [lambda a=a, b=b: ops.silu_mul_quantize(a, b, np_) for a, b in zip(gates, ups)],
    }
    rotations = [mlp.KroneckerRotation(n, seed=i).cuda() for i in range(layers)]
    form = rotations[0].fused_form()
    if form is not None:
        a, factor = form
        if cuda_ops.rotation_form_fits(a, factor.shape[0], bits=False):
            out["rotate_cuda_cores"] = [
                lambda gt=gt, u=u, r=r: ops.silu_mul_rotate_quantize(gt, u, r.fused_form()[1], r.signs, a, np_)
                for gt, u, r in zip(gates, ups, rotations)]
        if cuda_ops.rotation_form_fits(a, factor.shape[0], bits=True):
            out["rotate_tensor_cores"] = [
                lambda gt=gt, u=u, r=r: ops.silu_mul_rotate_quantize_bits(gt, u, r.factor_bits, r.signs, a, np_)
                for gt, u, r in zip(gates, ups, rotations)]
    return out


def same_outputs(call, baseline: str) -> bool:
    """Whether call() gives identical tensors on this checkout's library and on `baseline`."""
    mine = call()
    cuda_ops.use_library(baseline)
    try:
        theirs = call()
    finally:
        cuda_ops.use_library(None)
    return all(torch.equal(a, b) for a, b in zip(mine, theirs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="llama3-8b,qwen3-8b,smollm2-135m")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--ops", default=None, help="only these ops (comma-separated names, as printed)")
    ap.add_argument("--layers", type=int, default=32, help="calls per graph, each on its own operands")
    ap.add_argument("--baseline", default=None, metavar="PATH.so", help="another build of the kernel library (A/B)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; us per call ({args.layers} calls a graph, "
          f"each on its own operands)" + (f"; baseline {args.baseline}" if args.baseline else ""))
    print(f"{'shape':>13} | {'batch':>5} | {'op':>20} | {'us':>7}"
          + (f" | {'baseline us':>11} | {'baseline / this':>15} | identical" if args.baseline else ""))
    results = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes.split(","):
        for batch in map(int, args.batches.split(",")):
            for op, calls in cases(shape, batch, args.layers, g).items():
                if args.ops and op not in args.ops.split(","):
                    continue
                row = {"shape": shape, "batch": batch, "op": op}
                if args.baseline:
                    for _ in range(2):  # alternating, each library's faster run kept
                        for key, path in (("us", None), ("baseline_us", args.baseline)):
                            cuda_ops.use_library(path)
                            row[key] = min(time_calls(calls), row.get(key, math.inf))
                    cuda_ops.use_library(None)
                    row["identical"] = same_outputs(calls[0], args.baseline)
                else:
                    row["us"] = time_calls(calls)
                line = f"{shape:>13} | {batch:>5} | {op:>20} | {row['us']:>7.2f}"
                if args.baseline:
                    line += (f" | {row['baseline_us']:>11.2f} | {row['baseline_us'] / row['us']:>14.2f}x | "
                             f"{'yes' if row['identical'] else 'NO'}")
                print(line)
                results.append(row)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
                       "baseline": args.baseline, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
