"""Static check of the compiled wgmma kernels: no register that an in-flight wgmma reads (its A
operand, when A comes from registers) or accumulates into is written before a wait retires it.

Why: wgmma.mma_async reads its A registers asynchronously, until wgmma.wait_group retires it,
and overwriting them earlier is undefined behaviour (PTX ISA). ptxas does not enforce this: it
allocates registers and schedules writes as if the A operand were read at issue. A version of
the wgmma kernel whose loads and dequantization ptxas moved above the waits gave wrong sums on
the H200, and the version before it passed every test with such writes in its SASS
(benchmarks/notes-gemm.md, version 6). So the SASS itself is checked, here and in CI.

    python -m qoqtool.kernels.check_sass      compile, disassemble, report; exit 1 on a hazard

Needs nvcc and nvdisasm (on PATH, next to nvcc, or from the `nvidia-cuda-nvdisasm` wheel).
The scan: in address order, an IGMMA with A = Rx adds Rx..Rx+3 to the in-flight set (and its
accumulators, N / 2 registers from D for 64 x N), the IGMMA marked `gsb0` closes its commit
group, `WARPGROUP.DEPBAR.LE gsb0, N` retires all but the newest N groups, and any instruction
writing a register of a group still in flight is a hazard;
each loop containing an IGMMA (a backward branch) is also scanned twice in a row, so that writes
at the top of the next iteration are seen. (The scan is linear: a wait on a branch the run
skips counts as passed, so a kernel's waits should sit on the paths they protect. A write's
width comes from the opcode: .128 four registers, .64 or WIDE two, else one - enough for these
kernels' instructions.)
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from qoqtool.kernels import build

SOURCES = ("w4a8_gemm", "w8a8_gemm")  # the entry points that instantiate wgmma_kernel
_NO_REGISTER_WRITE = ("ST", "BRA", "BAR", "SYNCS", "EXIT", "RET", "ISETP", "UISETP", "WARPSYNC", "NOP", "BSYNC", "BSSY",
                      "WARPGROUP", "FENCE", "MEMBAR", "ELECT", "UTMALDG", "R2UR")


def nvdisasm_path() -> str | None:
    found = shutil.which("nvdisasm")
    if found:
        return found
    nvcc = build.nvcc_path()
    if nvcc and (Path(nvcc).parent / "nvdisasm").is_file():
        return str(Path(nvcc).parent / "nvdisasm")
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for candidate in sorted(Path(root).glob("*/bin/nvdisasm")):
            return str(candidate)
    return None


def _instructions(body: str) -> tuple[list[tuple[int, str]], dict[str, int]]:
    instrs, labels, waiting = [], {}, []
    for line in body.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line.strip())
        if label:
            waiting.append(label.group(1))
            continue
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            addr = int(m.group(1), 16)
            labels.update({name: addr for name in waiting})
            waiting = []
            instrs.append((addr, m.group(2)))
    return instrs, labels


def _scan(instrs: list[tuple[int, str]], hazards: set[str]) -> None:
    groups: list[set[int]] = []  # committed wgmma groups still in flight, oldest first
    open_group: set[int] = set()  # wgmmas issued since the last commit
    for addr, ins in instrs:
        if "IGMMA" in ins:
            a = re.search(r"IGMMA\S*\s+R\d+,\s*R(\d+),", ins)  # RS form: D, A registers, B descriptor
            if a:
                open_group |= set(range(int(a.group(1)), int(a.group(1)) + 4))
            # The accumulators too (both forms): 64 x N s32 over 128 threads is N / 2 registers.
            d = re.search(r"IGMMA\.64x(\d+)x\S*\s+R(\d+),", ins)
            if d:
                open_group |= set(range(int(d.group(2)), int(d.group(2)) + int(d.group(1)) // 2))
            if re.search(r"\bgsb0\b", ins):  # the group's last wgmma: wgmma.commit_group
                groups.append(open_group)
                open_group = set()
            continue
        wait = re.search(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)", ins)
        if wait:  # wgmma.wait_group N: all but the newest N committed groups have retired
            keep = int(wait.group(1), 16)
            if keep:
                groups = groups[-keep:]
            else:  # wait_group 0 also retires wgmmas not yet committed
                groups, open_group = [], set()
            continue
        op = re.sub(r"^@!?U?P\w+\s+", "", ins).split(None, 1)
        if len(op) < 2 or op[0].startswith(_NO_REGISTER_WRITE):
            continue
        dst = re.match(r"R(\d+)", op[1].strip())
        if dst:
            width = 4 if ".128" in op[0] else 2 if (".64" in op[0] or "WIDE" in op[0]) else 1
            in_flight = open_group.union(*groups)
            if set(range(int(dst.group(1)), int(dst.group(1)) + width)) & in_flight:
                hazards.add(f"{addr:05x}  {ins}")


def hazards_in_sass(sass: str) -> dict[str, list[str]]:
    """{wgmma kernel name: hazardous instructions} for every wgmma kernel in an nvdisasm listing."""
    found = {}
    for name, body in re.findall(r"^\.text\.(\S*wgmma_kernel\S*):\n(.*?)(?=^\.text\.|\Z)", sass, re.S | re.M):
        instrs, labels = _instructions(body)
        hazards: set[str] = set()
        _scan(instrs, hazards)
        for addr, ins in instrs:
            target = re.search(r"BRA\S*\s.*`\((\.L_x_\d+)\)", ins)
            if target and labels.get(target.group(1), addr) < addr:
                loop = [x for x in instrs if labels[target.group(1)] <= x[0] <= addr]
                if any("IGMMA" in x[1] for x in loop):
                    _scan(loop + loop, hazards)
        found[name] = sorted(hazards)
    return found


def check() -> dict[str, list[str]]:
    """Compile the wgmma entry points for sm_90a with the library's flags and scan their SASS."""
    nvcc, nvdisasm = build.nvcc_path(), nvdisasm_path()
    if nvcc is None or nvdisasm is None:
        raise RuntimeError("check_sass needs nvcc and nvdisasm (pip install nvidia-cuda-nvdisasm)")
    flags = [f for f in build.NVCC_FLAGS if f != "-lineinfo"]
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for stem in SOURCES:
            cubin = Path(tmp) / f"{stem}.cubin"
            subprocess.run([nvcc, *flags, "-gencode=arch=compute_90a,code=sm_90a", "-cubin",
                            str(build.KERNEL_DIR / f"{stem}.cu"), "-o", str(cubin)], check=True, capture_output=True)
            sass = subprocess.run([nvdisasm, "-c", str(cubin)], check=True, capture_output=True, text=True).stdout
            found.update(hazards_in_sass(sass))
    return found


def main() -> int:
    found = check()
    for name, hazards in found.items():
        print(f"{name}: {len(hazards)} writes to registers an in-flight wgmma uses")
        for h in hazards[:8]:
            print("    " + h)
    return 1 if any(found.values()) or not found else 0


if __name__ == "__main__":
    sys.exit(main())
