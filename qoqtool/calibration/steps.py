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


STEPS: dict[str, StepSpec] = {}


def register_step(name: str, phase: str, params: type, run: Callable | None = None) -> None:
    STEPS[name] = StepSpec(name, phase, params, run)


def step_params(name: str, raw: dict):
    """Build the parameter dataclass of step `name` from a recipe's mapping."""
    spec = STEPS[name]
    allowed = {f.name for f in fields(spec.params)}
    unknown = set(raw) - allowed
    if unknown:
        raise UserError(
            f"step {name}: unknown parameter(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(allowed))}"
        )
    return spec.params(**raw)



# The modules that define steps register them when imported.
from qoqtool.quantizers import clipping, gptq  # noqa: E402,F401
from qoqtool.transforms import key_centering, reorder, rotation, smooth_attention, smooth_output  # noqa: E402,F401
