"""Recipes: a quantization scheme as YAML that names each step and its parameters.

A recipe is selected by name (a file in the top-level recipes/ folder, shipped inside the
package as qoqtool.recipes) or by path. It says what is quantized and how (weights,
activations, KV cache) and which steps run, in order, before the weights are rounded:

    name: qoq-w4a8kv4-g128
    weights:     {bits: 4, scheme: progressive, group_size: 128}
    activations: {bits: 8}        # per-token symmetric INT8; 16 leaves them in float
    kv_cache:    {bits: 4}        # per-token per-head asymmetric; 16 leaves it in float
    steps:
      - rotate: {}
      - smooth_attention: {alpha: 0.5}
      - gptq: {damp: 0.01, block_size: 128}

`Recipe.to_dict()` is what the manifest records (every step's parameters, defaults included),
so a run can be reproduced and diffed.
"""

from __future__ import annotations

import importlib.resources
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from qoqtool.errors import UserError
from qoqtool.quantizers.schemes import WeightQuantConfig


@dataclass
class Step:
    name: str
    params: dict = field(default_factory=dict)


@dataclass
class Recipe:
    name: str
    weights: WeightQuantConfig
    act_bits: int = 16  # (as a recipe without `activations` reads)
    kv_bits: int = 16
    steps: list[Step] = field(default_factory=list)
    description: str = ""

    def step(self, name: str) -> Step | None:
        return next((s for s in self.steps if s.name == name), None)

    def to_dict(self) -> dict:
        """The recipe as a manifest records it: every step with all of its parameters, defaults
        included, so that a later qoqtool whose defaults differ reads the folder as it was made
        (the rotate step's `hadamard` default went from 1 to 2)."""
        from qoqtool.calibration.steps import step_params

        def resolved(step: Step) -> dict:
            params = asdict(step_params(step.name, step.params))
            return {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()}

        w = self.weights
        return {
            "name": self.name,
            "description": self.description,
            "weights": {"bits": w.bits, "scheme": w.scheme, "group_size": w.group_size},
            "activations": {"bits": self.act_bits},
            "kv_cache": {"bits": self.kv_bits},
            "steps": [{s.name: resolved(s)} for s in self.steps],
        }

    def summary(self) -> str:
        kv = f"KV{self.kv_bits}" if self.kv_bits < 16 else "KV16"
        return f"{self.weights.describe()}, A{self.act_bits}, {kv}"


# The top-level keys of a recipe (Recipe.to_dict writes all of them).
RECIPE_KEYS = ("name", "description", "weights", "activations", "kv_cache", "steps")


def saved_step(recipe: dict, name: str) -> dict | None:
    """The parameters of step `name` in a recipe as a manifest saves it (`Recipe.to_dict`),
    or None when the recipe has no such step."""
    return next((step[name] for step in recipe.get("steps", []) if name in step), None)


def recipes_dir() -> Path:
    return Path(str(importlib.resources.files("qoqtool.recipes")))


