"""Outlier-aware quantization: keep the most salient ~1% of the weights in fp16 (SpQR).

A few weights carry much of the quantization error: those in input channels with large
activations, and those far outside the range of their group, which widen the grid that
every other weight of the group is rounded on. Keeping them in fp16, in a sparse matrix
beside the 4-bit codes, recovers much of the lost quality for ~0.3 extra bits per weight.

Saliency. With `d_k` the importance of input channel k, the (diagonal-Hessian) output error
of a quantized weight is

    E = sum_{n,k} d_k (w_nk - Q(w_nk))^2

RTN uses d_k = E[x_k^2] (the calibration mean square, the Hessian diagonal up to 2); GPTQ
uses d_k = 1 / [H^-1]_kk, the OBS cost of rounding channel k when the channels after it
compensate (read off the Cholesky factor during the sweep, as SpQR does), with H = X^T X / n
so both are in the same units: output squared error per token.

Selection (`_Selection`). Keeping a weight removes its own error from E; if it is the
largest or smallest of its row-group (one row of one group), its grid is re-fitted without
it and every other weight of the row-group is rounded more finely. SpQR's saliency
(own error under a leave-one-out grid) sees only the first effect. We choose greedily on E
itself: each round, every row-group offers its better extreme (gain measured by re-fitting
the grid) and each of its interior weights (gain = own error, the grid does not move); the
best offers are taken and the touched row-groups re-evaluated (progressive weights: a row's
level-0 scale too is re-fitted as its weights are kept, so the greedy scores the grids that
quantize_keeping stores). On smollm2-135m at 1% this
leaves 10-20% less error than top-k saliency (benchmarks/RESULTS.md, "Outliers").

Budgets (`OutlierBudget`, parsed from `--outliers`): a share of all quantized weights
(`1%`), a count (`5000`) or a gain threshold (`t=1e-6`, in units of E). `layer` scope gives
every linear the same share (exactly: round(share * N * K) each); `global` scope cuts one
budget across all linears by saliency: each linear's greedy gain curve is computed, and
the one threshold that keeps the budget decides every linear's count.

What an outlier stores: its fp16 *residual over the dense code*, r = w - dequantize(q),
where q, the dense code at that position, is the nearest code of the grid fitted without
the outliers (so the code is harmless: in range, never widening a grid, and a kernel that
ignores the sparse part still computes the best dense approximation of the weight rather
than a hole where the largest weights were). The kernel adds dense and sparse products
with no masking, and |r| <= |w| (grids contain zero), so fp16 keeps it more precisely
than it would keep w. See docs/tile-coo.md for how the outliers are packed.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch

from qoqtool.errors import UserError
from qoqtool.quantizers.formats import QuantizedWeight, pad_columns
from qoqtool.quantizers.schemes import WeightScheme, _neutral_padding

ROUNDS = 16  # greedy rounds of a count budget; the selected error saturates by ~16
CURVE_HEADROOM = 8  # global budgets: each linear's gain curve runs to 8x the mean share
FP16_MAX = 65504.0


# ----------------------------------------------------------------------------------------
# Budgets
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OutlierBudget:
    """How many weights to keep: `kind` fraction | count | threshold, and the scope."""

    kind: str
    value: float
    scope: str = "layer"  # "layer": the same share in every linear; "global": shared by saliency
    quads: bool = True  # choose whole Tile-COO entries (see `_best_entries`); False: one by one

    def describe(self) -> str:
        if self.kind == "fraction":
            what = f"{self.value * 100:g}%"
        elif self.kind == "count":
            what = f"{int(self.value)} weights"
        else:
            what = f"gain > {self.value:g}"
        return what if self.kind == "threshold" else f"{what} ({self.scope} budget)"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "value": self.value, "scope": self.scope, "quads": self.quads}

    def total(self, weights: int) -> int:
        """The number of outliers over `weights` quantized weights (count budgets)."""
        if self.kind == "fraction":
            return int(math.floor(self.value * weights + 0.5))
        return min(int(self.value), weights)


_HINT = "give a share like 1%, a count like 5000, or a gain threshold like t=1e-6"


def _number(text: str, flag: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"--outliers {flag!r} is not a budget; {_HINT}") from None
    if not math.isfinite(value):
        raise UserError(f"--outliers {flag}: the number must be finite; {_HINT}")
    return value


def parse_outliers(text: str, scope: str = "layer") -> OutlierBudget:
    """Parse `--outliers` (1%, 0.5%, 5000, t=1e-6) and `--outliers-budget` (layer, global)."""
    if scope not in ("layer", "global"):
        raise UserError(f"--outliers-budget {scope!r}: use layer (the same share in every linear) or global")
    s = str(text).strip()
    if s.endswith("%"):
        share = _number(s[:-1], text)
        if not 0 <= share <= 100:
            raise UserError(f"--outliers {text}: a share must lie between 0% and 100% (e.g. 1%)")
        return OutlierBudget("fraction", share / 100, scope)
    if s.startswith("t="):
        t = _number(s[2:], text)
        if t <= 0:
            raise UserError(f"--outliers {text}: a threshold must be positive (e.g. t=1e-6)")
        return OutlierBudget("threshold", t, scope)
    value = _number(s, text)
    if value < 0:
        raise UserError(f"--outliers {text}: a count cannot be negative; {_HINT}")
    if value != int(value) or not s.lstrip("+").isdigit():
        raise UserError(f"--outliers {text}: a count must be a whole number; for a share write it with % (e.g. 1%)")
    return OutlierBudget("count", int(value), scope)


@dataclass(frozen=True)
class OutlierTarget:
    """What one linear keeps: exactly `count` weights, or each whose gain exceeds `threshold`."""

    count: int | None = None
    threshold: float | None = None
    quads: bool = True


def layer_targets(budget: OutlierBudget, sizes: dict[str, int]) -> dict[str, OutlierTarget]:
    """Per-linear targets of a `layer`-scope (or threshold) budget; sizes: name -> N * K."""
    if budget.kind == "threshold":
        return {name: OutlierTarget(threshold=budget.value, quads=budget.quads) for name in sizes}
    if budget.kind == "fraction":
        return {name: OutlierTarget(count=budget.total(n), quads=budget.quads) for name, n in sizes.items()}
    # A count: the same share everywhere, rounded so that the counts add up exactly.
    total, weights = budget.total(sum(sizes.values())), sum(sizes.values())
    exact = {name: total * n / max(weights, 1) for name, n in sizes.items()}
    counts = {name: int(v) for name, v in exact.items()}
    for name in sorted(exact, key=lambda m: counts[m] - exact[m])[: total - sum(counts.values())]:
        counts[name] += 1
    return {name: OutlierTarget(count=c, quads=budget.quads) for name, c in counts.items()}


def curve_cap(budget: OutlierBudget, size: int, all_weights: int) -> int:
    """How far a linear's gain curve must run for a global budget to cut it."""
    share = budget.total(all_weights) / max(all_weights, 1)
    return min(size, math.ceil(CURVE_HEADROOM * share * size) + 64)


