"""CI: every kernel source compiles with nvcc, for every target, on a machine without a GPU; the
wgmma kernels' SASS never overwrites a register an in-flight wgmma still reads."""

import shutil
import subprocess
import sys

import pytest

from qoqtool.kernels import build, check_sass


@pytest.mark.skipif(build.nvcc_path() is None, reason="nvcc is not installed: the kernel sources cannot be compile-checked")
def test_every_kernel_source_compiles_for_every_target():
    checked = build.check()
    assert sorted(checked) == sorted(p.stem for p in build.sources())


def test_importing_the_ops_builds_and_loads_nothing():
    """GPU-free parts of qoqtool may import qoqtool.runtime.cuda_ops: nothing is compiled or
    loaded until an op is called."""
    probe = ("import sys, qoqtool.runtime.cuda_ops as ops; "
             "assert ops._load.cache_info().currsize == 0; assert 'qoqtool.kernels.build' not in sys.modules")
    subprocess.run([sys.executable, "-c", probe], check=True)


def test_the_kernel_folder_does_not_hide_an_installed_kernels_package():
    """From the checkout's root (where `python -m pytest` puts it on sys.path) `import kernels`
    means Hugging Face's kernel hub package, which transformers >= 5.25 imports, not this
    checkout's kernels/ folder (qoqtool.kernels); with no such package installed it stays the folder,
    importable and without a version, as transformers' probe for the hub package expects."""
    probe = ("import importlib.metadata, os, sys, kernels\n"
             "ours = os.path.dirname(os.path.abspath(kernels.__file__)) == sys.argv[1]\n"
             "try:\n    importlib.metadata.version('kernels')\nexcept importlib.metadata.PackageNotFoundError:\n"
             "    assert ours and not hasattr(kernels, '__version__'), kernels.__file__\n"
             "else:\n    assert not ours, kernels.__file__\n")
    subprocess.run([sys.executable, "-c", probe, str(build.KERNEL_DIR)], check=True, cwd=build.KERNEL_DIR.parent)
    # Without the installed package on the path (as on a machine with transformers < 5.25).
    hidden = ("import os, sys\n"
              "sys.path = [p for p in sys.path if 'site-packages' not in p and 'dist-packages' not in p]\n"
              "import kernels\n"
              "assert os.path.dirname(os.path.abspath(kernels.__file__)) == sys.argv[1], kernels.__file__\n")
    subprocess.run([sys.executable, "-S", "-c", hidden, str(build.KERNEL_DIR)], check=True, cwd=build.KERNEL_DIR.parent)


@pytest.mark.skipif(build.nvcc_path() is None, reason="nvcc is not installed: the benchmark CUDA sources cannot be compile-checked")
@pytest.mark.parametrize("source", sorted((build.KERNEL_DIR.parent / "benchmarks").glob("*.cu")), ids=lambda p: p.name)
def test_benchmark_cuda_sources_compile(source, tmp_path):
    """Stand-alone CUDA programs under benchmarks/ (built by hand on the GPU machine) compile too."""
    subprocess.run([build.nvcc_path(), "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-c", str(source),
                    "-o", str(tmp_path / "out.o")], check=True, capture_output=True)


@pytest.mark.skipif(build.nvcc_path() is None or shutil.which("patch") is None,
                    reason="nvcc or patch is not installed: the wgmma probes cannot be compile-checked")
def test_the_wgmma_probes_apply_and_compile(tmp_path):
    """benchmarks/wgmma_probes.patch still applies to the kernels, and the probed W4A8 kernels
    compile (probe 5: the refills' own copy code; 9: the timeline stamps and their launcher)."""
    shutil.copytree(build.KERNEL_DIR, tmp_path / "kernels")
    patch = build.KERNEL_DIR.parent / "benchmarks" / "wgmma_probes.patch"
    subprocess.run(["patch", "-s", "-p1", "-d", str(tmp_path), "-i", str(patch)], check=True, capture_output=True)
    for probe in (5, 9):
        subprocess.run([build.nvcc_path(), "-std=c++17", "-O1", "-gencode=arch=compute_90a,code=sm_90a", f"-DQOQ_WGMMA_PROBE={probe}",
                        "-I", str(tmp_path / "kernels"), "-c", str(tmp_path / "kernels" / "w4a8_gemm.cu"),
                        "-o", str(tmp_path / f"probe{probe}.o")], check=True, capture_output=True)