def known_recipes() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def load_recipe(name_or_path: str) -> Recipe:
    path = Path(name_or_path).expanduser()
    if path.suffix.lower() in (".yaml", ".yml"):
        if not path.is_file():
            raise UserError(f"recipe file {name_or_path} does not exist")
    else:
        path = recipes_dir() / f"{name_or_path}.yaml"
        if not path.is_file():
            raise UserError(f"unknown recipe {name_or_path!r}; known recipes: {', '.join(known_recipes())}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise UserError(f"recipe {path} is not UTF-8 text (byte {err.start}: {err.reason})") from None
    except yaml.YAMLError as err:
        raise UserError(f"recipe {path} is not valid YAML: {str(err).splitlines()[0]}") from None
    return recipe_from_dict(data, str(path))


def recipe_from_dict(data: dict, origin: str = "<dict>", check_params: bool = True) -> Recipe:
    """A Recipe from its mapping (YAML or a manifest's), every step's parameters checked unless
    `check_params` is off (a saved recipe may name a parameter this qoqtool no longer has)."""
    from qoqtool.calibration.steps import STEPS, step_params  # the registry of step names

    if not isinstance(data, dict) or "name" not in data or "weights" not in data:
        raise UserError(f"recipe {origin} needs at least 'name' and 'weights'")
    unknown = sorted(set(data) - set(RECIPE_KEYS))
    if unknown and check_params:  # (a saved recipe may come from another qoqtool)
        raise UserError(f"recipe {origin}: unknown key(s) {', '.join(map(str, unknown))}; known: {', '.join(RECIPE_KEYS)}")
    for key, example in (("weights", "{bits: 4, scheme: progressive, group_size: 128}"), ("activations", "{bits: 8}"),
                         ("kv_cache", "{bits: 4}")):
        if key in data and not isinstance(data[key], dict) and not (key != "weights" and data[key] is None):
            raise UserError(f"recipe {origin}: {key} is a mapping such as {example}, not {data[key]!r}")
    w = data["weights"]
    group_size = w.get("group_size") or None
    if group_size is not None and (not _is_int(group_size) or group_size < 32 or group_size & (group_size - 1)):
        raise UserError(f"recipe {origin}: weights.group_size is null (per channel) or a power of two from 32 "
                        f"(the packed format's k-tiles, the kernels' group shift), not {group_size!r}")
    bits = _bits(w, 4, "weights", origin)
    try:
        weights = WeightQuantConfig(bits=bits, group_size=group_size, scheme=w.get("scheme", "asymmetric"))
    except (ValueError, TypeError) as err:
        raise UserError(f"recipe {origin}: weights: {err}") from None
    act_bits = _bits(data.get("activations") or {}, 16, "activations", origin)
    kv_bits = _bits(data.get("kv_cache") or {}, 16, "kv_cache", origin)
    if act_bits not in (8, 16):
        raise UserError(f"recipe {origin}: activations.bits must be 8 or 16, not {act_bits}")
    if kv_bits not in (4, 8, 16):
        raise UserError(f"recipe {origin}: kv_cache.bits must be 4, 8 or 16, not {kv_bits}")
    if not isinstance(data.get("steps") or [], list):
        raise UserError(f"recipe {origin}: steps is a list, one '- name: {{params}}' item per step, in the order they run")
    steps = []
    for entry in data.get("steps") or []:
        if isinstance(entry, str):
            entry = {entry: {}}
        if not isinstance(entry, dict) or len(entry) != 1:
            raise UserError(f"recipe {origin}: each step is one 'name: {{params}}' mapping, got {entry!r}")
        (name, params), = entry.items()
        if name not in STEPS:
            raise UserError(f"recipe {origin}: unknown step {name!r}; known steps: {', '.join(STEPS)}")
        if any(step.name == name for step in steps):
            raise UserError(f"recipe {origin}: step {name} appears twice; give it once, with all its parameters")
        if params is not None and not isinstance(params, dict):
            raise UserError(f"recipe {origin}: step {name}'s parameters are a mapping such as {{}}, not {params!r}")
        try:
            if check_params:
                step_params(name, dict(params or {}))  # unknown or bad parameters fail here, before any work
        except UserError as err:
            raise UserError(f"recipe {origin}: {err}") from None
        except (TypeError, ValueError) as err:
            raise UserError(f"recipe {origin}: step {name}: {err}") from None
        steps.append(Step(name, dict(params or {})))
    return Recipe(
        name=str(data["name"]),
        weights=weights,
        act_bits=act_bits,
        kv_bits=kv_bits,
        steps=steps,
        description=str(data.get("description", "")).strip(),
    )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bits(section: dict, default: int, key: str, origin: str) -> int:
    bits = section.get("bits", default)
    if not _is_int(bits):
        raise UserError(f"recipe {origin}: {key}.bits is a whole number, not {bits!r}")
    return bits
