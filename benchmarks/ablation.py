"""QoQ ablation (QServe Figure 16 style): WikiText-2 perplexity as each step is added.

    RTN -> + rotation -> + smoothing -> + reorder -> + clipping -> + GPTQ -> + SmoothAttention
    (the paper's recipes, `qoq-w4a8kv4-*-paper`; qoqtool's defaults have a key-centering row
    after the reordering and no SmoothAttention row)

Every row uses the weights/activations/KV format of the chosen QoQ recipe (progressive
W4 per group, INT8 per-token activations, KV4) and that recipe's step parameters; a row
runs its enabled steps in the recipe's order, so the last row *is* the recipe. Only the
steps the recipe has get a row. One model load, one calibration set, one run; rows are
printed as they finish (partial results survive a time limit). `--extra` adds whole
bundled recipes as further rows.

    python benchmarks/ablation.py --model smollm2-135m --recipe qoq-w4a8kv4-g128-paper \\
        --data-dir ../shared/data --device cuda --json ablation.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import torch

from qoqtool.calibration.pipeline import quantize_model
from qoqtool.data.calibration import build_calibration
from qoqtool.eval.perplexity import perplexity, wikitext2_test_ids
from qoqtool.models.loading import load_model
from qoqtool.packing.packed import round_as_deployed
from qoqtool.recipe import Step, load_recipe

# The order in which steps are added (Figure 16's, with key centering before the weight solvers).
STEP_ROWS = [
    ("rotate", "+ rotation"),
    ("smooth_output", "+ smoothing"),
    ("reorder", "+ reorder"),
    ("center_keys", "+ key centering"),
    ("clip", "+ clipping"),
    ("gptq", "+ GPTQ"),
    ("smooth_attention", "+ SmoothAttention"),
]


def ablation_rows(recipe) -> list[tuple[str, list[str]]]:
    """(label, enabled steps) per row: RTN, then one more of the recipe's steps per row."""
    present = {s.name for s in recipe.steps}
    rows, enabled = [("RTN", [])], []
    for step, label in STEP_ROWS:
        if step in present:
            enabled = enabled + [step]
            rows.append((label, enabled))
    return rows


def recipe_with(base, enabled: list[str], label: str):
    recipe = copy.deepcopy(base)
    recipe.name = f"{base.name} [{label}]"
    recipe.steps = [Step(s.name, dict(s.params)) for s in base.steps if s.name in enabled]
    return recipe


def run_row(label, model, recipe, calib, ids, args) -> dict:
    t0 = time.perf_counter()
    if recipe is not None:
        quantize_model(model, recipe, calib.tokens, device=args.device, batch_size=args.batch_size)
        round_as_deployed(model)  # float tensors are deployed in fp16 (docs/format.md)
    t1 = time.perf_counter()
    model.to(args.device)
    res = perplexity(model, ids, args.seqlen, args.windows)
    model.to("cpu")
    row = {"row": label, "recipe": recipe.to_dict() if recipe else None, "ppl": res["ppl"], "windows": res["windows"],
           "tokens": res["tokens"], "quantize_s": round(t1 - t0, 1), "eval_s": round(time.perf_counter() - t1, 1)}
    print(f"| {label} | {res['ppl']:.3f} | {row['quantize_s']} | {row['eval_s']} |", flush=True)
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--recipe", default="qoq-w4a8kv4-g128-paper", help="the QoQ recipe to ablate")
    ap.add_argument("--extra", default="", help="comma-separated recipes evaluated after the ablation")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--calib", default="wikitext2")
    ap.add_argument("--calib-samples", type=int, default=64)
    ap.add_argument("--calib-seqlen", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=None, help="first N windows (default: all 148)")
    ap.add_argument("--rows", default="", help="comma-separated row labels to run (default: all)")
    ap.add_argument("--fp", action="store_true", help="also evaluate the unquantized model")
    ap.add_argument("--extras-first", action="store_true",
                    help="run the --extra recipes before the ablation rows; the last ablation row is then "
                         "taken from the ablated recipe's own --extra row when present")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    base_model, tok, _ = load_model(args.model)
    calib = build_calibration(args.calib, tok, args.calib_samples, args.calib_seqlen, args.seed, args.data_dir, model=base_model)
    ids = wikitext2_test_ids(tok, args.data_dir)
    base = load_recipe(args.recipe)
    print(f"model {args.model}, recipe {base.name} ({base.summary()}), calibration {calib.describe()}, device {args.device}")
    print("| row | WikiText-2 ppl | quantize s | eval s |\n|---|---|---|---|", flush=True)
    rows = []
    wanted = {r.strip() for r in args.rows.split(",") if r.strip()}

    def record(row):
        rows.append(row)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"model": args.model, "calibration": calib.describe(), "device": args.device,
                           "torch": torch.__version__, "rows": rows}, fh, indent=1)

    extras = [r.strip() for r in args.extra.split(",") if r.strip()]

    def run_extras():
        for name in extras:
            record(run_row(name, copy.deepcopy(base_model), load_recipe(name), calib, ids, args))

    if args.fp:
        record(run_row("fp32", copy.deepcopy(base_model), None, calib, ids, args))
    if args.extras_first:
        run_extras()
    ablation = ablation_rows(base)
    for label, enabled in ablation:
        if wanted and label not in wanted:
            continue
        if args.extras_first and base.name in extras and label == ablation[-1][0]:
            same = next(r for r in rows if r["row"] == base.name)  # every step on: the recipe itself
            record({**same, "row": label})
            print(f"| {label} | {same['ppl']:.3f} | (= {base.name}) | |", flush=True)
            continue
        record(run_row(label, copy.deepcopy(base_model), recipe_with(base, enabled, label), calib, ids, args))
    if not args.extras_first:
        run_extras()


if __name__ == "__main__":
    sys.exit(main())
