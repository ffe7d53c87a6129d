"""Where a 4-bit KV cache loses on a model: WikiText-2 perplexity of the *float* model with
the KV cache quantized, under each exact transform that targets K or V.

Weights and activations stay in float, so every difference from the KV16 row is the cache's.
The transforms are exact in float (rotations, SmoothAttention), so they change only what
the 4-bit cache has to represent.

    python benchmarks/kv_diagnosis.py --data-dir ../shared/data --windows 6 --calib-samples 16
"""

from __future__ import annotations

import argparse
import copy
import json
import time

from qoqtool.calibration.pipeline import quantize_model
from qoqtool.data.calibration import build_calibration
from qoqtool.eval.perplexity import perplexity, wikitext2_test_ids
from qoqtool.models.adapter import ModelAdapter
from qoqtool.models.loading import load_model
from qoqtool.recipe import recipe_from_dict
from qoqtool.runtime.attention import enable_key_rotation, enable_kv_quantization

# label -> (KV bits, recipe steps, rotate keys online without rotating the residual)
ROWS = {
    "KV16": (16, [], False),
    "KV4": (4, [], False),
    "KV4 + rotation (residual, per-head V)": (4, [{"rotate": {"value_hadamard": True}}], False),
    "KV4 + rotation + SmoothAttention 0.5 (QoQ)": (4, [{"rotate": {"value_hadamard": True}}, {"smooth_attention": {"alpha": 0.5}}], False),
    "KV4 + key rotation": (4, [], True),
    "KV4 + rotation + key rotation (keyrot)": (4, [{"rotate": {"value_hadamard": True, "key_hadamard": True}}], False),
    "KV4 + rotation + key rotation + SmoothAttention 0.5": (
        4, [{"rotate": {"value_hadamard": True, "key_hadamard": True}}, {"smooth_attention": {"alpha": 0.5}}], False),
    "KV4 + rotation + SmoothAttention 0.5 + key centering": (
        4, [{"rotate": {"value_hadamard": True}}, {"smooth_attention": {"alpha": 0.5}}, {"center_keys": {}}], False),
    "KV4 + rotation + key rotation + key centering (the default recipes)": (
        4, [{"rotate": {"value_hadamard": True, "key_hadamard": True}}, {"center_keys": {}}], False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--windows", type=int, default=6, help="first N windows of 2048 tokens")
    parser.add_argument("--calib-samples", type=int, default=16)
    parser.add_argument("--calib-seqlen", type=int, default=512)
    parser.add_argument("--alphas", default="", help="extra rows: rotation + SmoothAttention at these alphas (comma list)")
    parser.add_argument("--only", default="", help="run only the rows whose label contains this text")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows_to_run = dict(ROWS)
    for alpha in filter(None, args.alphas.split(",")):
        rows_to_run[f"KV4 + rotation + SmoothAttention {alpha}"] = (
            4, [{"rotate": {"value_hadamard": True}}, {"smooth_attention": {"alpha": float(alpha)}}], False)
    if args.only:
        rows_to_run = {k: v for k, v in rows_to_run.items() if args.only in k}

    base, tokenizer, _ = load_model(args.model)
    ids = wikitext2_test_ids(tokenizer, args.data_dir)
    calib = build_calibration("wikitext2", tokenizer, args.calib_samples, args.calib_seqlen, 0, args.data_dir)
    rows = []
    for label, (bits, steps, keys_only) in rows_to_run.items():
        t0 = time.perf_counter()
        model = copy.deepcopy(base)
        if steps:
            recipe = recipe_from_dict({"name": label, "weights": {"bits": 4, "scheme": "progressive", "group_size": 128},
                                       "kv_cache": {"bits": 4}, "steps": steps})
            quantize_model(model, recipe, calib.tokens, transform_only=True)
        if keys_only:
            enable_key_rotation(model, ModelAdapter(model).head_dim, seed=2)
        enable_kv_quantization(model, bits)
        ppl = perplexity(model, ids, 2048, args.windows)["ppl"]
        rows.append({"row": label, "ppl": ppl, "seconds": round(time.perf_counter() - t0, 1)})
        print(f"| {label} | {ppl:.3f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "windows": args.windows, "calibration": calib.describe(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
