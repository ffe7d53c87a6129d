"""Decode steps with the fused rotation's small second factors on the CUDA cores (the fp32-factor
kernel, runtime.fusion.BITS_ABOVE = 32, the default) against the tensor cores (the sign-bits
kernel, BITS_ABOVE = 0), on one packed model per shape, interleaved twice (one GPU).

    python benchmarks/rotation_forms.py [--shapes llama3-8b,smollm2-135m] [--batches 1,16,64] [--json PATH]

The models and the step are benchmarks/decode.py's (random weights of the named shapes, the
default recipe, 1024 tokens of context, graph replays timed by CUDA events).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import decode
from qoqtool.runtime import fusion

FORMS = {"cuda_cores": 32, "tensor_cores": 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="llama3-8b,smollm2-135m")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; replay ms per decode step (median of two "
          f"interleaved rounds)")
    rows = []
    for shape in args.shapes.split(","):
        model = decode.fp16_model(shape)
        decode.pack_in_place(model)
        times: dict[tuple[str, int], list[float]] = {}
        for _ in range(2):
            for form, bits_above in FORMS.items():
                fusion.BITS_ABOVE = bits_above
                for b in map(int, args.batches.split(",")):
                    times.setdefault((form, b), []).append(decode.time_steps(model, b, 1024, args.steps, True)["replay_ms"])
        fusion.BITS_ABOVE = FORMS["cuda_cores"]
        for b in map(int, args.batches.split(",")):
            cuda, tensor = (statistics.median(times[form, b]) for form in FORMS)
            print(f"{shape:>14} | batch {b:>3} | CUDA cores {cuda:8.3f} | tensor cores {tensor:8.3f} | "
                  f"CUDA / tensor {cuda / tensor:.3f}x")
            rows.append({"shape": shape, "batch": b, "cuda_cores_ms": times["cuda_cores", b],
                         "tensor_cores_ms": times["tensor_cores", b]})
        del model
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
