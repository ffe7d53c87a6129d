"""Outlier-aware quantization: budgets, selection, GPTQ with outliers, the reference path,
the quantized folder, and choosing outliers after the fact."""

import json
import math
from pathlib import Path

import pytest
import torch

from qoqtool.errors import UserError
from qoqtool.quantizers.gptq import GPTQParams, gptq_quantize
from qoqtool.quantizers.outliers import (
    OutlierBudget,
    OutlierKeeper,
    OutlierTarget,
    SparseOutliers,
    _Selection,
    choose,
    choose_fixed,
    global_targets,
    layer_targets,
    outliers_after_the_fact,
    parse_outliers,
    quantize_keeping,
    select,
)
from qoqtool.quantizers.schemes import PROTECTIVE_RANGE, WeightQuantConfig, WeightScheme

SCHEMES = [
    WeightQuantConfig(4, 32, "asymmetric"),
    WeightQuantConfig(4, None, "asymmetric"),
    WeightQuantConfig(4, 32, "progressive"),
    WeightQuantConfig(8, None, "symmetric"),
]


def _problem(n=64, k=96, seed=0):
    """A weight with planted outliers and inputs with a few loud channels."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    w[torch.rand(n, k, generator=g) < 0.01] *= 15
    x = torch.randn(512, k, generator=g)
    x[:, torch.randperm(k, generator=g)[:4]] *= 8
    return w, x


class _Stats:
    """What the solvers read of calibration statistics."""

    def __init__(self, x):
        self.tokens = x.shape[0]
        self.mean_sq = (x.double() ** 2).mean(0).float()
        self._h = (2.0 / x.shape[0]) * (x.double().t() @ x.double()).float()

    def hessian(self):
        return self._h


class _Recipe:
    def __init__(self, config):
        self.weights = config


def _output_error(w, x, qweight, sparse=None):
    deq = qweight.dequantize() + (sparse.to_dense() if sparse is not None else 0)
    return float(((x @ (deq - w).t()) ** 2).mean())


# -- budgets --------------------------------------------------------------------------------
def test_parse_budgets():
    assert parse_outliers("1%") == OutlierBudget("fraction", 0.01, "layer")
    assert parse_outliers(" 0.5% ", "global") == OutlierBudget("fraction", 0.005, "global")
    assert parse_outliers("5000") == OutlierBudget("count", 5000, "layer")
    assert parse_outliers("t=1e-6") == OutlierBudget("threshold", 1e-6, "layer")
    assert parse_outliers("0%").value == 0


@pytest.mark.parametrize("text", ["150%", "-1", "abc", "0.01", "-2%", "t=-1", "t=abc", "nan%", "1e3", ""])
def test_bad_budgets_are_one_line_user_errors(text):
    with pytest.raises(UserError) as err:
        parse_outliers(text)
    assert "\n" not in str(err.value) and "--outliers" in str(err.value)


def test_bad_scope():
    with pytest.raises(UserError, match="layer"):
        parse_outliers("1%", "everywhere")


def test_layer_targets_are_exact():
    sizes = {"a": 576 * 576, "b": 576 * 1536, "c": 192 * 576}
    targets = layer_targets(parse_outliers("1%"), sizes)
    assert {n: t.count for n, t in targets.items()} == {n: math.floor(0.01 * s + 0.5) for n, s in sizes.items()}
    counts = layer_targets(parse_outliers("5001"), sizes)
    assert sum(t.count for t in counts.values()) == 5001
    for name, t in counts.items():  # the same share everywhere, to within one weight
        assert abs(t.count - 5001 * sizes[name] / sum(sizes.values())) < 1


def test_global_targets_follow_the_gains():
    curves = {"loud": torch.linspace(10, 1, 100), "quiet": torch.linspace(2, 0, 100)}
    targets = global_targets(parse_outliers("60", "global"), curves, 1000)
    assert targets["loud"].count + targets["quiet"].count == 60
    assert targets["loud"].count > targets["quiet"].count
    assert (curves["quiet"] > torch.topk(torch.cat(list(curves.values())), 60).values[-1]).sum() == targets["quiet"].count


# -- selection and the dense remainder ----------------------------------------------------------
@pytest.mark.parametrize("config", SCHEMES, ids=lambda c: c.describe())
def test_no_outliers_is_plain_rtn(config):
    w, _ = _problem()
    scheme = WeightScheme(config)
    plain = scheme.quantize(w)
    kept = quantize_keeping(w, WeightScheme(config), torch.zeros(w.shape, dtype=torch.bool))
    for name, t in plain.tensors().items():
        assert torch.equal(t, kept.tensors()[name]), name


@pytest.mark.parametrize("config", SCHEMES, ids=lambda c: c.describe())
@pytest.mark.parametrize("quads", [True, False])
def test_selection_keeps_exactly_the_budget_and_cuts_the_error(config, quads):
    w, x = _problem()
    stats = _Stats(x)
    scheme = WeightScheme(config)
    count = 61
    mask = choose(w, stats.mean_sq, scheme, OutlierTarget(count=count, quads=quads))
    assert int(mask.sum()) == count
    qw = quantize_keeping(w, WeightScheme(config), mask)
    sparse = SparseOutliers.from_mask(mask, w - qw.dequantize())
    base = _output_error(w, x, scheme.quantize(w))
    assert _output_error(w, x, qw, sparse) < 0.8 * base
    # greedy beats keeping the largest single-weight errors (SpQR-style saliency without refits)
    naive = choose_fixed(stats.mean_sq[None, :] * (w - scheme.quantize(w).dequantize()) ** 2, OutlierTarget(count=count, quads=False))
    qn = quantize_keeping(w, WeightScheme(config), naive)
    assert _output_error(w, x, qw, sparse) <= _output_error(w, x, qn, SparseOutliers.from_mask(naive, w - qn.dequantize())) * 1.05


@pytest.mark.parametrize("n, share", [(1, 0.05), (2, 0.2), (3, 0.3), (64, 0.9)])
def test_the_count_is_exact_where_cells_hold_fewer_rows_than_an_entry(n, share):
    """A row tile of 1-3 rows (or nearly every weight taken) gives cells that fill an entry's
    four slots only partly: the selection still ends at exactly the count."""
    w, imp = torch.randn(n, 576, generator=torch.Generator().manual_seed(n)), torch.rand(576)
    count = round(share * n * 576)
    mask = choose(w, imp, WeightScheme(WeightQuantConfig(4, 128, "progressive")), OutlierTarget(count=count))
    assert int(mask.sum()) == count


def test_quads_fill_their_entries():
    """Chosen in whole entries: every (32-row tile, column) cell holds a multiple of four,
    but for the few entries cut at the end of a greedy round."""
    w, x = _problem(96, 128, seed=2)
    mask = choose(w, _Stats(x).mean_sq, WeightScheme(SCHEMES[0]), OutlierTarget(count=400))
    per_cell = mask.reshape(3, 32, 128).sum(1)
    partial = int((per_cell % 4 != 0).sum())
    assert int(mask.sum()) == 400 and partial <= 16


def test_grids_are_fitted_without_the_outliers():
    w = torch.randn(8, 32) * 0.01
    w[3, 7] = 1.0  # widens row 3's grid a hundredfold
    mask = torch.zeros_like(w, dtype=torch.bool)
    mask[3, 7] = True
    config = WeightQuantConfig(4, 32, "asymmetric")
    qw = quantize_keeping(w, WeightScheme(config), mask)
    without = w.clone()
    without[3, 7] = 0
    assert torch.equal(qw.scale, WeightScheme(config).quantize(without).scale)
    # the outlier's own code is the nearest in-range code: harmless, and the residual restores it
    sparse = SparseOutliers.from_mask(mask, w - qw.dequantize())
    assert int(qw.codes[3, 7]) == 15
    assert abs(float(qw.dequantize()[3, 7] + sparse.values[0].float()) - 1.0) < 1e-3


def test_threshold_keeps_every_entry_worth_it():
    w, x = _problem(seed=4)
    d = _Stats(x).mean_sq
    scheme = WeightScheme(SCHEMES[0])
    few = choose(w, d, scheme, OutlierTarget(threshold=1e-3))
    many = choose(w, d, scheme, OutlierTarget(threshold=1e-5))
    assert 0 < int(few.sum()) < int(many.sum())
    assert (few & ~many).sum() <= int(few.sum()) // 4  # nearly nested


# -- GPTQ ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", SCHEMES[:3], ids=lambda c: c.describe())
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_with_no_outliers_is_gptq(config, act_order):
    w, x = _problem(seed=5)
    stats, params = _Stats(x), GPTQParams(act_order=act_order)
    plain = gptq_quantize(w, stats.hessian(), WeightScheme(config), params)
    keeper = OutlierKeeper(OutlierTarget(count=0))
    kept = keeper.solve(w, stats, _Recipe(config), {"gptq": params})
    assert keeper.sparse.nnz == 0
    for name, t in plain.tensors().items():
        assert torch.equal(t, kept.tensors()[name]), name


@pytest.mark.parametrize("config", SCHEMES[:3], ids=lambda c: c.describe())
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_with_outliers(config, act_order):
    """Exact count; beats GPTQ alone and RTN with the same outliers; the residuals restore
    each kept weight's compensated value to within fp16 rounding."""
    w, x = _problem(seed=6)
    stats, params = _Stats(x), GPTQParams(act_order=act_order)
    keeper = OutlierKeeper(OutlierTarget(count=80))
    qw = keeper.solve(w, stats, _Recipe(config), {"gptq": params})
    assert keeper.sparse.nnz == 80
    gptq_alone = _output_error(w, x, gptq_quantize(w, stats.hessian(), WeightScheme(config), params))
    rtn_keeper = OutlierKeeper(OutlierTarget(count=80))
    rtn = rtn_keeper.solve(w, stats, _Recipe(config), {})
    assert _output_error(w, x, qw, keeper.sparse) < 0.9 * gptq_alone
    assert _output_error(w, x, qw, keeper.sparse) < _output_error(w, x, rtn, rtn_keeper.sparse)


