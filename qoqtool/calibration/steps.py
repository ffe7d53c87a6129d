"""The registry of recipe steps: name -> parameters dataclass and where the step runs.

`model` steps run once on the whole model before calibration (exact rewrites that need no
data, e.g. the block-input rotation). `layer` steps run inside the layer-by-layer loop, in
recipe order, on the layer's calibration inputs. `solver` steps change how each linear's
weight is rounded (clipping ranges, GPTQ) rather than the model.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

from qoqtool.errors import UserError


@dataclass
class StepSpec:
    name: str
    phase: str  # "model" | "layer" | "solver"
    params: type  # a dataclass of the step's parameters, with defaults
    run: Callable | None  # model: run(adapter, params, notes); layer: run(ctx, params); solver: None
    check: Callable | None = None  # check(adapter, params): a one-line UserError for a model the step cannot take


STEPS: dict[str, StepSpec] = {}


def register_step(name: str, phase: str, params: type, run: Callable | None = None, check: Callable | None = None) -> None:
    STEPS[name] = StepSpec(name, phase, params, run, check)


def step_params(name: str, raw: dict):
    """Build the parameter dataclass of step `name` from a recipe's mapping."""
    spec = STEPS[name]
    known = {f.name: f for f in fields(spec.params)}
    unknown = set(raw) - set(known)
    if unknown:
        raise UserError(
            f"step {name}: unknown parameter(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}"
        )
    return spec.params(**{key: _typed(name, known[key], value) for key, value in raw.items()})


# The linears whose inputs the layer steps that rebalance them (smooth_output, reorder) can act on.
REBALANCED_LINEARS = ("o_proj", "down_proj")


def check_linears(linears: tuple) -> None:
    """ValueError unless `linears` names only REBALANCED_LINEARS (a step's `linears` parameter)."""
    unknown = [name for name in linears if name not in REBALANCED_LINEARS]
    if unknown:
        raise ValueError(f"linears may name {' and '.join(REBALANCED_LINEARS)} only, not {', '.join(unknown)}")


def _typed(step: str, field, value):
    """`value` as the type of the parameter's default (int, float, bool, a tuple of names), or a
    one-line UserError: a recipe's "20" or [o_proj] must not reach the step as a str or list."""
    default, kind = field.default, None
    if isinstance(default, bool):
        kind = None if isinstance(value, bool) else "true or false"
    elif isinstance(default, int):
        kind = None if isinstance(value, int) and not isinstance(value, bool) else "a whole number"
    elif isinstance(default, float):
        kind = None if isinstance(value, (int, float)) and not isinstance(value, bool) else "a number"
        value = float(value) if kind is None else value
    elif isinstance(default, tuple):
        kind = None if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value) else "a list of names"
        value = tuple(value) if kind is None else value
    if kind is not None:
        raise UserError(f"step {step}: {field.name} is {kind}, not {value!r}")
    return value


# The modules that define steps register them when imported.
from qoqtool.quantizers import clipping, gptq  # noqa: E402,F401
from qoqtool.transforms import key_centering, reorder, rotation, smooth_attention, smooth_output  # noqa: E402,F401
