"""The read ceiling at small M (one GPU): how fast any kernel reads a W4 weight matrix once, back to back.

    python benchmarks/read_ceiling.py [--shapes N:K,...] [--json PATH]

At M <= 16 a W4A8 GEMM is a weight stream, so the period of a kernel that does nothing but read
the packed weights (benchmarks/read_ceiling.cu, built here with nvcc) bounds what our stream
kernel can reach, and cuBLAS bf16 / that period bounds its ratio against cuBLAS. For each shape
the read kernel sweeps two ways of reading (16-byte loads into registers, bulk copies into
shared memory), its grid (CTAs per SM), threads or ring, bytes in flight and the CTAs' blocks
(contiguous or interleaved), with the dependent-launch wait after the reads; the best of each way
again without that overlap (no dependent launch; the wait first) and the loads one CTA per SM; timed like
benchmarks/gemm.py (one CUDA graph of calls on separate weight copies, do_bench median), with
cuBLAS bf16 and our W4A8 kernels (plan's choice) at M = 1 and 16 in the same run.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gemm import bf16_us, copies_for, time_calls, w4_operands, w4_ops  # noqa: E402

from qoqtool.runtime import cuda_ops  # noqa: E402,F401  (registers torch.ops.qoqtool, which w4_ops returns)

SHAPES = [(8192, 8192), (4096, 4096), (14336, 4096), (4096, 14336)]  # (N, K), as the small-M studies
FULL_SM_SMEM = 120 * 1024  # dynamic shared memory that keeps a second CTA off the SM (228 KB per SM)
LOADS, BULK = 0, 1


def build() -> ctypes.CDLL:
    from qoqtool.kernels.build import nvcc_path  # (the kernel library's own search for nvcc)

    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "read_ceiling.cu")
    out = os.path.join(tempfile.mkdtemp(prefix="read_ceiling_"), "libread_ceiling.so")
    nvcc = nvcc_path()
    if nvcc is None:
        sys.exit("benchmarks/read_ceiling.py needs nvcc to build its kernel")
    subprocess.run([nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC",
                    "-gencode=arch=compute_90a,code=sm_90a", src, "-o", out], check=True)
    lib = ctypes.CDLL(out)
    lib.qoq_read_once.restype = ctypes.c_int
    lib.qoq_read_once.argtypes = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p] + [ctypes.c_int] * 8 + [ctypes.c_void_p]
    return lib


def configs(sms: int) -> list[dict]:
    """The sweep, every config with wait mode 2 (the fastest; modes 0 and 1 are timed for the best ones)."""
    out = [{"method": LOADS, "ctas": per_sm * sms, "threads": threads, "depth": depth, "block_bytes": 0,
            "interleave": interleave, "smem": 0}
           for per_sm, threads, depth, interleave in itertools.product((1, 2, 4), (256, 512, 1024), (4, 8, 16), (0, 1))]
    out += [{"method": BULK, "ctas": per_sm * sms, "threads": 32, "depth": depth, "block_bytes": block, "interleave": interleave,
             "smem": 0}
            for per_sm, block, depth, interleave in itertools.product((1, 2, 4), (8192, 16384, 32768), (2, 4, 8), (0, 1))
            if per_sm * depth * block <= 200 * 1024]
    return [dict(c, wait_mode=2) for c in out]


def name(c: dict) -> str:
    how = (f"{c['threads']} threads x {c['depth']} loads" if c["method"] == LOADS
           else f"bulk copies, {c['depth']} x {c['block_bytes'] // 1024} KB")
    return (f"{c['ctas']} CTAs, {how}, {'interleaved' if c['interleave'] else 'contiguous'}, mode {c['wait_mode']}"
            + (", one CTA per SM" if c["smem"] else ""))


def read_calls(lib, copies, sink, c: dict):
    def call(w):
        rc = lib.qoq_read_once(w.data_ptr(), w.numel(), sink.data_ptr(), c["method"], c["ctas"], c["threads"], c["depth"],
                               c["block_bytes"], c["interleave"], c["wait_mode"], c["smem"],
                               torch.cuda.current_stream().cuda_stream)
        if rc != 0:
            raise RuntimeError(f"read_once ({name(c)}) failed with CUDA error {rc}")
    return [lambda w=w: call(w) for w in copies]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=None, help="N:K,... (default: 8192:8192,4096:4096,14336:4096,4096:14336)")
    ap.add_argument("--json", default=None, help="write all numbers here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/read_ceiling.py needs a CUDA GPU")
    shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    lib = build()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(0)
    sink = torch.zeros(8 * sms, dtype=torch.int32, device="cuda")
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  {sms} SMs", flush=True)

    rows, table = [], []
    for n, k in shapes:
        nbytes = n * k // 2  # the packed codes alone (per group adds 1/32 of that in parameters)
        copies = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=g)
                  for _ in range(copies_for(nbytes, 1))]
        reads = []

        def timed(c: dict) -> dict:
            us = time_calls(read_calls(lib, copies, sink, c))
            reads.append(dict(c, us=us, tb_s=nbytes / us / 1e6))
            return reads[-1]

        for c in configs(sms):
            timed(c)
        best_of = {method: min((r for r in reads if r["method"] == method), key=lambda r: r["us"]) for method in (LOADS, BULK)}
        # The best of each method without the overlap of mode 2, and the loads one CTA per SM.
        others = {(method, mode): timed(dict(best_of[method], wait_mode=mode)) for method in (LOADS, BULK) for mode in (0, 1)}
        one_per_sm = timed(dict(best_of[LOADS], ctas=sms, smem=FULL_SM_SMEM))
        del copies
        torch.cuda.empty_cache()
        best = min(reads, key=lambda r: r["us"])
        ours, bf16 = {}, {}
        op = w4_ops()
        for m in (1, 16):
            bf16[m] = bf16_us(m, n, k, g)
            x_q = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda", generator=g)
            x_scale = (torch.rand(m, device="cuda", generator=g) + 0.5).half()
            acts = (x_q, x_scale, x_q.sum(1, dtype=torch.int32))  # both kinds' activation operands (w4_ops)
            for kind in op:
                weights = [w4_operands(n, k, kind, g) for _ in range(copies_for(nbytes, m))]
                ours[(kind, m)] = time_calls([lambda w=w: op[kind](*acts, *w, n) for w in weights])
                del weights
                torch.cuda.empty_cache()
        rows.append({"N": n, "K": k, "bytes": nbytes, "reads": reads, "bf16_us": bf16,
                     "ours_us": {f"{kind}_M{m}": us for (kind, m), us in ours.items()}})
        table.append(f"{n}x{k} ({nbytes / 1e6:.1f} MB of codes): read ceiling {best['us']:.2f} us "
                     f"({best['tb_s']:.2f} TB/s; {name(best)})")
        table.append("  " + "; ".join(f"{'loads' if method == LOADS else 'bulk'} mode {mode}: {r['us']:.2f}"
                                      for (method, mode), r in others.items())
                     + f"; loads one CTA per SM: {one_per_sm['us']:.2f} us")
        for m in (1, 16):
            table.append(f"  M={m:2d}: bf16 {bf16[m]:6.2f} us -> at most {bf16[m] / best['us']:.2f}x for a kernel that reads "
                         f"the codes once; ours per group {ours[('per_group', m)]:6.2f} us ({bf16[m] / ours[('per_group', m)]:.2f}x, "
                         f"{ours[('per_group', m)] / best['us']:.2f}x the ceiling), per channel {ours[('per_channel', m)]:6.2f} us "
                         f"({bf16[m] / ours[('per_channel', m)]:.2f}x, {ours[('per_channel', m)] / best['us']:.2f}x the ceiling)")
        print("\n".join(table[-4:]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": rows,
                       "table": table}, f, indent=1)
    print("\n" + "\n".join(table))


if __name__ == "__main__":
    main()
