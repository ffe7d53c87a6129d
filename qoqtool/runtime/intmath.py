"""Exact integer matrix products on any device.

The reference path must produce the very INT32 accumulations the tensor cores produce.
`torch._int_mm` does that on the CPU (any shape) and on CUDA (M > 16, K and N multiples
of 8). Elsewhere we fall back to float64, which is exact while every partial sum stays
below 2^53 - true for int8 x int8 products (< 2^14 each) up to K = 2^39.
"""

from __future__ import annotations

import torch


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] int8 times b [N, K] int8 transposed -> [M, N] int32, exactly."""
    if a.dtype != torch.int8 or b.dtype != torch.int8:
        raise TypeError(f"int8_matmul takes int8 operands, got {a.dtype} and {b.dtype}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"inner dimensions differ: {tuple(a.shape)} x {tuple(b.shape)}^T")
    m, k = a.shape
    n = b.shape[0]
    if a.device.type == "cpu":
        return torch._int_mm(a.contiguous(), b.t().contiguous())
    if m > 16 and k % 8 == 0 and n % 8 == 0:
        # cuBLASLt's int8 path wants the second operand column-major: b.t() of a row-major b.
        try:
            return torch._int_mm(a.contiguous(), b.contiguous().t())
        except RuntimeError:  # a layout this build's cuBLASLt refuses: the exact fallback below
            pass
    return (a.double() @ b.double().t()).to(torch.int32)
