"""The folder `qoqtool quantize` writes: unpacked integer codes, ready to pack or evaluate.

    config.json, tokenizer files     the (transformed) model's Hugging Face config
    model.safetensors                float tensors (embeddings, norms, lm_head, biases) and,
                                     per quantized linear PREFIX: PREFIX.codes (one code a
                                     byte, [N, K_padded]) and the format's scales/zeros
    calib_stats.safetensors          per linear input: PREFIX.act_mean_sq, PREFIX.act_absmax
    outliers.safetensors             only after `quantize --outliers`: per linear with outliers
                                     PREFIX.outlier_rows, PREFIX.outlier_cols (int32, natural
                                     [N, K] coordinates, sorted) and PREFIX.outlier_values (fp16
                                     residuals over the dense codes); the manifest's "outliers"
                                     names the budget
    float_weights.safetensors        only when asked (keep_float_weights): PREFIX.weight, the
                                     fp16 weight before rounding, as transformed, which
                                     `pack --outliers` needs for recipes with transforms
    qoqtool.json                     manifest: format "qoqtool-quantized", version, recipe,
                                     calibration (source, hash), per-linear format and errors,
                                     sha256 of every tensor

Codes are kept one per byte here on purpose: this folder is the inspectable intermediate;
`qoqtool pack` produces the compact kernel layout.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from qoqtool.errors import UserError
from qoqtool.packing import folder as fs
from qoqtool.quantizers.formats import QuantizedWeight

FORMAT = "qoqtool-quantized"
# 2: may hold attention key shifts (center_keys); 3: down_proj rotated online; 4: the rotate
# step names its Hadamard constructions (`hadamard`; none: version 1)
FORMAT_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
WEIGHTS_FILE = "model.safetensors"
STATS_FILE = "calib_stats.safetensors"
OUTLIERS_FILE = "outliers.safetensors"
FLOAT_WEIGHTS_FILE = "float_weights.safetensors"


def model_tensors(model) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Split a quantized model into stored tensors and per-linear format metadata."""
    from qoqtool.runtime.reference import QuantLinear

    tensors: dict[str, torch.Tensor] = {}
    linears: dict[str, dict] = {}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            for key, value in module.qweight.tensors().items():
                tensors[f"{name}.{key}"] = value.detach().contiguous().cpu()
            linears[name] = {**module.qweight.meta(), "act_bits": module.act_bits}
    for name, value in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue  # shared with the embeddings; the config re-ties them on load
        tensors[name] = value.detach().contiguous().cpu()
    return tensors, linears


def save(result, tokenizer, out: str, source: str, calibration: dict, overwrite: bool = False) -> Path:
    """Write a QuantizeResult to `out` atomically; returns the final path."""
    model = result.model
    tensors, linears = model_tensors(model)
    for name, report in result.layer_report.items():
        linears[name].update({k: round(v, 6) for k, v in report.items()})
    stats = {}
    for name, st in result.input_stats.items():
        stats[f"{name}.act_mean_sq"] = st.mean_sq.contiguous().cpu()
        stats[f"{name}.act_absmax"] = st.absmax.float().cpu().clone()  # q/k/v share one
    sparse = outlier_tensors(model)
    floats = {f"{name}.weight": w.contiguous() for name, w in (getattr(result, "float_weights", None) or {}).items()}
    extra = {OUTLIERS_FILE: sparse, FLOAT_WEIGHTS_FILE: floats}
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": fs.now(),
        "versions": fs.versions(),
        "source_model": source,
        "recipe": result.recipe.to_dict(),
        "calibration": calibration,
        "architecture": (model.config.architectures or [type(model).__name__])[0],
        "notes": list(result.notes),
        "step_log": list(result.step_log),
        "seconds": round(result.seconds, 1),
        "linears": linears,
        "files": {WEIGHTS_FILE: fs.tensor_records(tensors), STATS_FILE: fs.tensor_records(stats)},
    }
    if sparse:
        manifest["outliers"] = getattr(result, "outliers", None) or {}
    manifest["files"].update({f: fs.tensor_records(t) for f, t in extra.items() if t})
    with fs.atomic_output_dir(out, overwrite) as tmp:
        model.config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        save_file(stats, str(tmp / STATS_FILE), metadata={"format": "pt"})
        for filename, t in extra.items():
            if t:
                save_file(t, str(tmp / filename), metadata={"format": "pt"})
        fs.write_manifest(tmp, manifest)
    return Path(out)


