"""Zero-shot benchmark: full PIQA, ARC-Easy and ARC-Challenge through lm-eval, timed.

    # score one model (original, quantized or packed folder) and write its JSON record
    python benchmarks/zeroshot.py run smollm2-135m --label fp32 --data-dir /work/shared/data
    python benchmarks/zeroshot.py run /tmp/smol-rtn-w8a8 --label rtn-w8a8 --data-dir /work/shared/data

    # the markdown table of every record written so far (for benchmarks/RESULTS.md)
    python benchmarks/zeroshot.py table

The scoring is exactly `qoqtool eval MODEL --tasks piqa,arc` (same code path); this script
adds the wall-clock and CPU time of each task, the machine's load while it ran (the CPU is shared),
and one JSON record per model under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

RESULTS_DIR = Path(__file__).parent / "results"
TASKS = ["piqa", "arc_easy", "arc_challenge"]


def run(args) -> None:
    import torch

    from qoqtool.eval.tasks import EvalSettings
    from qoqtool.eval.zeroshot import average, run_zero_shot
    from qoqtool.packing import folder as fs
    from qoqtool.runtime.loading import load_any

    settings = EvalSettings(data_dir=args.data_dir, limit=args.limit, batch_size=args.batch_size)
    t0 = time.perf_counter()
    loaded = load_any(args.model, device=args.device)
    load_seconds = time.perf_counter() - t0
    load_before = os.getloadavg()
    # One task at a time, to time each. CPU seconds (all threads) next to wall seconds:
    # on a shared machine the wall clock measures the neighbours as much as the model.
    results, wall, cpu = {}, {}, {}
    for task in TASKS:
        w0, c0 = time.perf_counter(), time.process_time()
        results.update(run_zero_shot(loaded, [task], settings, show_progress=True))
        wall[task], cpu[task] = time.perf_counter() - w0, time.process_time() - c0
    record = {
        "label": args.label,
        "model": args.model,
        "kind": loaded.kind,
        "recipe": loaded.manifest.get("recipe", {}).get("name"),
        "results": results,
        "average": average(results),
        "seconds": {"load": round(load_seconds, 1), "tasks": round(sum(wall.values()), 1),
                    **{t: round(wall[t], 1) for t in TASKS}},
        "cpu_seconds": {"tasks": round(sum(cpu.values()), 1), **{t: round(cpu[t], 1) for t in TASKS}},
        "machine": {
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": args.device,
            "processor": platform.processor() or platform.machine(),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        },
        "settings": {"batch_size": args.batch_size, "limit": args.limit, "num_fewshot": 0},
        "versions": fs.versions(),
    }
    out = Path(args.out) if args.out else RESULTS_DIR / f"zeroshot-{args.label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"{args.label}: {sum(wall.values()):.0f} s ({sum(cpu.values()):.0f} CPU s) for {', '.join(TASKS)}; wrote {out}")


def table(_args) -> None:
    """Markdown rows (accuracy in %, ± stderr) from every record in benchmarks/results/,
    with each average's difference from the fp32 record of the same device."""
    records = [json.loads(p.read_text()) for p in sorted(RESULTS_DIR.glob("zeroshot-*.json"))]
    fp32 = {r["machine"]["device"]: r["average"] for r in records if r["kind"] == "original"}
    head = ["model", "device"] + [f"{t} {m}" for t in TASKS for m in ("acc", "acc_norm")]
    head += ["avg acc", "avg acc_norm", "Δ avg acc", "Δ avg acc_norm", "time (s)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in records:
        cells = [r["label"], r["machine"]["device"]]
        for t in TASKS:
            for m in ("acc", "acc_norm"):
                res = r["results"][t]
                cells.append(f"{100 * res[m + ',none']:.2f} ± {100 * res[m + '_stderr,none']:.2f}")
        avg, ref = r["average"], fp32.get(r["machine"]["device"])
        cells += [f"{100 * avg[k]:.2f}" for k in ("acc,none", "acc_norm,none")]
        cells += [f"{100 * (avg[k] - ref[k]):+.2f}" if ref else "" for k in ("acc,none", "acc_norm,none")]
        cells.append(f"{r['seconds']['tasks']:.0f}")
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="score one model on the three full tasks")
    p.add_argument("model", help="smollm2-135m, a quantized folder or a packed folder")
    p.add_argument("--label", required=True, help="name of the record, e.g. fp32 or rtn-w8a8")
    p.add_argument("--data-dir", default=os.environ.get("QOQTOOL_DATA_DIR"), help="local copies of the data sets")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--limit", type=int, default=None, help="items per task (default: all)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="JSON record [default: benchmarks/results/zeroshot-LABEL.json]")
    p.set_defaults(fn=run)
    t = sub.add_parser("table", help="print the markdown table of all records")
    t.set_defaults(fn=table)
    args = parser.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