@pytest.mark.skipif(build.nvcc_path() is None or check_sass.nvdisasm_path() is None,
                    reason="nvcc or nvdisasm is not installed: the wgmma kernels' SASS cannot be checked")
def test_no_wgmma_a_register_is_overwritten_in_flight():
    found = check_sass.check()
    # three weight kinds x (one or two 128-row warpgroups, three 64-row ones, the K2 form with 128
    # or 64 tokens), and progressive UINT8 + 128
    assert len(found) == 20
    assert {name: h for name, h in found.items() if h} == {}


# A loop in nvdisasm's format: the A registers R8..R11 of the IGMMA are rewritten at the top of
# the next iteration, before any wait retires it (the hazard); with the DEPBAR moved up, not.
_LOOP = """.text._ZN3qoq4gemm12wgmma_kernelILNS0_4KindE0ELi1EEEvNS0_6ParamsENS0_7TmaMapsE:
.L_x_1:
        /*0100*/                   LDS.128 R8, [R2] ;
        /*0110*/                   WARPGROUP.ARRIVE ;
        /*0120*/                   IGMMA.64x128x32.S8.S8 R24, R8, gdesc[UR4], R24, gsb0 ;
        /*0130*/                   IADD3 R2, R2, 0x10, RZ ;
        /*0140*/              @!P0 BRA `(.L_x_1) ;
        /*0150*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
"""


def test_the_sass_check_finds_a_write_to_in_flight_a_registers():
    (hazards,) = check_sass.hazards_in_sass(_LOOP).values()
    assert hazards == ["00100  LDS.128 R8, [R2]"]
    fixed = _LOOP.replace("        /*0130*/                   IADD3", "        /*0128*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;\n"
                          "        /*0130*/                   IADD3")
    (hazards,) = check_sass.hazards_in_sass(fixed).values()
    assert hazards == []
    # an accumulator (R24..R87 for 64 x 128) written while the wgmma runs
    touched = _LOOP.replace("IADD3 R2, R2, 0x10, RZ", "IADD3 R30, R2, 0x10, RZ")
    (hazards,) = check_sass.hazards_in_sass(touched).values()
    assert hazards == ["00100  LDS.128 R8, [R2]", "00130  IADD3 R30, R2, 0x10, RZ"]


# Two A buffers (R8.. and R12..), each stage its own commit group: `DEPBAR.LE gsb0, 0x1` after the
# second group retires only the first, so R8 may be rewritten after it and R12 may not.
_TWO_GROUPS = """.text._ZN3qoq4gemm12wgmma_kernelILNS0_4KindE0ELi3EEEvNS0_6ParamsENS0_7TmaMapsE:
        /*0100*/                   LDS.128 R8, [R2] ;
        /*0110*/                   WARPGROUP.ARRIVE ;
        /*0120*/                   IGMMA.64x128x32.S8.S8 R24, R8, gdesc[UR4], R24, gsb0 ;
        /*0130*/                   LDS.128 R12, [R2+0x10] ;
        /*0140*/                   WARPGROUP.ARRIVE ;
        /*0150*/                   IGMMA.64x128x32.S8.S8 R24, R12, gdesc[UR8], R24, gsb0 ;
        /*0160*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0170*/                   LDS.128 R8, [R2+0x20] ;
        /*0180*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
"""


def test_the_sass_check_follows_waits_that_retire_only_older_groups():
    (hazards,) = check_sass.hazards_in_sass(_TWO_GROUPS).values()
    assert hazards == []
    # the second buffer rewritten after the partial wait: its group is still in flight
    early = _TWO_GROUPS.replace("LDS.128 R8, [R2+0x20]", "LDS.128 R12, [R2+0x20]")
    (hazards,) = check_sass.hazards_in_sass(early).values()
    assert hazards == ["00170  LDS.128 R12, [R2+0x20]"]
    # the first buffer rewritten before the partial wait: its group is not yet retired
    before = _TWO_GROUPS.replace("        /*0160*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;\n", "")
    (hazards,) = check_sass.hazards_in_sass(before).values()
    assert hazards == ["00170  LDS.128 R8, [R2+0x20]"]