def global_targets(budget: OutlierBudget, curves: dict[str, torch.Tensor], all_weights: int) -> dict[str, OutlierTarget]:
    """Cut one budget across linears: the largest gains of all the curves win.

    curves: per linear, the gains of its greedy picks (`select(..., curve=True)`), each run
    to `curve_cap`; all_weights: the number of quantized weights the budget is a share of.
    """
    if budget.kind == "threshold":
        return {name: OutlierTarget(threshold=budget.value, quads=budget.quads) for name in curves}
    gains = torch.cat([c.float() for c in curves.values()]) if curves else torch.zeros(0)
    total = min(budget.total(all_weights), gains.numel())
    lengths = torch.tensor([c.numel() for c in curves.values()], dtype=torch.long)
    owner = torch.repeat_interleave(torch.arange(len(curves)), lengths)
    counts = torch.bincount(owner[torch.topk(gains, total).indices], minlength=len(curves))
    return {name: OutlierTarget(count=int(c), quads=budget.quads) for name, c in zip(curves, counts)}


# ----------------------------------------------------------------------------------------
# The sparse part
# ----------------------------------------------------------------------------------------
@dataclass
class SparseOutliers:
    """Kept weights of one linear in natural [N, K] coordinates, sorted by (row, col).

    values are fp16 residuals over the dense codes: W = dequantize(codes) + S. This is the
    form the quantized folder stores and the reference path applies; the packed folder
    stores the same entries in Tile-COO (qoqtool.packing.tile_coo).
    """

    rows: torch.Tensor  # [nnz] int32
    cols: torch.Tensor  # [nnz] int32
    values: torch.Tensor  # [nnz] float16
    shape: tuple[int, int]
    _csr: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        self.shape = (int(self.shape[0]), int(self.shape[1]))
        n, k = self.shape
        r, c, v = self.rows, self.cols, self.values
        if r.dtype != torch.int32 or c.dtype != torch.int32 or v.dtype != torch.float16:
            raise ValueError(f"outliers are int32 rows/cols and fp16 values, got {r.dtype}, {c.dtype}, {v.dtype}")
        if not (r.dim() == c.dim() == v.dim() == 1 and r.numel() == c.numel() == v.numel()):
            raise ValueError("outlier rows, cols and values must be 1-D and of one length")
        if r.numel():
            if int(r.min()) < 0 or int(r.max()) >= n or int(c.min()) < 0 or int(c.max()) >= k:
                raise ValueError(f"an outlier lies outside the {n}x{k} weight")
            key = r.long() * k + c.long()
            if (key[1:] <= key[:-1]).any():
                raise ValueError("outliers must be sorted by (row, col) without repeats")
            if not torch.isfinite(v).all():
                raise ValueError("an outlier value is not finite in fp16")

    @classmethod
    def from_mask(cls, mask: torch.Tensor, values: torch.Tensor) -> "SparseOutliers":
        """Outliers at mask [N, K] (bool) with values [N, K] (float, rounded to fp16 here)."""
        rows, cols = mask.nonzero(as_tuple=True)  # row-major order
        picked = values[rows, cols].float()
        if picked.numel() and picked.abs().max() > FP16_MAX:
            raise ValueError("an outlier residual exceeds the fp16 range")
        return cls(rows.int().cpu(), cols.int().cpu(), picked.half().cpu(), tuple(mask.shape))

    @classmethod
    def empty(cls, shape) -> "SparseOutliers":
        none = torch.zeros(0, dtype=torch.int32)
        return cls(none, none.clone(), torch.zeros(0, dtype=torch.float16), tuple(shape))

    @property
    def nnz(self) -> int:
        return int(self.values.numel())

    def to_dense(self) -> torch.Tensor:
        dense = torch.zeros(self.shape, dtype=torch.float32, device=self.values.device)
        dense[self.rows.long(), self.cols.long()] = self.values.float()
        return dense

    def to(self, device) -> "SparseOutliers":
        self.rows, self.cols, self.values = (t.to(device) for t in (self.rows, self.cols, self.values))
        self._csr = None
        return self

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float -> x @ S^T [M, N] float32 (a sparse product: nnz * M multiply-adds)."""
        if self.nnz == 0:
            return torch.zeros(x.shape[0], self.shape[0], device=x.device)
        if self._csr is None:
            with warnings.catch_warnings():  # "sparse CSR support is in beta"
                warnings.simplefilter("ignore", UserWarning)
                index = torch.stack([self.rows.long(), self.cols.long()])
                coo = torch.sparse_coo_tensor(index, self.values.float(), self.shape, is_coalesced=True)
                self._csr = coo.to_sparse_csr()
        return (self._csr @ x.float().t()).t()

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"outlier_rows": self.rows, "outlier_cols": self.cols, "outlier_values": self.values}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], shape) -> "SparseOutliers":
        return cls(tensors["outlier_rows"], tensors["outlier_cols"], tensors["outlier_values"], tuple(shape))


def residual_outliers(mask: torch.Tensor, target: torch.Tensor, qweight: QuantizedWeight) -> SparseOutliers:
    """The fp16 residuals target - dequantize(codes) at mask [N, K] (target: the kept values)."""
    return SparseOutliers.from_mask(mask, target.float() - qweight.dequantize().to(target.device))


# ----------------------------------------------------------------------------------------
# Selection
# ----------------------------------------------------------------------------------------
class _Selection:
    """The greedy choice of weights to keep in one weight [N, K] (see the module docstring).

    Row-groups are the rows of `self.w` [N * G, g]: row-group r is row r // G, group r % G.
    Every grid is fitted per row-group by the weight's own scheme, with the kept weights
    set to zero: all grids here contain zero, so a zero never moves a min-max range.
    """

    def __init__(self, w, importance, scheme: WeightScheme, clip=None, eligible=None, level0=None):
        n, k = w.shape
        self.scheme = WeightScheme(scheme.config)  # private: fitting sets per-row state
        g, kp = self.scheme.group_size_for(k), self.scheme.padded(k)
        self.n, self.k, self.g, self.groups = n, k, g, kp // g
        wp = pad_columns(w.float(), kp)
        # Fitted here (RTN): level 0 is re-fitted without the kept weights as they are taken,
        # exactly as quantize_keeping stores it. Given (GPTQ): fixed before the sweep.
        self._refit_level0 = level0 is None and self.scheme.config.scheme == "progressive"
        if level0 is None:
            self.scheme.prepare(wp)
            level0 = self.scheme.level0
        # per-row state of the scheme (progressive level 0), repeated for each row-group
        self.level0 = None if level0 is None else level0.repeat_interleave(self.groups, 0)
        self.clip = clip.reshape(-1, 1).to(wp.device) if torch.is_tensor(clip) else None
        self.w = wp.reshape(-1, g)
        self.d = pad_columns(importance.float().to(wp.device), kp).reshape(self.groups, g)
        ok = torch.zeros(kp, dtype=torch.bool, device=wp.device)
        ok[:k] = True if eligible is None else eligible.to(wp.device)
        self.live = ok.reshape(self.groups, g).repeat(n, 1)  # may still be kept
        self.kept = torch.zeros_like(self.live)
        self.rows_per_tile, _ = _geometry()
        self.fill = torch.zeros(-(-n // self.rows_per_tile) * kp, dtype=torch.long, device=wp.device)  # per cell
        rg = self.w.shape[0]
        self.ext_gain = torch.empty(rg, device=wp.device)  # best extreme of each row-group
        self.ext_pos = torch.empty(rg, dtype=torch.long, device=wp.device)
        self.inner = torch.empty_like(self.w)  # own error of every other live weight
        self._shortlist: torch.Tensor | None = None
        self._offer(torch.arange(rg, device=wp.device))

    # -- offers ------------------------------------------------------------------------
    def _fake(self, idx, fit_w, w):
        """Round w [P, g] on grids fitted to fit_w, for row-groups idx."""
        if self.level0 is not None:
            self.scheme.level0 = self.level0[idx]
        grid = self.scheme.fit(fit_w, 1.0 if self.clip is None else self.clip[idx])
        return grid.fake(w)

    def _offer(self, idx):
        """Re-evaluate what keeping each weight of row-groups idx would gain."""
        w, live, kept = self.w[idx], self.live[idx], self.kept[idx]
        d = self.d[idx % self.groups]
        fit_w = w.masked_fill(kept, 0)
        err = (d * (w - self._fake(idx, fit_w, w)) ** 2).masked_fill(kept, 0)
        total = err.sum(1)
        best = torch.full_like(total, -math.inf)
        best_pos = torch.zeros_like(idx)
        hi = w.masked_fill(~live, -math.inf).argmax(1, keepdim=True)
        lo = w.masked_fill(~live, math.inf).argmin(1, keepdim=True)
        for pos in (hi, lo):
            fit_wo = fit_w.scatter(1, pos, 0.0)
            err_wo = (d * (w - self._fake(idx, fit_wo, w)) ** 2).masked_fill(kept, 0).scatter(1, pos, 0.0)
            gain = (total - err_wo.sum(1)).masked_fill(~live.gather(1, pos)[:, 0], -math.inf)
            better = gain > best
            best = torch.where(better, gain, best)
            best_pos = torch.where(better, pos[:, 0], best_pos)
        self.ext_gain[idx] = best
        self.ext_pos[idx] = best_pos
        self.inner[idx] = err.masked_fill(~live, -math.inf).scatter(1, hi, -math.inf).scatter(1, lo, -math.inf)

    def offers(self, limit: int | None = None, shortlist: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(gains, flat positions into w) of the current offers; the best `limit` if given.

        With a limit, interior weights come from a shortlist made on the first call (its
        best `shortlist`): a weight's gain changes only when its row-group loses a weight,
        and then mostly shrinks, so later rounds need not scan the whole weight again."""
        g = self.g
        inner = self.inner.flatten()
        if limit is not None and limit < inner.numel():
            if self._shortlist is None:
                self._shortlist = torch.topk(inner, min(max(shortlist, limit), inner.numel())).indices
            inner_gain, inner_pos = inner[self._shortlist], self._shortlist
            if limit < inner_gain.numel():
                top = torch.topk(inner_gain, limit)
                inner_gain, inner_pos = top.values, inner_pos[top.indices]
        else:
            inner_gain, inner_pos = inner, torch.arange(inner.numel(), device=inner.device)
        ext_pos = torch.arange(self.w.shape[0], device=inner.device) * g + self.ext_pos
        gains = torch.cat([inner_gain, self.ext_gain])
        pos = torch.cat([inner_pos, ext_pos])
        live = gains > -math.inf
        return gains[live], pos[live]

    def cells(self, flat: torch.Tensor) -> torch.Tensor:
        """The Tile-COO cell (row tile, column) of flat positions into w."""
        r, c = flat // self.g, flat % self.g
        row, col = r // self.groups, (r % self.groups) * self.g + c
        return (row // self.rows_per_tile) * (self.groups * self.g) + col

    def take_in_cells(self, cells: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The best counts[i] live weights of each cell (by their current offer), as
        (flat positions into w, gains)."""
        width = self.groups * self.g
        rows = (cells // width)[:, None] * self.rows_per_tile + torch.arange(self.rows_per_tile, device=cells.device)
        col = (cells % width)[:, None]
        rg = rows.clamp(max=self.n - 1) * self.groups + col // self.g
        flat = rg * self.g + col % self.g
        gain = self.inner.flatten()[flat]
        gain = torch.where(self.ext_pos[rg] == col % self.g, self.ext_gain[rg].maximum(gain), gain)
        gain = gain.masked_fill(rows >= self.n, -math.inf)
        chosen = _top_in_cells(gain, counts)
        return flat[chosen], gain[chosen]

    def keep(self, flat: torch.Tensor) -> None:
        r, c = flat // self.g, flat % self.g
        self.kept[r, c] = True
        self.live[r, c] = False
        self.fill.index_add_(0, self.cells(flat), torch.ones_like(flat))
        touched = torch.unique(r)
        if self._refit_level0:
            rows = torch.unique(touched // self.groups)
            self.scheme.prepare(self.w.reshape(self.n, -1)[rows].masked_fill(self.kept.reshape(self.n, -1)[rows], 0))
            idx = (rows[:, None] * self.groups + torch.arange(self.groups, device=rows.device)).flatten()
            new = self.scheme.level0.repeat_interleave(self.groups, 0)
            moved = idx[(new != self.level0[idx])[:, 0]]
            self.level0[idx] = new
            touched = torch.unique(torch.cat([touched, moved]))
        self._offer(touched)

    @property
    def available(self) -> int:
        return int(self.live.sum())

    def mask(self) -> torch.Tensor:
        """The kept weights as a bool mask [N, K]."""
        return self.kept.reshape(self.n, -1)[:, : self.k]


def _geometry() -> tuple[int, int]:
    """(rows per bucket, outliers per entry) of the Tile-COO format the outliers go to."""
    from qoqtool.packing.tile_coo import BUCKET_N, SLOTS  # (tile_coo imports this module)

    return BUCKET_N, SLOTS


def _best_entries(gains, cell, fill, take=None, threshold=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose outliers in whole Tile-COO entries: which cells, and how many in each.

    Tile-COO stores each column's outliers within a 32-row tile four to an entry, padding
    the last entry, so a lone outlier costs as much storage and kernel time as four.
    Chosen one by one, most slots end up padding (about 60% on smollm2-135m). Here the
    unit is an entry: the next four offers of one (row tile, column) cell, or the offers
    that fill a cell's open entry. Entries go by their mean gain per slot (an offer missing
    from `gains` counts 0) until `take` weights are reached, or while the mean exceeds
    `threshold`. cell: each offer's cell id; fill: outliers each cell already holds.
    Returns (cell ids, number to take from each).
    """
    _, slots = _geometry()
    none = torch.zeros(0, dtype=torch.long, device=gains.device)
    if gains.numel() == 0:
        return none, none
    order = torch.argsort(gains, descending=True, stable=True)
    order = order[torch.argsort(cell[order], stable=True)]
    c, g = cell[order], gains[order]
    idx = torch.arange(c.numel(), device=c.device)
    new_cell = torch.ones_like(c, dtype=torch.bool)
    new_cell[1:] = c[1:] != c[:-1]
    rank = idx - torch.cummax(torch.where(new_cell, idx, 0), 0).values
    open_slots = (-fill[c]) % slots
    entry = torch.where(rank < open_slots, 0, 1 + (rank - open_slots) // slots)
    new_group = new_cell.clone()
    new_group[1:] |= entry[1:] != entry[:-1]
    first = new_group.nonzero()[:, 0]  # one per group
    group = torch.cumsum(new_group.long(), 0) - 1
    size = torch.where(entry[first] == 0, open_slots[first], slots)
    value = torch.zeros(first.numel(), device=g.device).index_add_(0, group, g.clamp(min=0)) / size
    if threshold is not None:
        chosen = (value > threshold).nonzero()[:, 0]
        n = size[chosen]
    else:
        ranked = torch.argsort(value, descending=True, stable=True)
        before = torch.cumsum(size[ranked], 0) - size[ranked]
        n = (take - before).clamp(min=0).minimum(size[ranked])
        chosen, n = ranked[n > 0], n[n > 0]
    cells, where = torch.unique(c[first[chosen]], return_inverse=True)
    return cells, torch.zeros_like(cells).index_add_(0, where, n)


def _top_in_cells(gains: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """gains [C, R] of each chosen cell's candidates -> mask of each cell's best counts[c]."""
    order = torch.argsort(gains, dim=1, descending=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(gains.shape[1], device=gains.device).expand_as(order))
    return (rank < counts[:, None]) & (gains > -math.inf)


def select(sel: _Selection, target: OutlierTarget, curve: bool = False):
    """Run the greedy selection to `target`; returns the mask [N, K] (or, with curve=True,
    the gains of the picks in the order taken)."""
    pool = 16 if target.quads else 1  # offers considered per weight to take (quads need the runners-up)
    taken = []
    if target.threshold is not None:
        for _ in range(4 * ROUNDS):  # interior weights go in bulk: this ends in a few rounds
            gains, pos = sel.offers()
            if target.quads:
                flat, picked = sel.take_in_cells(*_best_entries(gains, sel.cells(pos), sel.fill, threshold=target.threshold))
            else:
                flat, picked = pos[gains > target.threshold], gains[gains > target.threshold]
            if flat.numel() == 0:
                break
            sel.keep(flat)
            taken.append(picked)
    else:
        remaining, r = min(int(target.count), sel.available), 0
        # ROUNDS rounds, then (cells that hold fewer rows than an entry's four slots take fewer
        # weights than asked) whole rounds of what is left, as long as they take any.
        while remaining > 0:
            take = math.ceil(remaining / max(ROUNDS - r, 1))
            r += 1
            gains, pos = sel.offers(limit=pool * take, shortlist=4 * int(target.count))
            if target.quads:
                flat, picked = sel.take_in_cells(*_best_entries(gains, sel.cells(pos), sel.fill, take=take))
            else:
                top = torch.topk(gains, min(take, gains.numel()))
                flat, picked = pos[top.indices], top.values
            if flat.numel() == 0:
                break
            sel.keep(flat)
            taken.append(picked)
            remaining -= flat.numel()
    if curve:
        return torch.cat(taken) if taken else torch.zeros(0)
    return sel.mask()


def choose(weight, importance, scheme, target: OutlierTarget, clip=None) -> torch.Tensor:
    """The weights of `weight` [N, K] to keep (bool mask) for an RTN-style objective."""
    if target.count == 0:
        return torch.zeros(weight.shape, dtype=torch.bool, device=weight.device)
    return select(_Selection(weight, importance, scheme, clip), target)


def fixed_grid_gains(weight: torch.Tensor, importance: torch.Tensor, qweight: QuantizedWeight) -> torch.Tensor:
    """Gain of keeping each weight when the grids stay as they are: its own error, [N, K]."""
    return importance.float()[None, :] * (weight.float() - qweight.dequantize()) ** 2


def choose_fixed(gains: torch.Tensor, target: OutlierTarget) -> torch.Tensor:
    """Mask of the weights to keep given per-weight gains [N, K] (grids that do not move)."""
    n, k = gains.shape
    flat = gains.flatten()
    if target.quads:
        rows_per_tile, _ = _geometry()
        tiles = -(-n // rows_per_tile)
        pos = torch.arange(flat.numel(), device=flat.device)
        cell = (pos // k) // rows_per_tile * k + pos % k
        fill = torch.zeros(tiles * k, dtype=torch.long, device=flat.device)
        pick = torch.zeros(0, dtype=torch.long, device=flat.device)
        free = None  # all weights, until a pass falls short
        # A cell of a last row tile with fewer than four rows gives fewer weights than its entry's
        # four slots counted: take further passes over the weights left until the count is met.
        while target.count is None or pick.numel() < target.count:
            live = None if free is None else free.nonzero()[:, 0]
            take = None if target.count is None else target.count - pick.numel()
            cells, counts = _best_entries(flat if live is None else flat[live], cell if live is None else cell[live],
                                          fill, take=take, threshold=target.threshold)
            rows = (cells // k)[:, None] * rows_per_tile + torch.arange(rows_per_tile, device=flat.device)
            cand = rows.clamp(max=n - 1) * k + (cells % k)[:, None]
            taken = rows >= n if free is None else (rows >= n) | ~free[cand]
            new = cand[_top_in_cells(flat[cand].masked_fill(taken, -math.inf), counts)]
            pick = torch.cat([pick, new])
            if new.numel() == 0 or target.count is None:
                break
            fill.index_add_(0, cell[new], torch.ones_like(new))
            free = torch.ones_like(flat, dtype=torch.bool)
            free[pick] = False
    elif target.threshold is not None:
        pick = torch.nonzero(flat > target.threshold)[:, 0]
    else:
        pick = torch.topk(flat, min(target.count, flat.numel())).indices
    mask = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
    mask[pick] = True
    return mask.view(n, k)


# ----------------------------------------------------------------------------------------
# Quantizing with outliers
# ----------------------------------------------------------------------------------------
def quantize_keeping(weight: torch.Tensor, scheme: WeightScheme, kept: torch.Tensor, clip=None) -> QuantizedWeight:
    """RTN with every grid fitted without the kept weights [N, K] (bool).

    A kept weight still gets a dense code: the nearest in-range code of its grid, so the
    code is harmless and the outlier stores only the residual over it. With no weight kept
    this is exactly `scheme.quantize`.
    """
    n, k = weight.shape
    kp, g = scheme.padded(k), scheme.group_size_for(k)
    w = pad_columns(weight.float(), kp)
    fit_w = w.masked_fill(pad_columns(kept.to(torch.uint8), kp).bool(), 0)
    scheme.prepare(fit_w)
    grids, codes = [], []
    for i in range(kp // g):
        grid = scheme.fit(fit_w[:, i * g : (i + 1) * g], 1.0 if clip is None else clip[:, i : i + 1])
        grids.append(grid)
        codes.append(grid.quantize(w[:, i * g : (i + 1) * g]))
    codes = _neutral_padding(torch.cat(codes, dim=1), grids, g, k)
    return scheme.assemble(codes, grids, k)


def obs_importance(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """1 / [H^-1]_kk of the Hessian (H = 2/n X^T X) dampened as GPTQ dampens it, in units
    of X^T X / n; 0 for channels that are never active."""
    from qoqtool.quantizers.gptq import _inverse_hessian_factor

    h = hessian.float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    u = _inverse_hessian_factor(h, damp)  # H^-1 = U^T U
    return (0.5 / (u**2).sum(0)).masked_fill(dead, 0)


class OutlierKeeper:
    """Keeps one linear's most salient weights in fp16 while it is quantized.

    `solve` quantizes the linear (RTN, clipped RTN or GPTQ, as the recipe's solver steps
    say) and leaves the kept weights in `self.sparse`. Inside GPTQ it is the sweep's hook:

        fit_view(w)        the weight with the kept weights zeroed, for grids fitted up front
        select_group(...)  at the start of each group (dynamic groups): choose the group's
                           outliers on the compensated weights, importance from the Cholesky
                           factor, the count planned for that group
        keep(col, w, deq)  a kept weight keeps its compensated value: no error to spread
    """

    def __init__(self, target: OutlierTarget):
        self.target = target
        self.sparse: SparseOutliers | None = None
        self._mask: torch.Tensor | None = None  # [N, K_padded] kept weights
        self._group_counts: list[int] = []
        self._targets: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # col -> (rows, values)

    # -- the whole solve ---------------------------------------------------------------
    def solve(self, weight: torch.Tensor, stats, recipe, solver_params: dict) -> QuantizedWeight:
        unknown = set(solver_params) - {"clip", "gptq"}
        if unknown:
            raise ValueError(f"outliers do not know the solver step(s) {', '.join(sorted(unknown))}")
        scheme = WeightScheme(recipe.weights)
        gptq = solver_params.get("gptq")
        hessian = stats.hessian() if gptq is not None else None
        importance = obs_importance(hessian, gptq.damp) if gptq is not None else stats.mean_sq
        clip = None
        # GPTQ pins never-active input channels to zero (gptq_quantize): plan on the weight it
        # quantizes, so that no outlier is spent on a weight whose residual will be 0.
        planned = weight if gptq is None else weight.masked_fill((torch.diagonal(hessian) == 0).to(weight.device), 0)
        self._plan(planned, importance, scheme, clip)
        if "clip" in solver_params:
            from qoqtool.quantizers.clipping import search_clip

            # Clip the remainder: the range the outliers stretched is theirs no more.
            clip = search_clip(self.fit_view(planned), stats, scheme, solver_params["clip"])
            self._plan(planned, importance, scheme, clip)
        if gptq is not None:
            from qoqtool.quantizers.gptq import gptq_quantize

            qweight = gptq_quantize(weight, hessian, scheme, gptq, clip=clip, outliers=self)
            mask = torch.zeros(weight.shape, dtype=torch.bool, device=weight.device)
            target = torch.zeros(weight.shape, device=weight.device)
            for col, (rows, values) in self._targets.items():
                mask[rows, col] = True
                target[rows, col] = values
        else:
            mask = self._mask[:, : weight.shape[1]]
            qweight = quantize_keeping(weight, scheme, mask, clip)
            target = weight
        self.sparse = residual_outliers(mask, target, qweight)
        return qweight

    def _plan(self, weight, importance, scheme, clip) -> None:
        """Choose on the original weight: the outliers of grids fitted up front, and how many
        each group gets when GPTQ chooses again during the sweep."""
        n, k = weight.shape
        mask = choose(weight, importance, scheme, self.target, clip)
        self._mask = pad_columns(mask.to(torch.uint8), scheme.padded(k)).bool()
        # Progressive level 0 is fitted before the sweep without the planned outliers: those
        # larger than everything their row keeps dense must stay kept (select_group), or the
        # sweep rounds them outside level 0's range.
        self._pinned = torch.zeros_like(self._mask)
        if scheme.config.scheme == "progressive":
            wa = pad_columns(weight.float(), self._mask.shape[1]).abs()
            self._pinned = self._mask & (wa > wa.masked_fill(self._mask, 0).amax(1, keepdim=True))
        g = scheme.group_size_for(k)
        self._group_counts = self._mask.reshape(n, -1, g).sum((0, 2)).tolist()
        self.k = k

    # -- GPTQ hooks --------------------------------------------------------------------
    def fit_view(self, w: torch.Tensor) -> torch.Tensor:
        mask = self._mask[:, : w.shape[1]].to(w.device)
        return w.masked_fill(mask, 0)

    def select_group(self, gi: int, group_w: torch.Tensor, u_diag: torch.Tensor, scheme, clip) -> torch.Tensor:
        """Choose group gi's outliers on its compensated weights [N, g]; returns the group
        with them zeroed, for fitting its grid."""
        g = group_w.shape[1]
        first = gi * g
        if self.target.threshold is None and self._group_counts[gi] == 0:
            self._mask[:, first : first + g] = False
            return group_w
        eligible = torch.arange(first, first + g, device=group_w.device) < self.k
        importance = 0.5 / u_diag.float() ** 2
        sel = _Selection(group_w, importance, scheme, clip, eligible, level0=scheme.level0)
        pinned = self._pinned[:, first : first + g].to(group_w.device)
        if pinned.any():
            sel.keep(pinned.flatten().nonzero()[:, 0])
        count = self._group_counts[gi] - int(pinned.sum())
        target = self.target if self.target.threshold is not None else OutlierTarget(count)
        chosen = select(sel, target) if target.threshold is not None or count > 0 else sel.mask()
        self._mask[:, first : first + g] = chosen.to(self._mask.device)
        return group_w.masked_fill(chosen, 0)

    def keep(self, col: int, col_w: torch.Tensor, deq: torch.Tensor) -> torch.Tensor:
        """Column col [N, 1] is being rounded to deq: the kept rows keep their value."""
        rows = self._mask[:, col].nonzero()[:, 0].to(col_w.device)
        if rows.numel() == 0:
            return deq
        self._targets[col] = (rows, col_w[rows, 0].clone())
        deq = deq.clone()
        # the residual is stored in fp16: spread the (tiny) rest of the error like any other
        deq[rows, 0] += (col_w[rows, 0] - deq[rows, 0]).half().float()
        return deq


# ----------------------------------------------------------------------------------------
# Budgets over a whole model
# ----------------------------------------------------------------------------------------
def plan_outliers(budget: OutlierBudget, adapter, inputs, recipe, device, batch_size: int, name_of) -> dict[str, OutlierTarget]:
    """Per-linear targets for `quantize --outliers` (name_of(layer, linear) names a linear).

    A global budget needs every linear's gain curve before the first is quantized: a float
    pass over the calibration inputs (layer by layer, like calibration itself) measures each
    linear's input and runs its greedy selection on the float weight. The layer steps
    (smoothing, reordering) have not run yet, so the split is that of the untransformed
    layers; within each linear the outliers are then chosen on the real, transformed weight.
    """
    from qoqtool.models.adapter import LINEAR_NAMES

    layers = range(adapter.num_layers)
    sizes = {name_of(i, n): getattr(adapter.parts(i), n).weight.numel() for i in layers for n in LINEAR_NAMES}
    if budget.kind == "threshold" or budget.scope == "layer":
        return layer_targets(budget, sizes)

    from dataclasses import replace

    from qoqtool.calibration.stats import collect_input_stats

    scheme, total = WeightScheme(recipe.weights), sum(sizes.values())
    hidden = replace(inputs)  # (the caller's inputs stay those of layer 0)
    curves = {}
    for i in layers:
        hidden.layer = i
        parts = adapter.parts(i)
        parts.layer.to(device)
        stats, out = collect_input_stats(parts, hidden, device, batch_size=batch_size)
        for n in LINEAR_NAMES:
            w = getattr(parts, n).weight.data
            cap = OutlierTarget(count=curve_cap(budget, w.numel(), total))
            curves[name_of(i, n)] = select(_Selection(w, stats[n].mean_sq, scheme), cap, curve=True).cpu()
        parts.layer.to("cpu")
        hidden.hidden = out
    return global_targets(budget, curves, total)


def outliers_after_the_fact(
    weights: dict[str, QuantizedWeight],
    float_weights: dict[str, torch.Tensor],
    act_mean_sq: dict[str, torch.Tensor],
    weight_config,
    refit: bool,
    budget: OutlierBudget,
) -> dict[str, tuple[QuantizedWeight, SparseOutliers]]:
    """Add outliers to a folder quantized without them (`qoqtool pack --outliers`).

    weights: the folder's quantized linears; float_weights: their weights before rounding
    (as transformed); act_mean_sq: the calibration statistics the folder keeps;
    weight_config: the recipe's `WeightQuantConfig`.

    refit (RTN folders): choose as `quantize --outliers` does and re-fit every grid without
    the outliers - the result is what `quantize --outliers` would have written. Otherwise
    (GPTQ or clipped folders, whose codes cannot be re-derived without the calibration
    data) the codes and grids stay, and the outliers are the weights whose own error,
    weighted by E[x^2], is largest: weaker than choosing inside the sweep.
    """
    scheme = WeightScheme(weight_config)
    for name, qw in weights.items():
        if name not in float_weights or tuple(float_weights[name].shape) != tuple(qw.shape):
            raise UserError(f"the float weights do not match linear {name}; they belong to another model")
    sizes = {name: qw.shape[0] * qw.shape[1] for name, qw in weights.items()}

    def gains_or_selection(name):
        w, d = float_weights[name].float(), act_mean_sq[name].float()
        if refit:
            return _Selection(w, d, scheme)
        return fixed_grid_gains(w, d, weights[name])

    if budget.kind != "threshold" and budget.scope == "global":
        total, curves = sum(sizes.values()), {}
        for name in weights:
            cap = curve_cap(budget, sizes[name], total)
            found = gains_or_selection(name)
            if refit:
                curves[name] = select(found, OutlierTarget(count=cap), curve=True)
            else:
                curves[name] = torch.topk(found.flatten(), cap).values
        targets = global_targets(budget, curves, total)
    else:
        targets = layer_targets(budget, sizes)

    result = {}
    for name, qw in weights.items():
        w, target = float_weights[name].float(), targets[name]
        if refit:
            mask = select(gains_or_selection(name), target) if target.count != 0 else torch.zeros(w.shape, dtype=torch.bool)
            qw = quantize_keeping(w, scheme, mask)
        else:
            mask = choose_fixed(gains_or_selection(name), target)
        result[name] = (qw, residual_outliers(mask, w, qw))
    return result
