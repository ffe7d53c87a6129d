"""Perplexities of the same windows from separate `qoqtool eval --json` runs, window by window.

    python benchmarks/compare_ppl.py REFERENCE.json OTHER.json [OTHER.json ...] [--blocks 16]

Each OTHER's WikiText-2 perplexity over REFERENCE's, with the paired standard error over the
windows (qoqtool.eval.perplexity.paired_ratio): how far apart two evaluations of the same
windows are, and whether the sample can tell. It is for runs that one `qoqtool eval A B` cannot
make, e.g. a packed model through the GPU kernels against the exact CPU reference path (two
devices). The runs must have scored the same windows (seqlen, --max-windows) and written
per-window NLLs (qoqtool eval from 2026-12-07 on). --blocks N adds the ratio over each
consecutive block of N windows: how far a sample of N windows lands from the whole (on
2026-12-07 a 16-window sample of the decode comparison read +1.0% where 128 windows read +0.09%).
"""

from __future__ import annotations

import argparse
import json
import sys

from qoqtool.eval.perplexity import paired_ratio


def wikitext2(path: str) -> dict:
    record = json.load(open(path))
    result = record.get("results", {}).get("wikitext2")
    if not result or "window_nll" not in result:
        sys.exit(f"{path}: no per-window WikiText-2 NLLs (a single-model `qoqtool eval --json` from 2026-12-07 on)")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reference", help="qoqtool eval --json of the reference run")
    ap.add_argument("others", nargs="+", help="qoqtool eval --json of runs to set against it")
    ap.add_argument("--blocks", type=int, default=0, metavar="N",
                    help="also the ratio over each consecutive block of N windows")
    args = ap.parse_args()
    ref = wikitext2(args.reference)
    print(f"reference {args.reference}: ppl {ref['ppl']:.4f}, {ref['windows']} windows of {ref['seqlen']} tokens")
    print(f"{'run':>50} | {'ppl':>9} | {'/ reference':>11} | {'paired stderr':>13}")
    for path in args.others:
        other = wikitext2(path)
        try:
            ratio, stderr = paired_ratio(ref, other)
        except ValueError as err:
            sys.exit(f"{path}: {err}")
        shown = "-" if stderr is None else f"{100 * stderr:.3f}%"
        print(f"{path[-50:]:>50} | {other['ppl']:>9.4f} | {100 * (ratio - 1):>+10.3f}% | {shown:>13}")
        if 0 < args.blocks < len(ref["window_nll"]):  # one block would repeat the line above
            starts = range(0, len(ref["window_nll"]), args.blocks)
            ratios = [paired_ratio(block(ref, i, args.blocks), block(other, i, args.blocks))[0] for i in starts]
            print(f"{'by ' + str(args.blocks) + ' windows':>50} | " + " ".join(f"{100 * (r - 1):+.2f}%" for r in ratios))


def block(result: dict, start: int, size: int) -> dict:
    """The windows start .. start + size of a wikitext2 result, as a result of their own."""
    return {"seqlen": result["seqlen"], "window_nll": result["window_nll"][start:start + size]}


if __name__ == "__main__":
    main()
