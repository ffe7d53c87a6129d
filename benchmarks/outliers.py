"""Outliers (issue 5): accuracy, Tile-COO storage and packing time on smollm2-135m.

    # accuracy table: quantize with 0 / 0.5 / 1 / 2 % outliers, WikiText-2 perplexity of the
    # saved folder (the GPTQ/QoQ protocol of shared/data/README.md, 148 windows of 2048)
    python benchmarks/outliers.py accuracy -r rtn-w4a16-g128 --shares 0,0.5,1,2 --json out.json

    # Tile-COO storage of every folder's outliers, with the decoder round trip of every layer
    python benchmarks/outliers.py storage FOLDER [FOLDER ...]

    # `qoqtool pack --outliers` on a folder quantized without them, timed end to end
    # (selection, dense packing, Tile-COO encoding, validation, writing), with its storage
    python benchmarks/outliers.py pack-time FOLDER --outliers 1%

    # the accuracy table as markdown
    python benchmarks/outliers.py report --json out.json

Folders are written under --work (default /tmp/qoqtool-outliers); results are appended to
the --json file after each run, so a long table survives an interruption. Data: --data-dir
or $QOQTOOL_DATA_DIR (shared/data). Calibration: WikiText-2 validation, 64 x 512 tokens.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import time
from pathlib import Path

import torch


def _append(path: str | None, record: dict) -> None:
    print(json.dumps(record), flush=True)
    if path:
        rows = json.loads(Path(path).read_text()) if Path(path).is_file() else []
        Path(path).write_text(json.dumps(rows + [record], indent=1) + "\n")


@torch.no_grad()
def window_nlls(model, ids: torch.Tensor, seqlen: int, windows: int) -> list[float]:
    """Summed NLL of each window, by the protocol of qoqtool.eval.perplexity (so that one run
    gives the perplexity over the first 20, 40 or all 148 windows)."""
    out = []
    device = next(model.parameters()).device
    for w in range(windows):
        x = ids[w * seqlen : (w + 1) * seqlen].unsqueeze(0).to(device)
        logits = model(x, use_cache=False).logits[0, :-1].float()
        out.append(float(torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum")))
    return out


def _ppl(nlls: list[float], seqlen: int) -> float:
    return math.exp(sum(nlls) / (len(nlls) * (seqlen - 1)))


def accuracy(args) -> None:
    from qoqtool.calibration.pipeline import quantize_model
    from qoqtool.data.calibration import build_calibration
    from qoqtool.eval.perplexity import wikitext2_test_ids
    from qoqtool.models.loading import load_model
    from qoqtool.packing import quantized
    from qoqtool.quantizers.outliers import parse_outliers
    from qoqtool.recipe import load_recipe
    from qoqtool.runtime.loading import load_any

    recipe = load_recipe(args.recipe)
    model, tokenizer, _ = load_model("smollm2-135m")
    calib = build_calibration("wikitext2", tokenizer, args.calib_samples, args.calib_seqlen, 0, args.data_dir)
    ids = wikitext2_test_ids(tokenizer, args.data_dir)
    runs = [(s, True) for s in args.shares.split(",")] + [(s, False) for s in (args.free or "").split(",") if s]
    for share, quads in runs:
        budget = None if share == "none" else parse_outliers(f"{share}%", args.scope)
        if budget is not None and not quads:
            budget = type(budget)(budget.kind, budget.value, budget.scope, quads=False)
        tag = f"{recipe.name}-{share}{'' if quads else '-free'}{'-global' if args.scope == 'global' else ''}"
        out = Path(args.work) / tag
        t0 = time.perf_counter()
        result = quantize_model(copy.deepcopy(model), recipe, calib.tokens, device=args.device, batch_size=8,
                                outliers=budget, keep_float_weights=args.keep_float_weights)
        seconds = time.perf_counter() - t0
        quantized.save(result, tokenizer, str(out), "smollm2-135m", calib.describe(), overwrite=True)
        loaded = load_any(str(out), device=args.device)
        t0 = time.perf_counter()
        windows = min(ids.numel() // 2048, args.max_windows or 10**9)
        nlls = window_nlls(loaded.model, ids, 2048, windows)
        record = {
            "recipe": recipe.name, "share_percent": share, "selection": "quads" if quads else "free",
            "scope": args.scope, "outliers": (result.outliers or {}).get("count", 0),
            "ppl": round(_ppl(nlls, 2048), 4), "windows": windows,
            "ppl_first_20": round(_ppl(nlls[:20], 2048), 4), "ppl_first_40": round(_ppl(nlls[:40], 2048), 4),
            "window_nll": [round(v, 3) for v in nlls], "quantize_seconds": round(seconds, 1),
            "eval_seconds": round(time.perf_counter() - t0, 1), "folder": str(out),
            "calibration": f"wikitext2 validation {args.calib_samples}x{args.calib_seqlen}",
            "device": args.device,
        }
        _append(args.json, record)
        del loaded, result


def storage(args) -> None:
    from qoqtool.packing import folder as fs
    from qoqtool.packing import quantized, tile_coo

    for folder in args.folders:
        manifest = fs.read_manifest(folder)
        outliers = quantized.load_outliers(folder, manifest)
        total = {"bits": 0, "csr_bits": 0, "nnz": 0, "padding_slots": 0, "entries": 0, "weights": 0}
        exact, conflicts, steps, t0 = 0, 0, 0, time.perf_counter()
        for name, sparse in outliers.items():
            meta = manifest["linears"][name]
            k_padded = -(-meta["shape"][1] // (meta.get("group_size") or 32)) * (meta.get("group_size") or 32)
            tc = tile_coo.encode(sparse, k_padded)
            back = tile_coo.decode(tc)
            same = torch.equal(back.rows, sparse.rows) and torch.equal(back.cols, sparse.cols)
            exact += same and torch.equal(back.values.view(torch.int16), sparse.values.view(torch.int16))
            st = tile_coo.storage(tc)
            for key in ("bits", "csr_bits", "nnz", "padding_slots", "entries"):
                total[key] += st[key]
            total["weights"] += sparse.shape[0] * sparse.shape[1]
            c, n_steps = tile_coo.arrangement_report(tc)
            conflicts, steps = conflicts + c, steps + n_steps
        nnz = max(total["nnz"], 1)
        _append(args.json, {
            "folder": folder, "linears": len(outliers), "round_trip_exact": f"{exact}/{len(outliers)}",
            "outliers": total["nnz"], "share_percent": round(100 * total["nnz"] / max(total["weights"], 1), 4),
            "tile_coo_bits_per_outlier": round(total["bits"] / nnz, 2),
            "csr16_bits_per_outlier": round(total["csr_bits"] / nnz, 2),
            "padding_share": round(total["padding_slots"] / max(4 * total["entries"], 1), 4),
            "outlier_bits_per_weight": round(total["bits"] / max(total["weights"], 1), 4),
            "steps_with_gather_conflicts": f"{conflicts}/{steps}",
            "encode_decode_seconds": round(time.perf_counter() - t0, 1),
        })


def pack_time(args) -> None:
    """`qoqtool pack --outliers` on a folder quantized without them, timed end to end (read
    and verify the folder, float weights, selection, dense packing, Tile-COO encoding with
    its validation and round-trip check, writing), with the storage figures it reports."""
    import tempfile

    from qoqtool.packing.packed import pack_folder
    from qoqtool.quantizers.outliers import parse_outliers

    budget = parse_outliers(args.outliers, args.scope)
    with tempfile.TemporaryDirectory(dir=args.work if Path(args.work).is_dir() else None) as tmp:
        t0, cpu0 = time.perf_counter(), time.process_time()
        report = pack_folder(args.folder, str(Path(tmp) / "packed"), budget)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    section, st = report["outliers"], report["outliers"]["storage"]
    _append(args.json, {
        "folder": args.folder, "outliers": args.outliers, "scope": args.scope, "refit": section["refit"],
        "count": section["count"], "threads": torch.get_num_threads(),
        "read_seconds": report["seconds"]["read"],
        "choose_seconds": report["seconds"]["choose_outliers"],  # float weights + selection
        "total_seconds": round(seconds, 1),
        "total_cpu_seconds": round(cpu, 1),
        "tile_coo_bits_per_outlier": round(st["bits_per_outlier"], 2),
        "csr16_bits_per_outlier": round(st["csr16_bits_per_outlier"], 2),
        "padding_share": round(st["padding_share"], 4),
        "bits_per_weight_dense": round(st["bits_per_weight_dense"], 4),
        "bits_per_weight_with_outliers": round(st["bits_per_weight_with_outliers"], 4),
        "bits_per_weight_with_csr16": round(st["bits_per_weight_with_csr16"], 4),
        "mean_output_rel_error": section.get("mean_output_rel_error"),
    })


def report(args) -> None:
    """The accuracy table as markdown, from the JSON the accuracy runs appended."""
    rows = json.loads(Path(args.json).read_text())
    print("| recipe | outliers | selection | count | ppl (148 windows) | first 40 | first 20 | quantize s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "ppl" not in r:
            continue
        full = f"{r['ppl']:.2f}" if r["windows"] >= 148 else "-"
        print(f"| {r['recipe']} | {r['share_percent']}% | {r['selection']} | {r['outliers']:,} | {full} | "
              f"{r['ppl_first_40']:.2f} | {r['ppl_first_20']:.2f} | {r['quantize_seconds']:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    acc = sub.add_parser("accuracy")
    acc.add_argument("-r", "--recipe", required=True)
    acc.add_argument("--shares", default="0,0.5,1,2", help="percent; 'none' = no --outliers at all")
    acc.add_argument("--free", default="", help="shares (percent) to run with one-by-one (not quad) selection")
    acc.add_argument("--scope", default="layer", choices=("layer", "global"))
    acc.add_argument("--max-windows", type=int, default=None)
    acc.add_argument("--calib-samples", type=int, default=64)
    acc.add_argument("--calib-seqlen", type=int, default=512)
    acc.add_argument("--keep-float-weights", action="store_true")
    acc.add_argument("--device", default="cpu", help="where to calibrate and evaluate (cuda: the reference path on the GPU)")
    st = sub.add_parser("storage")
    st.add_argument("folders", nargs="+")
    pt = sub.add_parser("pack-time")
    pt.add_argument("folder")
    pt.add_argument("--outliers", default="1%")
    pt.add_argument("--scope", default="layer", choices=("layer", "global"))
    rp = sub.add_parser("report")
    for p in (acc, st, pt, rp):
        p.add_argument("--json", default=None, help="append results to this JSON list")
        p.add_argument("--work", default="/tmp/qoqtool-outliers")
        p.add_argument("--data-dir", default=os.environ.get("QOQTOOL_DATA_DIR", "/work/shared/data"))
    args = parser.parse_args()
    {"accuracy": accuracy, "storage": storage, "pack-time": pack_time, "report": report}[args.what](args)


if __name__ == "__main__":
    main()