def test_clip_search_sees_the_weights_without_outliers():
    from qoqtool.quantizers.clipping import ClipParams

    w, x = _problem(seed=8)
    config = WeightQuantConfig(4, 32, "asymmetric")
    keeper = OutlierKeeper(OutlierTarget(count=60))
    qw = keeper.solve(w, _Stats(x), _Recipe(config), {"clip": ClipParams(), "gptq": GPTQParams()})
    assert keeper.sparse.nnz == 60
    assert _output_error(w, x, qw, keeper.sparse) < _output_error(w, x, WeightScheme(config).quantize(w))


# -- the reference path -----------------------------------------------------------------------
@pytest.mark.parametrize("act_bits", [16, 8])
def test_quant_linear_adds_the_outliers(act_bits):
    from qoqtool.quantizers.activations import quantize_per_token
    from qoqtool.runtime.reference import QuantLinear

    w, x = _problem(seed=9)
    config = WeightQuantConfig(4, 32, "progressive" if act_bits == 8 else "asymmetric")
    keeper = OutlierKeeper(OutlierTarget(count=50))
    qw = keeper.solve(w, _Stats(x), _Recipe(config), {})
    sparse = keeper.sparse
    xs = x[:16]
    y = QuantLinear(qw, None, act_bits, outliers=sparse)(xs)
    dense = QuantLinear(qw, None, act_bits)(xs)
    if act_bits == 16:
        expect = xs @ (qw.dequantize() + sparse.to_dense()).t()
    else:
        # the sparse term multiplies the same INT8 codes, scaled per token
        codes, scales = quantize_per_token(xs)
        expect = dense + (codes.float() @ sparse.to_dense().t()) * scales[:, None]
    torch.testing.assert_close(y, expect, rtol=1e-5, atol=1e-5)
    assert float(((y - xs @ w.t()) ** 2).mean()) < float(((dense - xs @ w.t()) ** 2).mean())