def check_manifest(manifest: dict, where: str) -> None:
    fs.check_format(manifest, where, FORMAT, FORMAT_VERSION, READABLE_VERSIONS, "re-quantize it with this qoqtool")
    fs.check_entries(manifest, where, WEIGHTS_FILE, "re-quantize it")


def load_weights(folder: str | Path, manifest: dict) -> tuple[dict[str, QuantizedWeight], dict[str, torch.Tensor]]:
    """Read the folder's tensors, verify them, and rebuild the quantized weights.

    Returns (quantized weights by linear name, remaining float tensors by state-dict name).
    """
    folder = Path(folder)
    tensors = fs.load_verified(folder / WEIGHTS_FILE, manifest["files"][WEIGHTS_FILE],
                               f"{folder} has no {WEIGHTS_FILE}; re-create the folder")
    weights = {}
    for name, meta in manifest["linears"].items():
        prefix = f"{name}."
        own = {k[len(prefix) :]: tensors.pop(k) for k in list(tensors) if k.startswith(prefix) and k[len(prefix) :] != "bias"}
        weights[name] = QuantizedWeight.from_tensors(meta, own)
    return weights, tensors


def load_stats(folder: str | Path, manifest: dict) -> dict[str, torch.Tensor]:
    return fs.load_verified(Path(folder) / STATS_FILE, manifest["files"][STATS_FILE],
                            f"{folder} has no {STATS_FILE}; re-run qoqtool quantize")


def outlier_tensors(model) -> dict[str, torch.Tensor]:
    """PREFIX.outlier_rows/cols/values of every QuantLinear that keeps outliers."""
    from qoqtool.runtime.reference import QuantLinear

    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear) and getattr(module, "outliers", None) is not None:
            for key, value in module.outliers.tensors().items():
                tensors[f"{name}.{key}"] = value.detach().contiguous().cpu()
    return tensors


def load_outliers(folder: str | Path, manifest: dict) -> dict:
    """The SparseOutliers of each linear that has them ({} for a folder without outliers)."""
    from qoqtool.quantizers.outliers import SparseOutliers

    if OUTLIERS_FILE not in manifest.get("files", {}):
        return {}
    path = Path(folder) / OUTLIERS_FILE
    tensors = fs.load_verified(path, manifest["files"][OUTLIERS_FILE],
                               f"{folder} has no {OUTLIERS_FILE} though its manifest lists it; re-create the folder")
    found = {}
    for name, meta in manifest["linears"].items():
        own = {k: tensors[f"{name}.{k}"] for k in ("outlier_rows", "outlier_cols", "outlier_values") if f"{name}.{k}" in tensors}
        if own:
            try:
                found[name] = SparseOutliers.from_tensors(own, meta["shape"])
            except (KeyError, ValueError) as err:
                raise UserError(f"{path}: the outliers of {name} are damaged ({err}); re-create the folder") from None
    return found


def load_float_weights(folder: str | Path, manifest: dict) -> dict[str, torch.Tensor]:
    """Every quantized linear's weight before rounding, as transformed.

    From float_weights.safetensors when the folder kept them; otherwise, when the recipe
    has no transforms (only solver steps such as GPTQ or clipping, or none), they are the
    original model's weights, loaded from `source_model`.
    """
    from qoqtool.calibration.steps import STEPS

    if FLOAT_WEIGHTS_FILE in manifest.get("files", {}):
        tensors = fs.load_verified(Path(folder) / FLOAT_WEIGHTS_FILE, manifest["files"][FLOAT_WEIGHTS_FILE],
                                   f"{folder} has no {FLOAT_WEIGHTS_FILE} though its manifest lists it; re-create the folder")
        return {name: tensors[f"{name}.weight"] for name in manifest["linears"]}
    steps = [next(iter(step)) for step in manifest.get("recipe", {}).get("steps", [])]
    transforms = [s for s in steps if s not in STEPS or STEPS[s].phase != "solver"]
    if transforms:
        raise UserError(
            f"{folder} was quantized with transforms ({', '.join(transforms)}) and did not keep its float weights; "
            "quantize with --outliers, or re-quantize with --keep-float-weights"
        )
    from qoqtool.models.loading import load_model

    model, _, _ = load_model(manifest["source_model"], dtype="float32", device="cpu")
    return {name: model.get_submodule(name).weight.data for name in manifest["linears"]}
