"""Activation-aware channel reordering (QServe, Sec. 4.2) for group quantization.

Group quantization shares one scale among g consecutive input channels, so a group that
mixes one loud channel with quiet ones wastes its range on the loud one. Sorting the input
channels by max|X| puts channels of similar salience into the same group. The sort is an
exact permutation folded into the weights on both sides - no gather at run time:

    down_proj inputs   permute gate_proj and up_proj rows and down_proj columns
    o_proj inputs      permute V's channels inside each KV head (v_proj rows) and the
                       matching o_proj columns of every query head of the group (attention
                       mixes tokens, never channels, so this commutes with it)

The residual stream's channels (inputs of q/k/v and gate/up) are shared by every layer;
after the block-input Hadamard rotation their magnitudes are flat, so they are left alone,
and so are down_proj's when the rotate step rotates them online (down_hadamard): a
permutation of the rotated channels could not be folded into gate/up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qoqtool.calibration.steps import check_linears, register_step
from qoqtool.runtime.mlp import has_down_rotation


@dataclass
class ReorderParams:
    linears: tuple = ("o_proj", "down_proj")

    def __post_init__(self):
        check_linears(self.linears)


def _permute_rows(linear, perm):
    linear.weight.data = linear.weight.data[perm].contiguous()
    if linear.bias is not None:
        linear.bias.data = linear.bias.data[perm].contiguous()


def _permute_cols(linear, perm):
    linear.weight.data = linear.weight.data[:, perm].contiguous()


def salience_order(absmax: torch.Tensor) -> torch.Tensor:
    """Channels by decreasing max|X| (stable, so ties keep their order)."""
    return torch.sort(absmax, descending=True, stable=True).indices


@torch.no_grad()
def run(ctx, params: ReorderParams) -> None:
    parts, adapter = ctx.parts, ctx.adapter
    cap = ctx.capture
    if "down_proj" in params.linears and has_down_rotation(parts.mlp):
        ctx.log.append(f"layer {ctx.index} reorder: down_proj left alone (its input is rotated online)")
    elif "down_proj" in params.linears:
        perm = salience_order(cap.absmax["down_proj"]).to(parts.down_proj.weight.device)
        _permute_rows(parts.gate_proj, perm)
        _permute_rows(parts.up_proj, perm)
        _permute_cols(parts.down_proj, perm)
        cap.permute_input("down_proj", perm)
    if "o_proj" in params.linears:
        kv, heads, d = adapter.num_kv_heads, adapter.num_heads, adapter.head_dim
        group = heads // kv
        per_kv = cap.absmax["o_proj"].reshape(kv, group, d).amax(1)
        local = torch.stack([salience_order(per_kv[j]) for j in range(kv)])  # [kv, d]
        v_perm = (local + torch.arange(kv)[:, None] * d).reshape(-1)
        o_perm = (local[:, None, :] + (torch.arange(heads).reshape(kv, group) * d)[:, :, None]).reshape(-1)
        dev = parts.o_proj.weight.device
        _permute_rows(parts.v_proj, v_perm.to(dev))
        _permute_cols(parts.o_proj, o_perm.to(dev))
        cap.permute_input("o_proj", o_perm)


register_step("reorder", "layer", ReorderParams, run)
