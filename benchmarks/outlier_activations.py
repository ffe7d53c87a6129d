"""Which activations the outliers of a W4A8 model multiply (issue 8, item 2), on this CPU.

    python benchmarks/outlier_activations.py FOLDER --mode int8|float [--data-dir D] [--max-windows N] [--json PATH]

FOLDER is a quantized folder with outliers (`qoqtool quantize ... --outliers 1%`). The fused
sparse-dense kernel multiplies the Tile-COO outliers by the per-token INT8 codes it already
holds (y = sx * (dense + S xq), docs/tile-coo.md), and so does the reference path. `--mode
float` scores the same folder with the sparse term taken on the float activations instead
(y = sx * dense + S x), which a kernel would have to load beside the INT8 tile. WikiText-2
perplexity on the reference path (148 windows of 2048 tokens); one thread, so that both
modes can run side by side on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from qoqtool.eval.perplexity import perplexity, wikitext2_test_ids
from qoqtool.quantizers.activations import quantize_per_token
from qoqtool.runtime import reference
from qoqtool.runtime.loading import load_any


def forward_with_float_outliers(self, x):
    """QuantLinear.forward (W4A8) with the sparse term on the float activations."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    codes, scales = quantize_per_token(x2)
    y = self.qweight.linear_int8(codes, scales, self.operand())
    if self.outliers is not None:
        y = y + self.outliers.matmul(x2.float())
    if self.bias is not None:
        y = y + self.bias.float()
    return y.to(x.dtype).reshape(*shape[:-1], self.out_features)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--mode", choices=["int8", "float"], required=True)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--max-windows", type=int, default=None, help="score only the first windows (a quick check)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    loaded = load_any(args.folder, "cpu")
    if loaded.manifest is None or loaded.manifest.get("recipe", {}).get("activations", {}).get("bits") != 8:
        raise SystemExit("FOLDER must be a quantized folder with INT8 activations")
    if args.mode == "float":
        reference.QuantLinear.forward = forward_with_float_outliers
    ids = wikitext2_test_ids(loaded.tokenizer, args.data_dir)
    start = time.time()
    result = perplexity(loaded.model, ids, max_windows=args.max_windows)
    result.update(mode=args.mode, folder=args.folder, seconds=round(time.time() - start, 1))
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
