"""Where a kernel's warps stall, from an Nsight Compute source export (no GPU needed).

    ncu -k regex:stream_kernel --section SourceCounters -o REPORT python benchmarks/profile_gemm.py ...
    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > SASS.csv
    python benchmarks/ncu_stalls.py SASS.csv [--top 25]

Prints the sampled stall reasons over the whole kernel, the samples per region - instructions
grouped by how often they executed, so a loop body shows as one group (e.g. once per chunk, once
per outlier group) - and the instructions with the most samples, each with its main reason.
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=25, help="instructions to list (default 25)")
    a = ap.parse_args()
    rows = list(csv.reader(open(a.csv)))
    at = next(i for i, r in enumerate(rows) if r and r[0] == "Address")  # the header row
    header, body = rows[at], [r for r in rows[at + 1 :] if len(r) == len(rows[at])]
    col = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    samples = [number(r[col["Warp Stall Sampling (All Samples)"]]) for r in body]
    executed = [int(number(r[col["Instructions Executed"]])) for r in body]
    total = sum(samples) or 1.0
    print(f"{rows[0][1] if len(rows[0]) > 1 else ''}")
    print(f"{len(body)} instructions, {sum(executed):,} executed (warp level), {int(total)} stall samples")
    by_reason = {h: sum(number(r[col[h]]) for r in body) for h in reasons}
    print("reasons: " + ", ".join(f"{h[6:]} {v / total:.1%}" for h, v in sorted(by_reason.items(), key=lambda x: -x[1]) if v))
    regions = defaultdict(lambda: [0, 0, 0.0])
    for n, s in zip(executed, samples):
        regions[n][0] += 1
        regions[n][1] += n
        regions[n][2] += s
    print("\nregions (instructions executed the same number of times):")
    for n, (count, ex, s) in sorted(regions.items()):
        if ex:
            print(f"  x{n:>8,}: {count:5d} instructions, {ex:>11,} executed, {int(s):5d} samples ({s / total:.1%})")
    print(f"\ntop {a.top} instructions by samples (index, times executed, samples, main reason, SASS):")
    order = sorted(range(len(body)), key=lambda i: -samples[i])[: a.top]
    for i in order:
        main_reason = max(reasons, key=lambda h: number(body[i][col[h]]))
        print(f"  {i:5d} {executed[i]:>8,} {int(samples[i]):5d} {main_reason[6:]:16s} {body[i][col['Source']].strip()[:80]}")


if __name__ == "__main__":
    main()
