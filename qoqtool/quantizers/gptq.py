"""GPTQ (Frantar et al., 2023) over any weight scheme.

Columns are rounded one at a time in blocks; the rounding error of each column is spread
over the columns not yet rounded through the inverse Hessian (its upper Cholesky factor),
so later columns compensate for earlier ones. Group grids are fitted when the sweep
reaches a group, on the already-compensated weights ("dynamic groups"); with act-order
the grids are fitted up front on the original weights ("static groups"), so a group's
members may be visited in any order.

The scheme decides what a grid is (RTN asymmetric, symmetric INT8, QoQ progressive), so
GPTQ over the progressive quantizer is this same loop: level 0 is fitted on the whole
row before the sweep, level 1 per group during it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qoqtool.calibration.steps import register_step
from qoqtool.quantizers.formats import QuantizedWeight, pad_columns
from qoqtool.quantizers.grid import Grid
from qoqtool.quantizers.schemes import WeightScheme, _neutral_padding


@dataclass
class GPTQParams:
    """GPTQ's knobs, defaults as in the paper and QoQ's deepcompressor."""

    damp: float = 0.01  # dampening, as a fraction of the mean Hessian diagonal
    block_size: int = 128  # columns per lazy-update block
    act_order: bool = False  # visit columns by decreasing Hessian diagonal
    # Within a layer, gather each linear's statistics only after the linears before it are
    # quantized (q/k/v; o_proj, with the quantized KV cache; gate/up; down_proj), so that
    # every Hessian comes from the activations the linear will really see (AutoGPTQ's
    # true_sequential). Off: one pass of the float layer serves all seven.
    true_sequential: bool = False

    def __post_init__(self):
        if self.damp < 0 or self.block_size < 1:
            raise ValueError(f"damp must be >= 0 and block_size at least 1, not {self.damp} and {self.block_size}")


register_step("gptq", "solver", GPTQParams)


def _inverse_hessian_factor(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of H^-1 after dampening (retrying with more damping if needed)."""
    k = h.shape[0]
    mean_diag = torch.diag(h).mean()
    for attempt in range(6):
        hd = h + torch.eye(k, device=h.device, dtype=h.dtype) * damp * mean_diag * (10**attempt)
        chol, info = torch.linalg.cholesky_ex(hd)
        if int(info) == 0:
            hinv = torch.cholesky_inverse(chol)
            upper, info = torch.linalg.cholesky_ex(hinv, upper=True)
            if int(info) == 0:
                return upper
    raise RuntimeError("GPTQ: the Hessian is not positive definite even after heavy dampening")


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    scheme: WeightScheme,
    params: GPTQParams,
    clip: torch.Tensor | None = None,
    outliers=None,
) -> QuantizedWeight:
    """Quantize weight [N, K] with GPTQ; hessian [K, K] = 2/n X^T X of the layer input.

    outliers: an `OutlierKeeper` (qoqtool.quantizers.outliers) to keep the most salient
    weights in fp16 (SpQR): grids are fitted without them, each group's are chosen when the
    sweep reaches it, and a kept weight spreads no error. It collects what it kept.
    """
    n, k = weight.shape
    kp = scheme.padded(k)
    g = scheme.group_size_for(k)
    w = pad_columns(weight.float(), kp).clone()
    h = torch.zeros(kp, kp, dtype=torch.float32, device=w.device)
    h[:k, :k] = hessian.to(w.device, torch.float32)

    dead = torch.diag(h) == 0  # channels never active (and the padding): pin them to zero
    h[dead, dead] = 1
    w[:, dead] = 0
    # After the pinning: a large weight on a dead channel must not widen its row's grid.
    scheme.prepare(w if outliers is None else outliers.fit_view(w))

    groups = kp // g
    clip_of = (lambda i: 1.0) if clip is None else (lambda i: clip[:, i : i + 1].to(w.device))
    grids: list[Grid | None] = [None] * groups
    if params.act_order or groups == 1:
        # Static groups: every grid from the original weights, before any column moves
        # (always so per channel: the one grid spans the whole row).
        fit_w = w if outliers is None else outliers.fit_view(w)
        for i in range(groups):
            grids[i] = scheme.fit(fit_w[:, i * g : (i + 1) * g], clip_of(i))
        perm = torch.argsort(torch.diag(h), descending=True)
    else:
        perm = torch.arange(kp, device=w.device)
    w = w[:, perm]
    h = h[perm][:, perm]
    u = _inverse_hessian_factor(h, params.damp)

    codes = torch.zeros_like(w)
    block = max(params.block_size // g, 1) * g if g < kp else params.block_size
    for b0 in range(0, kp, block):
        b1 = min(b0 + block, kp)
        w_blk = w[:, b0:b1].clone()
        err_blk = torch.zeros_like(w_blk)
        u_blk = u[b0:b1, b0:b1]
        for j in range(b1 - b0):
            col = int(perm[b0 + j])
            gi = col // g
            if grids[gi] is None:
                # Dynamic groups: without act-order a group starts here and lies inside this
                # block (block is a multiple of g), so w_blk holds its compensated weights.
                group_w = w_blk[:, j : j + g]
                if outliers is not None:
                    group_w = outliers.select_group(gi, group_w, torch.diag(u_blk)[j : j + g], scheme, clip_of(gi))
                grids[gi] = scheme.fit(group_w, clip_of(gi))
            grid = grids[gi]
            col_w = w_blk[:, j : j + 1]
            q = grid.quantize(col_w)
            codes[:, b0 + j : b0 + j + 1] = q
            deq = grid.dequantize(q)
            if outliers is not None:
                deq = outliers.keep(col, col_w, deq)
            e = (col_w - deq) / u_blk[j, j]
            w_blk[:, j:] -= e @ u_blk[j : j + 1, j:]
            err_blk[:, j : j + 1] = e
        w[:, b1:] -= err_blk @ u[b0:b1, b1:]

    codes = codes[:, torch.argsort(perm)]  # back to the natural column order
    codes = _neutral_padding(codes, grids, g, k)
    return scheme.assemble(codes, grids, k)
