"""`quantize_model`: apply a recipe to a model, layer by layer.

    model steps  (once, exact)     e.g. rotate
    for each decoder layer:
        layer steps (in order)     e.g. smooth_attention, smooth_output, reorder
        input statistics           mean square / max per channel (+ Hessian for GPTQ)
        each linear -> QuantLinear RTN, clipped RTN or GPTQ, in the recipe's format
                                   (gptq.true_sequential: statistics and rounding group by
                                   group, q/k/v -> o -> gate/up -> down)
        quantized layer forward    -> inputs of the next layer

The result is a model whose linears are `QuantLinear` (exact reference path) and whose
attention quantizes the KV cache; `qoqtool.packing.quantized.save` writes it out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from qoqtool.calibration.capture import LayerCapture, capture_layer
from qoqtool.calibration.runner import capture_first_layer_inputs, run_layer
from qoqtool.calibration.stats import SHARED_INPUTS, InputStats, collect_input_stats
from qoqtool.calibration.steps import STEPS, step_params
from qoqtool.models.adapter import ModelAdapter
from qoqtool.quantizers.formats import QuantizedWeight
from qoqtool.quantizers.schemes import WeightScheme
from qoqtool.recipe import Recipe
from qoqtool.runtime.attention import enable_kv_quantization
from qoqtool.runtime.reference import QuantLinear

ProgressFn = Callable[[str, int, int], None]  # (what, done, total)

# What the layer steps read: the inputs of the linears they rebalance (o_proj, down_proj),
# a subsample of CAPTURED_TOKENS of them for grid searches, and the post-RoPE keys.
CAPTURED_INPUTS = ("o_proj", "down_proj")
CAPTURED_TOKENS = 2048


@dataclass
class QuantizeResult:
    model: torch.nn.Module
    recipe: Recipe
    input_stats: dict[str, InputStats]  # qualified linear name -> statistics of its input
    layer_report: dict[str, dict]  # qualified linear name -> error figures
    notes: list[str] = field(default_factory=list)
    step_log: list[str] = field(default_factory=list)  # per-layer decisions of the steps
    seconds: float = 0.0
    outliers: dict | None = None  # the outlier budget and how many were kept (quantize --outliers)
    float_weights: dict[str, torch.Tensor] | None = None  # fp16 weights before rounding, if asked


@dataclass
class LayerContext:
    """What a layer step sees: the layer's parts, its calibration inputs, the run settings."""

    index: int
    adapter: ModelAdapter
    parts: object
    inputs: object
    device: torch.device
    recipe: Recipe
    batch_size: int
    log: list[str]
    capture: LayerCapture | None = None  # one pass over the layer, kept exact by the steps


def _qualified(index: int, name: str) -> str:
    sub = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"model.layers.{index}.{sub}.{name}"


def weight_error(w: torch.Tensor, qweight: QuantizedWeight, stats: InputStats, outliers=None) -> dict:
    """Relative weight error, and the output error it causes on the calibration inputs
    (diagonal-Hessian approximation: sum_k E[x_k^2] |dW[:, k]|^2 over sum_k E[x_k^2] |W[:, k]|^2).
    outliers: the SparseOutliers kept beside the codes, if any (part of the weight)."""
    w = w.float()
    dw = qweight.dequantize().to(w.device) - w
    if outliers is not None:
        dw += outliers.to_dense().to(w.device)
    msq = stats.mean_sq.to(w.device)
    return {
        "weight_rel_error": float(dw.norm() / w.norm().clamp(min=1e-12)),
        "output_rel_error": float(((dw.pow(2).sum(0) * msq).sum() / (w.pow(2).sum(0) * msq).sum().clamp(min=1e-30)).sqrt()),
    }


def solve_linear(weight: torch.Tensor, stats: InputStats, recipe: Recipe, solver_params: dict, outliers=None) -> QuantizedWeight:
    """Round one weight [N, K] in the recipe's format: GPTQ if the recipe asks, else RTN.

    outliers: an `OutlierKeeper` (qoqtool.quantizers.outliers): the same solvers, keeping
    the most salient weights in fp16 (afterwards in `outliers.sparse`).
    """
    if outliers is not None:
        return outliers.solve(weight, stats, recipe, solver_params)
    scheme = WeightScheme(recipe.weights)
    clip = None
    if "clip" in solver_params:
        from qoqtool.quantizers.clipping import search_clip

        clip = search_clip(weight, stats, scheme, solver_params["clip"])
    if "gptq" in solver_params:
        from qoqtool.quantizers.gptq import gptq_quantize

        return gptq_quantize(weight, stats.hessian(), scheme, solver_params["gptq"], clip=clip)
    return scheme.quantize(weight, clip)


def check_recipe_fits(model: torch.nn.Module, recipe: Recipe) -> None:
    """A one-line UserError, before any work, for a model that one of the recipe's steps cannot
    take (a size without a Hadamard matrix, say): called as soon as the model is loaded, so
    that calibration text is not gathered or sampled for nothing."""
    adapter = ModelAdapter(model)
    for step in recipe.steps:
        if STEPS[step.name].check is not None:
            STEPS[step.name].check(adapter, step_params(step.name, step.params))


