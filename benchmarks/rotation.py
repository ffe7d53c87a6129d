"""The online down_proj rotation (qoqtool.runtime.mlp.KroneckerRotation) at decode sizes:
its large Paley factors applied by FFT against the same factor as a dense fp32 matrix.

    python benchmarks/rotation.py                       # this machine's CPU
    python benchmarks/rotation.py --device cuda --json rotation.json
    python benchmarks/rotation.py --hadamard 1          # version 1 of the constructions (2 x 5504 for 11008)
    python benchmarks/rotation.py --device cuda --fused # and the fused SiLU + rotation + quantization kernels

For each intermediate size (the Kronecker factors the rotation uses are printed) and batch of
tokens: the time of one rotation of [batch, n] fp16 values, median of --repeat calls after a
warm-up (CUDA: events around each call, so a call's launches are included), as the runtime
runs it ("default": Paley factors above runtime.mlp.FFT_ABOVE by FFT, the others dense; the
sizes without such a factor are the control, the same code twice) and with every factor
dense, their ratio, the
largest difference between the two (relative to the largest output value), and the bytes of
the rotation's buffers (per layer: every MLP holds its own). --hadamard picks the version of
the Hadamard constructions (qoqtool.transforms.hadamard; 2, the default, builds Llama-2's 11008
as 32 x 344, so nothing there goes by FFT; 1 as 2 x 5504). --fused (CUDA) also times what a
decode step runs between gate/up and down_proj: the unfused chain (SiLU product, this rotation,
qoqtool::quantize_per_token) and the fused kernels - on the CUDA cores with the fp32 factor
(second factor of order <= 32) and on the tensor cores with its sign bits (even order) - whichever
take the size (runtime.fusion.BITS_ABOVE picks between them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from qoqtool.runtime import mlp

SIZES = {"llama2-7b": 11008, "qwen2.5-32b": 29568, "llama3-8b": 14336, "qwen2.5-7b": 18944, "smollm2-135m": 1536}


def buffer_bytes(module: torch.nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in module.buffers())


def time_call(fn, device: str, repeat: int) -> float:
    """Median milliseconds of fn() over `repeat` calls after three warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def fused_times(rotation, x: torch.Tensor, repeat: int) -> dict:
    """Milliseconds of silu(x) * x, rotated and quantized: the unfused chain and each fused kernel
    that takes this rotation (gate = up = x; the work does not depend on the values)."""
    from qoqtool.runtime import cuda_ops

    n = x.shape[1]
    out = {"unfused_ms": time_call(lambda: torch.ops.qoqtool.quantize_per_token(
        rotation(torch.nn.functional.silu(x) * x).contiguous(), n), "cuda", repeat)}
    form = rotation.fused_form()
    if form is None:
        return out
    a, factor = form
    if cuda_ops.rotation_form_fits(a, factor.shape[0], bits=False):
        out["fused_cuda_cores_ms"] = time_call(lambda: torch.ops.qoqtool.silu_mul_rotate_quantize(
            x, x, factor, rotation.signs, a, n), "cuda", repeat)
    if cuda_ops.rotation_form_fits(a, factor.shape[0], bits=True):
        out["fused_tensor_cores_ms"] = time_call(lambda: torch.ops.qoqtool.silu_mul_rotate_quantize_bits(
            x, x, rotation.factor_bits, rotation.signs, a, n), "cuda", repeat)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--hadamard", type=int, default=2, choices=(1, 2), help="version of the Hadamard constructions")
    ap.add_argument("--fused", action="store_true", help="(CUDA) also the unfused chain and the fused kernels")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device, results = args.device, []
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}; ms per rotation of [batch, n] fp16 values (median of {args.repeat}); "
          f"Hadamard constructions version {args.hadamard}")
    print(f"{'shape':>12} | {'n = factors':>22} | {'batch':>5} | {'default ms':>10} | {'dense ms':>9} | "
          f"{'dense / default':>15} | {'max diff':>8} | {'buffers default / dense':>24}")
    for shape in args.sizes.split(","):
        n = SIZES[shape]
        fft = mlp.KroneckerRotation(n, seed=0, version=args.hadamard).to(device)
        saved, mlp.FFT_ABOVE = mlp.FFT_ABOVE, 1 << 30
        try:
            dense = mlp.KroneckerRotation(n, seed=0, version=args.hadamard).to(device)
        finally:
            mlp.FFT_ABOVE = saved
        for batch in map(int, args.batches.split(",")):
            x = torch.randn(batch, n, generator=torch.Generator().manual_seed(batch)).half().to(device)
            with torch.no_grad():
                a, b = fft(x).float(), dense(x).float()
                t_fft = time_call(lambda: fft(x), device, args.repeat)
                t_dense = time_call(lambda: dense(x), device, args.repeat)
            diff = float((a - b).abs().max() / b.abs().max())
            sizes = f"{buffer_bytes(fft) / 2**20:.2f} / {buffer_bytes(dense) / 2**20:.1f} MiB"
            print(f"{shape:>12} | {f'{n} = ' + ' x '.join(map(str, fft.shapes)):>22} | {batch:>5} | {t_fft:>10.3f} | "
                  f"{t_dense:>9.3f} | {t_dense / t_fft:>14.2f}x | {diff:>8.1e} | {sizes:>24}")
            results.append({"shape": shape, "n": n, "hadamard": args.hadamard, "factors": fft.shapes, "fft_factor": bool(fft.paley), "batch": batch,
                            "default_ms": t_fft, "dense_ms": t_dense, "max_rel_diff": diff,
                            "buffer_bytes_default": buffer_bytes(fft), "buffer_bytes_dense": buffer_bytes(dense),
                            **(fused_times(fft, x, args.repeat) if args.fused and device == "cuda" else {})})
            if "unfused_ms" in results[-1]:
                r = results[-1]
                print(f"{'':>12}   SiLU + rotation + quantization: unfused {r['unfused_ms']:.3f} ms; fused, CUDA cores "
                      + (f"{r['fused_cuda_cores_ms']:.3f}" if "fused_cuda_cores_ms" in r else "-")
                      + " ms; fused, tensor cores "
                      + (f"{r['fused_tensor_cores_ms']:.3f}" if "fused_tensor_cores_ms" in r else "-") + " ms")
        del fft, dense
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
