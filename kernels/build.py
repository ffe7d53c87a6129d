"""Build the CUDA kernels into one shared library, cached by source hash.

Why not torch.utils.cpp_extension: the kernels have a plain C ABI (raw pointers, sizes and
a cudaStream_t, returning a cudaError_t), so the library depends on no torch headers and
no torch ABI. The same nvcc command builds it on the CPU development machine (where CI
compile-checks it) and on the GPU machine, for any torch version; `qoqtool.runtime.cuda_ops`
loads it with ctypes and registers each entry point as a torch custom op.

    python -m qoqtool.kernels.build            build (or find in the cache) and print the path
    python -m qoqtool.kernels.build --check    compile every source for every target, link nothing

Cache: $QOQTOOL_KERNEL_CACHE (default ~/.cache/qoqtool/kernels)/<hash>/libqoqkernels.so,
where <hash> covers every source and header in this folder and the compiler flags. A
library built elsewhere can be dropped into the cache under the same hash.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent
LIBRARY_NAME = "libqoqkernels.so"

# sm_90a: Hopper with wgmma/setmaxnreg. sm_80: Ampere-class machine code for the kernels that
# only use mma.sync (the Hopper-only paths are compiled out there by __CUDA_ARCH__ guards).
ARCH_FLAGS = [
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_80,code=sm_80",
]
NVCC_FLAGS = [
    "-O3",
    "-std=c++17",
    "--use_fast_math",
    "-Xcompiler=-fPIC",
    # Function-local statics of inline functions (the launch settings: dependent launch,
    # staging, trace buffer) would otherwise be STB_GNU_UNIQUE, i.e. ONE per process: a second
    # build of this library loaded beside the first (benchmarks/library_ab.py) used the first
    # one's settings and defaults, not its own.
    "-Xcompiler=-fno-gnu-unique",
    "-Xptxas=-warn-spills",
    "--expt-relaxed-constexpr",
    "-lineinfo",
]


def sources() -> list[Path]:
    """Every .cu here, or only those named in $QOQTOOL_KERNEL_SOURCES (comma-separated stems),
    for building one kernel family while another is being edited."""
    chosen = os.environ.get("QOQTOOL_KERNEL_SOURCES")
    found = sorted(KERNEL_DIR.glob("*.cu"))
    if chosen:
        wanted = {s.strip() for s in chosen.split(",")} | {"errors"}
        found = [p for p in found if p.stem in wanted]
    return found


def headers() -> list[Path]:
    return sorted(KERNEL_DIR.glob("*.cuh"))


def nvcc_path() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for candidate in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if candidate and (Path(candidate) / "bin" / "nvcc").is_file():
            return str(Path(candidate) / "bin" / "nvcc")
    return None


def source_hash() -> str:
    h = hashlib.sha256()
    for path in sources() + headers():
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(" ".join(ARCH_FLAGS + NVCC_FLAGS).encode())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    return Path(os.environ.get("QOQTOOL_KERNEL_CACHE", Path.home() / ".cache" / "qoqtool" / "kernels"))


def library_path() -> Path:
    return cache_root() / source_hash() / LIBRARY_NAME


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed ({proc.returncode}):\n{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
    if proc.stderr.strip():
        print(proc.stderr.strip(), file=sys.stderr)


def _compile_objects(out_dir: Path, nvcc: str, extra: list[str], jobs: int) -> list[Path]:
    def one(src: Path) -> Path:
        obj = out_dir / (src.stem + ".o")
        _run([nvcc, *ARCH_FLAGS, *NVCC_FLAGS, *extra, "-I", str(KERNEL_DIR), "-c", str(src), "-o", str(obj)])
        return obj

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(one, sources()))


def build(force: bool = False, jobs: int | None = None) -> Path:
    """Compile and link the library if the cache has none for the current sources."""
    target = library_path()
    if target.is_file() and not force:
        return target
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found: install the CUDA toolkit or set CUDA_HOME to build the kernels")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objs = _compile_objects(Path(tmp), nvcc, [], jobs or os.cpu_count() or 1)
        staged = Path(tmp) / LIBRARY_NAME
        _run([nvcc, *ARCH_FLAGS, "-shared", "-o", str(staged), *map(str, objs)])
        os.replace(staged, target)  # atomic: a concurrent loader never sees half a library
    return target


def check(jobs: int | None = None) -> list[str]:
    """Compile every source for every target (no link). Returns the sources checked."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found")
    with tempfile.TemporaryDirectory() as tmp:
        objs = _compile_objects(Path(tmp), nvcc, [], jobs or os.cpu_count() or 1)
    return [o.stem for o in objs]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compile-check every source, link nothing")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument("--jobs", type=int, default=None)
    args = parser.parse_args(argv)
    if args.check:
        print("compiled:", ", ".join(check(args.jobs)))
    else:
        print(build(args.force, args.jobs))


if __name__ == "__main__":
    main()