@torch.no_grad()
def quantize_model(
    model: torch.nn.Module,
    recipe: Recipe,
    tokens: torch.Tensor,
    device: str | torch.device = "cpu",
    batch_size: int = 8,
    progress: ProgressFn | None = None,
    transform_only: bool = False,
    outliers=None,
    keep_float_weights: bool = False,
) -> QuantizeResult:
    """Apply `recipe` to `model` in place (see the module docstring).

    transform_only: run the recipe's transforms (rotation, smoothing, reordering, ...) but
    leave every weight and activation in float - the model must then compute what it did
    before, up to rounding, which is how the transforms are tested.
    outliers: an `OutlierBudget` (qoqtool.quantizers.outliers): keep that many weights in fp16.
    keep_float_weights: also return every linear's weight before rounding (fp16), which
    `qoqtool pack --outliers` needs to choose outliers later for recipes with transforms.
    """
    start = time.perf_counter()
    device = torch.device(device)
    adapter = ModelAdapter(model)
    notes: list[str] = []
    log: list[str] = []
    model.to("cpu")
    model.config.use_cache = False
    # The KV quantizer lives in the attention function; layers switch it on once quantized,
    # so that each layer's calibration sees the quantized cache of the layers before it.
    enable_kv_quantization(model, 16)

    for step in recipe.steps:
        if STEPS[step.name].phase == "model":
            STEPS[step.name].run(adapter, step_params(step.name, step.params), notes)

    layer_steps = [(s.name, step_params(s.name, s.params)) for s in recipe.steps if STEPS[s.name].phase == "layer"]
    solver = {s.name: step_params(s.name, s.params) for s in recipe.steps if STEPS[s.name].phase == "solver"}

    inputs = capture_first_layer_inputs(adapter, tokens, device)
    targets = None
    if outliers is not None and not transform_only:
        from qoqtool.quantizers.outliers import OutlierKeeper, plan_outliers

        targets = plan_outliers(outliers, adapter, inputs, recipe, device, batch_size, _qualified)
    kept, weights, float_weights = 0, 0, {}
    all_stats: dict[str, InputStats] = {}
    report: dict[str, dict] = {}
    for i in range(adapter.num_layers):
        inputs.layer = i  # (its attention mask, where layers attend differently)
        parts = adapter.parts(i)
        parts.layer.to(device)
        ctx = LayerContext(i, adapter, parts, inputs, device, recipe, batch_size, log)
        if layer_steps:
            ctx.capture = capture_layer(ctx, CAPTURED_INPUTS, max_tokens=CAPTURED_TOKENS, keys=True)
        for name, params in layer_steps:
            STEPS[name].run(ctx, params)
        if transform_only:
            inputs.hidden = run_layer(parts.layer, inputs, device, batch_size)
            parts.layer.to("cpu")
            if progress:
                progress("layers", i + 1, adapter.num_layers)
            continue
        need_hessian = "gptq" in solver or "clip" in solver
        sequential = "gptq" in solver and solver["gptq"].true_sequential
        # stats.SHARED_INPUTS lists a layer's inputs in the order they are computed: with
        # true_sequential each is gathered (and its readers rounded) on its own, in that order.
        for sources in [(src,) for src in SHARED_INPUTS] if sequential else [tuple(SHARED_INPUTS)]:
            if sequential and sources == ("o_proj",):
                parts.attn.qoq_kv_bits = recipe.kv_bits  # o_proj's inputs: attention over the quantized cache
            stats, _ = collect_input_stats(parts, inputs, device, need_hessian, batch_size, sources)
            for name in stats:  # the readers of `sources`: q/k/v, o, gate/up, down
                linear = getattr(parts, name)
                qualified = _qualified(i, name)
                keeper = OutlierKeeper(targets[qualified]) if targets else None
                qweight = solve_linear(linear.weight.data, stats[name], recipe, solver, keeper)
                sparse = keeper.sparse if keeper else None
                kept, weights = kept + (sparse.nnz if sparse else 0), weights + linear.weight.numel()
                if keep_float_weights:
                    float_weights[qualified] = linear.weight.data.half().cpu()
                report[qualified] = weight_error(linear.weight.data, qweight, stats[name], sparse)
                parent = parts.attn if name in ("q_proj", "k_proj", "v_proj", "o_proj") else parts.mlp
                setattr(parent, name, QuantLinear(qweight, linear.bias, recipe.act_bits, outliers=sparse).to(device))
                all_stats[qualified] = stats[name]
            for st in stats.values():
                st.xtx = None  # Hessians are large (K x K); keep only the per-channel figures
        parts.attn.qoq_kv_bits = recipe.kv_bits
        inputs.hidden = run_layer(parts.layer, inputs, device, batch_size)
        parts.layer.to("cpu")
        if progress:
            progress("layers", i + 1, adapter.num_layers)

    enable_kv_quantization(model, 16 if transform_only else recipe.kv_bits)
    result = QuantizeResult(model, recipe, all_stats, report, notes, log, time.perf_counter() - start)
    if targets:
        result.outliers = {**outliers.to_dict(), "count": kept, "share": kept / weights}
    result.float_weights = float_weights or None
    return result