def test_sparse_outliers_validation():
    ok = SparseOutliers(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3, 0], dtype=torch.int32),
                        torch.tensor([1.0, 2.0], dtype=torch.float16), (2, 4))
    assert ok.nnz == 2
    with pytest.raises(ValueError, match="outside"):
        SparseOutliers(ok.rows, torch.tensor([4, 0], dtype=torch.int32), ok.values, (2, 4))
    with pytest.raises(ValueError, match="sorted"):
        SparseOutliers(ok.rows.flip(0), ok.cols.flip(0), ok.values, (2, 4))
    with pytest.raises(ValueError, match="int32"):
        SparseOutliers(ok.rows.long(), ok.cols, ok.values, (2, 4))


# -- the pipeline and the quantized folder -------------------------------------------------------
def _tiny_quantize(recipe_dict, outliers, tmp_path, name, keep_float_weights=False, model=None):
    from conftest import tiny_model

    from qoqtool.calibration.pipeline import quantize_model
    from qoqtool.packing import quantized
    from qoqtool.recipe import recipe_from_dict

    model = model if model is not None else tiny_model("llama")
    tokens = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    budget = None if outliers is None else parse_outliers(*outliers)
    result = quantize_model(model, recipe_from_dict(recipe_dict), tokens, outliers=budget, keep_float_weights=keep_float_weights)
    folder = tmp_path / name
    quantized.save(result, None, str(folder), "tiny", {}, overwrite=False)
    model.config.save_pretrained(folder)
    return result, folder


