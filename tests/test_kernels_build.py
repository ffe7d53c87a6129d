"""CI: every kernel source compiles with nvcc, for every target, on a machine without a GPU."""

import subprocess
import sys

import pytest

from qoqtool.kernels import build


@pytest.mark.skipif(build.nvcc_path() is None, reason="nvcc is not installed: the kernel sources cannot be compile-checked")
def test_every_kernel_source_compiles_for_every_target():
    checked = build.check()
    assert sorted(checked) == sorted(p.stem for p in build.sources())


def test_importing_the_ops_builds_and_loads_nothing():
    """GPU-free parts of qoqtool may import qoqtool.runtime.cuda_ops: nothing is compiled or
    loaded until an op is called."""
    probe = ("import sys, qoqtool.runtime.cuda_ops as ops; "
             "assert ops._lib.cache_info().currsize == 0; assert 'qoqtool.kernels.build' not in sys.modules")
    subprocess.run([sys.executable, "-c", probe], check=True)
