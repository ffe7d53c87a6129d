"""Which dependency scoreboards each SASS instruction of a kernel sets and waits on.

    nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 --use_fast_math --expt-relaxed-constexpr \
         -I kernels -cubin -o w4a8.cubin kernels/w4a8_gemm.cu
    nvdisasm -hex w4a8.cubin > w4a8.sass
    python benchmarks/sass_scoreboards.py w4a8.sass MANGLED_KERNEL_NAME [--grep LDS]

A variable-latency instruction (global or shared load, shuffle, cp.async, ...) sets one of six
scoreboards when it issues and clears it when its result is written; an instruction that needs
the result waits for the scoreboard. ptxas shares a scoreboard between loads, so a use can end
up waiting for loads it does not read: in the fused sparse-dense kernel every global load
counted on one scoreboard, and the first outlier group of every chunk waited for the next
chunk's weights as well as for its entry (benchmarks/notes-gemm.md, version 20).

The control bits are not documented by NVIDIA; the layout used here (bits 41-63 of the second
64-bit word of Volta-and-later 128-bit instructions: stall cycles 4, yield 1, write scoreboard 3,
read scoreboard 3, wait mask 6, reuse 4) is the one published by the reverse-engineering work on
Volta (Jia et al., "Dissecting the NVIDIA Volta GPU Architecture via Microbenchmarking", 2018)
and the open assemblers that followed; it matched every instruction checked by hand here (loads
set a scoreboard, their uses wait on it).

Printed per instruction: offset, stall count, W<scoreboard set on write> R<scoreboard set until
the source registers are read> wait[<scoreboards waited on>], the instruction.
"""

from __future__ import annotations

import argparse
import re

INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);\s*/\*\s*0x([0-9a-f]{16})\s*\*/")
HIGH_WORD = re.compile(r"/\*\s*0x([0-9a-f]{16})\s*\*/")


def decode(lines: list[str], function: str):
    """(offset, SASS, stall, write scoreboard, read scoreboard, wait mask) of each instruction
    of `function` in nvdisasm -hex output; scoreboard 7 = none."""
    start = next(i for i, line in enumerate(lines) if ".section" in line and f".text.{function}," in line.replace('"', ""))
    i = start + 1
    while i < len(lines) and ".section" not in lines[i]:
        m = INSTRUCTION.search(lines[i])
        if m and i + 1 < len(lines) and (hi := HIGH_WORD.search(lines[i + 1])):
            control = int(hi.group(1), 16) >> 41
            yield m.group(1), m.group(2).strip(), control & 0xF, (control >> 5) & 7, (control >> 8) & 7, (control >> 11) & 0x3F
            i += 2
            continue
        i += 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sass", help="nvdisasm -hex output")
    ap.add_argument("function", help="the kernel's mangled name")
    ap.add_argument("--grep", default=None, help="print only instructions containing this text")
    a = ap.parse_args()
    for offset, text, stall, write, read, wait in decode(open(a.sass).read().split("\n"), a.function):
        if a.grep and a.grep not in text:
            continue
        w = str(write) if write != 7 else "-"
        r = str(read) if read != 7 else "-"
        waits = ",".join(str(b) for b in range(6) if wait >> b & 1)
        print(f"{offset} S{stall:2d} W{w} R{r} wait[{waits:11s}] {text}")


if __name__ == "__main__":
    main()