RTN = {"name": "t", "weights": {"bits": 4, "scheme": "asymmetric", "group_size": 32}, "activations": {"bits": 16}}
QOQ_LIKE = {"name": "q", "weights": {"bits": 4, "scheme": "progressive", "group_size": 32}, "activations": {"bits": 8},
            "kv_cache": {"bits": 4}, "steps": [{"gptq": {}}]}


def _load(folder):
    from qoqtool.packing import folder as fs
    from qoqtool.runtime.loading import load_quantized_folder

    return load_quantized_folder(Path(folder), fs.read_manifest(folder))


@pytest.mark.parametrize("recipe", [RTN, QOQ_LIKE], ids=["rtn-w4a16", "gptq-w4a8kv4"])
def test_quantize_with_outliers_round_trips_through_the_folder(recipe, tmp_path):
    from qoqtool.runtime.reference import QuantLinear

    result, folder = _tiny_quantize(recipe, ("2%",), tmp_path, "q")
    manifest = json.loads((folder / "qoqtool.json").read_text())
    assert manifest["outliers"]["count"] == result.outliers["count"] > 0
    loaded = _load(folder)
    x = torch.randint(0, 128, (1, 24))
    for name, module in result.model.named_modules():
        if isinstance(module, QuantLinear):
            again = loaded.get_submodule(name).outliers
            assert torch.equal(again.rows, module.outliers.rows) and torch.equal(again.values, module.outliers.values)
    with torch.no_grad():
        # the loader rounds embeddings and norms to fp16 (deployed precision): close, not equal
        torch.testing.assert_close(loaded(x).logits, result.model(x).logits, rtol=0.05, atol=0.05)


def test_zero_percent_is_byte_identical_to_no_outliers(tmp_path):
    plain, _ = _tiny_quantize(QOQ_LIKE, None, tmp_path, "a")
    zero, _ = _tiny_quantize(QOQ_LIKE, ("0%",), tmp_path, "b")
    x = torch.randint(0, 128, (1, 24))
    with torch.no_grad():
        assert torch.equal(plain.model(x).logits, zero.model(x).logits)


def test_global_budget_is_exact_and_uneven(tmp_path):
    result, folder = _tiny_quantize(RTN, ("300", "global"), tmp_path, "g")
    from qoqtool.packing import folder as fs
    from qoqtool.packing import quantized

    found = quantized.load_outliers(folder, fs.read_manifest(folder))
    counts = [s.nnz for s in found.values()]
    assert sum(counts) == 300 and len(set(counts)) > 1


def test_damaged_outliers_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    _, folder = _tiny_quantize(RTN, ("2%",), tmp_path, "d")
    path = folder / "outliers.safetensors"
    tensors = load_file(str(path))
    key = next(k for k in tensors if k.endswith("outlier_values"))
    tensors[key] = tensors[key].clone()
    tensors[key][0] += 1
    save_file(tensors, str(path))
    with pytest.raises(UserError, match="checksum"):
        _load(folder)


def test_after_the_fact_equals_quantize_for_rtn(tmp_path):
    """pack --outliers on an RTN folder re-fits the grids without the outliers: exactly what
    quantize --outliers writes (weights made fp16-exact, as the folder keeps them). Exactly
    in layer 0: later layers were calibrated on the outputs of layers quantized with or
    without outliers, so their statistics, and choices, differ a little."""
    from conftest import tiny_model

    from qoqtool.packing import folder as fs
    from qoqtool.packing import quantized

    def fp16_model():
        model = tiny_model("llama")
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.half().float())
        return model

    _, plain = _tiny_quantize(RTN, None, tmp_path, "plain", keep_float_weights=True, model=fp16_model())
    direct, _ = _tiny_quantize(RTN, ("3%",), tmp_path, "direct", model=fp16_model())
    manifest = fs.read_manifest(plain)
    weights, _ = quantized.load_weights(plain, manifest)
    stats = quantized.load_stats(plain, manifest)
    floats = quantized.load_float_weights(plain, manifest)
    msq = {name: stats[f"{name}.act_mean_sq"] for name in weights}
    later = outliers_after_the_fact(weights, floats, msq, WeightScheme(SCHEMES[0]).config, True, parse_outliers("3%"))
    for name, (qw, sparse) in later.items():
        module = direct.model.get_submodule(name)
        assert sparse.nnz == module.outliers.nnz
        if not name.startswith("model.layers.0."):
            continue
        assert torch.equal(qw.codes, module.qweight.codes) and torch.equal(qw.scale, module.qweight.scale)
        assert torch.equal(sparse.rows, module.outliers.rows) and torch.equal(sparse.cols, module.outliers.cols)
        assert torch.equal(sparse.values, module.outliers.values)


