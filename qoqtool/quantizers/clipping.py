"""Weight clipping: search a clip ratio per output channel and group (QoQ, AWQ).

Shrinking a group's range below its min/max clips a few large weights but rounds all the
others more finely. For each candidate ratio r we round the weight with every group's range
scaled by r and measure the error the group causes in the layer output on the calibration
inputs:

    err[n, g] = dW[n, g] H[g, g] dW[n, g]^T,   H = 2/n X^T X (the GPTQ Hessian)

i.e. the exact output error of group g of row n, leaving out the cross terms between
groups. Each (row, group) keeps its best ratio (1.0, no clipping, is a candidate, so
clipping never raises this error). Since the choice is per row, weighting rows differently
(as a block-level objective for q_proj/k_proj would, with a diagonal approximation of the
attention-logit error) picks the same ratios, so one objective serves every linear.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qoqtool.calibration.steps import register_step
from qoqtool.quantizers.formats import pad_columns
from qoqtool.quantizers.schemes import WeightScheme


@dataclass
class ClipParams:
    min_ratio: float = 0.5  # smallest range kept
    steps: int = 20  # candidates from 1.0 down to min_ratio

    def __post_init__(self):
        if not 0 < self.min_ratio <= 1 or self.steps < 1:
            raise ValueError(f"min_ratio must lie in (0, 1] and steps be at least 1, not {self.min_ratio} and {self.steps}")


register_step("clip", "solver", ClipParams)


def group_errors(dw: torch.Tensor, h: torch.Tensor, g: int) -> torch.Tensor:
    """Within-group output error [N, G] of a weight error dw [N, K_padded] under Hessian h."""
    n, kp = dw.shape
    groups = kp // g
    d = dw.reshape(n, groups, g)
    blocks = torch.stack([h[i * g : (i + 1) * g, i * g : (i + 1) * g] for i in range(groups)])  # [G, g, g]
    return torch.einsum("ngi,gij,ngj->ng", d, blocks, d)


@torch.no_grad()
def search_clip(weight: torch.Tensor, stats, scheme: WeightScheme, params: ClipParams) -> torch.Tensor:
    """Best clip ratio per (row, group), [N, G]."""
    n, k = weight.shape
    kp, g = scheme.padded(k), scheme.group_size_for(k)
    w = pad_columns(weight.float(), kp)
    h = torch.zeros(kp, kp, device=w.device)
    h[:k, :k] = stats.hessian().to(w.device)
    groups = kp // g
    best_err = torch.full((n, groups), float("inf"), device=w.device)
    best = torch.ones(n, groups, device=w.device)
    for i in range(params.steps + 1):
        r = 1.0 - (1.0 - params.min_ratio) * i / params.steps
        clip = torch.full((n, groups), r, device=w.device)
        dw = pad_columns(scheme.fake_quantize(weight, clip), kp) - w
        err = group_errors(dw, h, g)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, torch.full_like(best, r), best)
    return best
