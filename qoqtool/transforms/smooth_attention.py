"""SmoothAttention (QServe, Sec. 4.3): tame the outlier channels of K before the 4-bit cache.

K has a few channels with large magnitude in every token, which per-token 4-bit KV
quantization handles badly; Q has no such need (it is never cached). So divide K's
channels by lambda and multiply Q's by the same lambda - q.k is unchanged - with

    lambda_c = max|K_c| ** alpha          (alpha = 0.5 by default, as in the paper)

measured on post-RoPE keys of the calibration data. RoPE mixes channel c with c + d/2,
so lambda is tied across each pair (the larger of the two); then scaling commutes with
RoPE and can be folded into q_proj / k_proj rows (and biases) offline. With grouped-query
attention all query heads of a group share their KV head's lambda.

Qwen3 normalizes each query and key head (RMSNorm, q_norm / k_norm) between the projection
and RoPE, so a scale on k_proj's rows would be undone by the norm. The norms' weights are
the last per-channel factor before RoPE instead: lambda goes there. One weight [head_dim]
serves every head, so lambda is one vector too, the largest over the KV heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qoqtool.calibration.steps import register_step


@dataclass
class SmoothAttentionParams:
    alpha: float = 0.5  # migration strength: lambda = max|K| ** alpha

    def __post_init__(self):
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha must lie in [0, 1], not {self.alpha}")


def attention_scales(key_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """lambda [kv_heads, d] from max|K| [kv_heads, d], tied across RoPE pairs (c, c + d/2)."""
    lam = key_absmax.double().clamp(min=1e-5).pow(alpha)
    half = lam.shape[1] // 2
    tied = torch.maximum(lam[:, :half], lam[:, half:])
    return torch.cat([tied, tied], dim=1)


def shared_by_heads(lam: torch.Tensor) -> torch.Tensor:
    """lambda [kv_heads, d] -> one lambda for every head (the largest), still [kv_heads, d]:
    what a per-head norm's weight [d] can carry (still tied across RoPE pairs)."""
    return lam.amax(dim=0, keepdim=True).expand_as(lam).contiguous()


@torch.no_grad()
def apply_attention_scales(parts, lam: torch.Tensor, num_heads: int) -> None:
    """k rows / lambda, q rows * lambda (per query head, its KV head's lambda); with per-head
    norms (Qwen3), k_norm's weight / lambda and q_norm's * lambda (lambda shared by the heads)."""
    kv_heads, d = lam.shape
    if parts.k_norm is not None:
        if not torch.equal(lam, lam[:1].expand_as(lam)):
            raise ValueError("a per-head norm takes one lambda for all heads (shared_by_heads)")
        for norm, factor in ((parts.q_norm, lam[0]), (parts.k_norm, 1.0 / lam[0])):
            norm.weight.data = (norm.weight.data.double() * factor).to(norm.weight.dtype)
        return
    q_lam = lam.repeat_interleave(num_heads // kv_heads, dim=0).reshape(-1)
    k_lam = lam.reshape(-1)
    for linear, factor in ((parts.q_proj, q_lam), (parts.k_proj, 1.0 / k_lam)):
        linear.weight.data = (linear.weight.data.double() * factor[:, None]).to(linear.weight.dtype)
        if linear.bias is not None:
            linear.bias.data = (linear.bias.data.double() * factor).to(linear.bias.dtype)


def run(ctx, params: SmoothAttentionParams) -> None:
    cap = ctx.capture
    lam = attention_scales(cap.key_absmax, params.alpha)
    if ctx.parts.k_norm is not None:
        lam = shared_by_heads(lam)
    apply_attention_scales(ctx.parts, lam.to(ctx.parts.q_proj.weight.device), ctx.adapter.num_heads)
    cap.scale_keys(1.0 / lam)  # q.k is unchanged, so o_proj's and down_proj's inputs are too


register_step("smooth_attention", "layer", SmoothAttentionParams, run)
