"""Dynamic activation and KV-cache quantizers (computed at run time, nothing stored).

Per-token INT8 activations (symmetric):
    s = fp16(max|x| / 127),  q = clamp(round(x / s), -127, 127)

Per-token, per-head KV (asymmetric, after RoPE for K), one (scale, zero) per token and
KV head over head_dim values, both FP16:
    s = fp16((max - min) / (2^b - 1)),  m = fp16(min)
    q = clamp(round((x - m) / s), 0, 2^b - 1),  x' = q * s + m
Storing the minimum as a float zero lets the attention kernel dequantize with one FMA.
Rounding is half-to-even everywhere, as CUDA's __float2int_rn.
"""

from __future__ import annotations

import torch

FP16_TINY = 2.0**-24  # smallest positive FP16 (subnormal): scales never round to zero


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (codes [M, K] int8, scales [M] float32 holding FP16 values)."""
    amax = x.float().abs().amax(dim=-1)
    scale = (amax / 127).clamp(min=FP16_TINY).half().float().clamp(min=FP16_TINY)
    codes = torch.round(x.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scale


def fake_quantize_per_token(x: torch.Tensor) -> torch.Tensor:
    codes, scale = quantize_per_token(x.reshape(-1, x.shape[-1]))
    return (codes.float() * scale[:, None]).reshape(x.shape).to(x.dtype)


def quantize_kv(x: torch.Tensor, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (codes uint8 [..., head_dim], scale [...] fp16, zero [...] fp16)."""
    qmax = 2**bits - 1
    xf = x.float()
    mn = xf.amin(dim=-1)
    mx = xf.amax(dim=-1)
    scale = ((mx - mn) / qmax).clamp(min=FP16_TINY).half()
    zero = mn.half()
    codes = torch.round((xf - zero.float()[..., None]) / scale.float()[..., None]).clamp(0, qmax)
    return codes.to(torch.uint8), scale, zero


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale.float()[..., None] + zero.float()[..., None]


def fake_quantize_kv(x: torch.Tensor, bits: int = 4) -> torch.Tensor:
    return dequantize_kv(*quantize_kv(x, bits)).to(x.dtype)