def test_after_the_fact_keeps_gptq_codes():
    w, x = _problem(seed=11)
    config = WeightQuantConfig(4, 32, "asymmetric")
    qw = gptq_quantize(w, _Stats(x).hessian(), WeightScheme(config), GPTQParams())
    out = outliers_after_the_fact({"l": qw}, {"l": w}, {"l": _Stats(x).mean_sq}, config, False, parse_outliers("2%"))
    kept_qw, sparse = out["l"]
    assert kept_qw is qw and sparse.nnz == round(0.02 * w.numel())
    assert _output_error(w, x, qw, sparse) < _output_error(w, x, qw)


def test_float_weights_are_required_for_transformed_folders(tmp_path):
    from qoqtool.packing import quantized

    manifest = {"recipe": {"steps": [{"rotate": {}}, {"gptq": {}}]}, "files": {}, "linears": {}}
    with pytest.raises(UserError, match="keep-float-weights"):
        quantized.load_float_weights(tmp_path, manifest)


# -- the selection scores the stored grids and spends the whole budget (review of 2026-12-07) --
_PROGRESSIVE = WeightQuantConfig(4, 32, "progressive")


@pytest.mark.parametrize("config", [_PROGRESSIVE, WeightQuantConfig(4, 32, "asymmetric"), WeightQuantConfig(4, None, "asymmetric")],
                         ids=lambda c: c.describe())
def test_rtn_selection_scores_against_the_stored_grid(config):
    """Every dense weight the greedy scored is stored on the same grid (progressive: level 0
    included), so the gains it ranked are the stored model's. (The asymmetric schemes have
    no level 0: controls, which held before the progressive case was fixed.)"""
    w, x = _problem()
    sel = _Selection(w, _Stats(x).mean_sq, WeightScheme(config))
    mask = select(sel, OutlierTarget(count=61))
    n, k = w.shape
    scored = sel._fake(torch.arange(sel.w.shape[0]), sel.w.masked_fill(sel.kept, 0), sel.w).reshape(n, -1)[:, :k]
    stored = quantize_keeping(w, WeightScheme(config), mask).dequantize()
    assert torch.equal(scored[~mask], stored[~mask])


def test_gptq_keeps_the_outliers_level0_was_fitted_without():
    """Progressive level 0 is fitted before the sweep without the planned outliers: a planned
    outlier larger than all its row keeps dense must be kept, or it is rounded outside
    level 0's range [-119, 119] * s0."""
    w, x = _problem(seed=6)
    keeper = OutlierKeeper(OutlierTarget(count=80))
    qw = keeper.solve(w, _Stats(x), _Recipe(_PROGRESSIVE), {"gptq": GPTQParams()})
    kept = torch.zeros(w.shape, dtype=torch.bool)
    kept[keeper.sparse.rows.long(), keeper.sparse.cols.long()] = True
    s0 = qw.scale0.float()[:, None]
    assert keeper.sparse.nnz == 80
    assert not ((w.abs() > (PROTECTIVE_RANGE + 0.5) * s0) & ~kept).any()


@pytest.mark.parametrize("n", [33, 34, 35])  # last row tile of 1, 2, 3 rows
def test_fixed_grid_choice_spends_the_whole_budget(n):
    """pack --outliers on a GPTQ/clipped folder (choose_fixed): exact count, also where the
    last row tile has fewer rows than an entry's four slots."""
    gains = torch.rand(n, 576, generator=torch.Generator().manual_seed(n))
    gains[32:] *= 100  # the last, partial row tile holds the largest gains
    count = round(0.05 * n * 576)
    assert int(choose_fixed(gains, OutlierTarget(count=count)).sum()) == count


@pytest.mark.parametrize("config, act_order", [(WeightQuantConfig(4, None, "asymmetric"), False),
                                               (WeightQuantConfig(4, 32, "progressive"), True)],
                         ids=["per-channel", "progressive-act-order"])
def test_gptq_spends_no_outlier_on_a_dead_channel(config, act_order):
    """GPTQ pins never-active input channels to zero; with static grids the plan is kept as
    chosen, so it must be chosen on the pinned weight: no stored residual of 0."""
    w, x = _problem(seed=3)
    x[:, :3] = 0
    w[:, :3] *= 30  # loud weights on the dead channels would win an unpinned plan
    keeper = OutlierKeeper(OutlierTarget(count=60))
    keeper.solve(w, _Stats(x), _Recipe(config), {"gptq": GPTQParams(act_order=act_order)})
    assert keeper.sparse.nnz == 60
    assert int((keeper.sparse.cols < 3).sum()) == 0 and bool((keeper.sparse.values != 0).all())
