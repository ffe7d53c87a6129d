"""How far greedy generation of a W4A8 model moves when only the float precision changes.

    python benchmarks/generation_precision.py QUANTIZED_OR_PACKED [--steps 32] [--json PATH]

Runs the exact reference path (qoqtool.runtime.generate.generate_reference) on the CPU twice on
the same model: in fp32, as `qoqtool eval` does, and with the model cast to fp16, which is what
the GPU path computes in (the kernels quantize each token's activations from fp16 values). Both
are the same integer algorithm; they differ only in the rounding of the float steps around the
INT8 products (norms, residual adds, the activation scales and codes, attention). Prints, per
prompt, where the two greedy continuations part and the largest logit difference up to there,
in the same terms as `python -m qoqtool.runtime.generate` does for the GPU path against the
CPU reference (issue 7): if fp16 alone moves the logits by several units and parts the tokens
within a few steps, the GPU path's divergences of that size are precision, not a kernel error.
"""

from __future__ import annotations

import argparse
import json

import torch

from qoqtool.runtime.generate import DEFAULT_PROMPTS, explain, generate_reference
from qoqtool.runtime.loading import load_any


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--json", help="write the per-prompt rows here")
    args = ap.parse_args()
    loaded = load_any(args.model, device="cpu")
    tokenizer, model = loaded.tokenizer, loaded.model
    prompts = [tokenizer(text)["input_ids"] for text in DEFAULT_PROMPTS]
    with torch.no_grad():
        fp32 = generate_reference(model, prompts, args.steps, keep_logits=True)
        # nn.Module._apply: transformers refuses .half() on models it loaded from GGUF
        model = torch.nn.Module._apply(model, lambda t: t.half() if t.is_floating_point() else t)
        fp16 = generate_reference(model, prompts, args.steps, keep_logits=True)
    rows = explain(fp32, fp16)
    print(f"{args.model}: fp16 vs fp32 reference path on the CPU, {args.steps} greedy steps")
    for text, row, a, b in zip(DEFAULT_PROMPTS, rows, fp32.tokens, fp16.tokens):
        where = "identical" if row["diverges_at"] is None else (
            f"parts at step {row['diverges_at']} (fp32 top-2 gap {row['reference_gap']:.4f})")
        print(f"- {text!r}: {where}; max logit difference {row['max_logit_diff']:.4f}")
        print(f"    fp32: {tokenizer.decode(a)!r}")
        print(f"    fp16: {tokenizer.decode(b)!r}")
        row.update(prompt=text, fp32=tokenizer.decode(a), fp16=tokenizer.decode(b))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "steps": args.steps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
