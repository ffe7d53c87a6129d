"""Block-output smoothing (QServe, Sec. 4.3): balance the inputs of o_proj and down_proj.

Per input channel c of the linear, move magnitude between activation and weight:

    x_c <- x_c / s_c,   W[:, c] <- W[:, c] * s_c,   s = max|X|^alpha / max|W|^beta

and fold 1/s into the layer that *produces* x, so nothing runs at inference time:
    o_proj    through v_proj (attention output = convex combination of V rows, so scaling
              V's channels scales the output's); with GQA, s is shared by the query heads
              of a KV group, since they read the same V
    down_proj through up_proj (x = silu(gate) * up is linear in up), unless the rotate
              step rotates down_proj's input online (down_hadamard): scales of the rotated
              channels could not be folded into up_proj
alpha is grid-searched (beta = 1 - alpha, SmoothQuant's form) on the linear's output error
under the recipe's own weight and activation quantization, with "no smoothing" among the
candidates, so on the calibration data it never makes the layer worse.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qoqtool.calibration.steps import check_linears, register_step
from qoqtool.quantizers.activations import fake_quantize_per_token
from qoqtool.quantizers.schemes import WeightScheme
from qoqtool.runtime.mlp import has_down_rotation


@dataclass
class SmoothOutputParams:
    grid: int = 20  # alpha candidates: 0, 1/grid, ..., (grid-1)/grid, and no smoothing
    linears: tuple = ("o_proj", "down_proj")

    def __post_init__(self):
        if self.grid < 1:
            raise ValueError(f"grid must be at least 1, not {self.grid}")
        check_linears(self.linears)


def quantized_output_error(x: torch.Tensor, w: torch.Tensor, recipe, reference: torch.Tensor) -> float:
    """|| Q_a(x) Q_w(w)^T - reference ||^2 under the recipe's RTN weights and INT8 activations."""
    wq = WeightScheme(recipe.weights).fake_quantize(w)
    xq = fake_quantize_per_token(x) if recipe.act_bits == 8 else x
    return float((xq @ wq.t() - reference).pow(2).sum())


def search_scales(x: torch.Tensor, w: torch.Tensor, x_max: torch.Tensor, w_max: torch.Tensor,
                  recipe, grid: int, expand=lambda s: s) -> tuple[torch.Tensor, float]:
    """Best s (per smoothing channel) and its alpha (-1.0: no smoothing) for x [T, K], w [N, K]."""
    reference = x @ w.t()  # smoothing is exact in float: every candidate aims at this
    best_s, best_alpha = torch.ones_like(x_max), -1.0
    best_err = quantized_output_error(x, w, recipe, reference)
    for i in range(grid):
        alpha = i / grid
        s = (x_max.clamp(min=1e-5).pow(alpha) / w_max.clamp(min=1e-5).pow(1 - alpha)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()  # centre the scales: only ratios between channels matter
        full = expand(s)
        err = quantized_output_error(x / full, w * full, recipe, reference)
        if err < best_err:
            best_s, best_alpha, best_err = s, alpha, err
    return best_s, best_alpha


def _scale_rows(linear, factor: torch.Tensor) -> None:
    linear.weight.data = (linear.weight.data.double() * factor.double()[:, None]).to(linear.weight.dtype)
    if linear.bias is not None:
        linear.bias.data = (linear.bias.data.double() * factor.double()).to(linear.bias.dtype)


def _scale_cols(linear, factor: torch.Tensor) -> None:
    linear.weight.data = (linear.weight.data.double() * factor.double()[None, :]).to(linear.weight.dtype)


@torch.no_grad()
def run(ctx, params: SmoothOutputParams) -> None:
    parts, adapter = ctx.parts, ctx.adapter
    cap = ctx.capture
    chosen = []
    if "o_proj" in params.linears:
        kv, heads, d = adapter.num_kv_heads, adapter.num_heads, adapter.head_dim
        group = heads // kv
        w = parts.o_proj.weight.data.float()
        # statistics per KV channel: the max over the query heads that read it
        x_max = cap.absmax["o_proj"].reshape(kv, group, d).amax(1).reshape(-1).to(w.device)
        w_max = w.abs().amax(0).reshape(kv, group, d).amax(1).reshape(-1)

        def expand(s):  # per KV channel -> per o_proj input column
            return s.reshape(kv, 1, d).expand(kv, group, d).reshape(-1)

        s, alpha = search_scales(cap.samples["o_proj"].to(w.device), w, x_max, w_max, ctx.recipe, params.grid, expand)
        _scale_rows(parts.v_proj, 1.0 / s)
        _scale_cols(parts.o_proj, expand(s))
        cap.scale_input("o_proj", 1.0 / expand(s))
        chosen.append(f"o_proj alpha={alpha:g}")
    if "down_proj" in params.linears and has_down_rotation(parts.mlp):
        chosen.append("down_proj left alone (its input is rotated online)")
    elif "down_proj" in params.linears:
        w = parts.down_proj.weight.data.float()
        x_max = cap.absmax["down_proj"].to(w.device)
        s, alpha = search_scales(cap.samples["down_proj"].to(w.device), w, x_max, w.abs().amax(0), ctx.recipe, params.grid)
        _scale_rows(parts.up_proj, 1.0 / s)
        _scale_cols(parts.down_proj, s)
        cap.scale_input("down_proj", 1.0 / s)
        chosen.append(f"down_proj alpha={alpha:g}")
    ctx.log.append(f"layer {ctx.index} smooth_output: " + ", ".join(chosen))


register_step("smooth_output", "layer", SmoothOutputParams, run)
