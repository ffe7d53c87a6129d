"""Load the CUDA kernel library (built by qoqtool.kernels.build) through ctypes.

Nothing here imports torch.cuda or compiles anything until `library()` is called, so the
GPU-free parts of qoqtool never touch the kernels. Op modules (qoqtool.runtime.cuda_ops,
qoqtool.runtime.attention_ops) declare their entry points' signatures on the loaded library.
"""

from __future__ import annotations

import ctypes
import functools


class KernelsUnavailable(RuntimeError):
    """No CUDA device, no nvcc, or the library failed to build/load."""


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    import torch

    if not torch.cuda.is_available():
        raise KernelsUnavailable("no CUDA device is visible")
    from qoqtool.kernels import build

    try:
        path = build.build()
    except RuntimeError as err:
        raise KernelsUnavailable(str(err)) from err
    torch.cuda.init()  # make sure the primary context exists before our runtime sees it
    return ctypes.CDLL(str(path))


def available() -> bool:
    try:
        library()
        return True
    except KernelsUnavailable:
        return False


def check(status: int, what: str) -> None:
    """Raise if an entry point returned a non-zero cudaError_t."""
    if status != 0:
        lib = library()
        lib.qoq_error_string.restype = ctypes.c_char_p
        lib.qoq_error_string.argtypes = [ctypes.c_int]
        raise RuntimeError(f"{what} failed: CUDA error {status} ({lib.qoq_error_string(status).decode()})")


def ptr(t) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def ptr_or_null(t) -> ctypes.c_void_p:
    """ptr(t), or a null pointer for an optional operand that is None."""
    return ctypes.c_void_p(None) if t is None else ptr(t)


def stream_of(t) -> ctypes.c_void_p:
    import torch

    return ctypes.c_void_p(torch.cuda.current_stream(t.device).cuda_stream)
