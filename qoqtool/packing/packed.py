"""The packed folder `qoqtool pack` writes: the deployable artifact (docs/format.md).

    config.json, tokenizer files     copied from the quantized folder
    model.safetensors                per quantized linear PREFIX: the packed buffers of
                                     `PackedLinear` (PREFIX.qweight, scales, zeros, bias, and
                                     for a linear with fp16 outliers its Tile-COO section
                                     PREFIX.tc_entries, tc_start, tc_count); every other
                                     tensor (embeddings, norms) in fp16
    calib_stats.safetensors          copied: outlier selection after the fact needs it
    qoqtool.json                     format "qoqtool-packed", version, recipe, calibration,
                                     per-linear layout, outliers, bits per weight, sha256 of
                                     every tensor

Outliers come from the quantized folder (`quantize --outliers`) or are chosen here
(`pack --outliers`, from the folder's calibration statistics and float weights).

The tensor names are the state-dict names of the model with `PackedLinear` modules, so
loading is `load_state_dict` after every check has passed.
"""

from __future__ import annotations

import hashlib
import math
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

from qoqtool.errors import UserError
from qoqtool.packing import folder as fs
from qoqtool.packing import quantized, tile_coo
from qoqtool.packing.layout import PackedLayout, check_progressive_params
from qoqtool.quantizers.outliers import OutlierBudget, SparseOutliers
from qoqtool.runtime.packed_linear import TILE_COO_BUFFERS, PackedLinear

FORMAT = "qoqtool-packed"
# 2: fp16 outliers in Tile-COO; 3: attention key shifts; 4: down_proj weights that may include
# an online input rotation; 5: the Hadamard constructions' version (docs/format.md, section 8).
# Every version is still read.
FORMAT_VERSION = 5  # docs/format.md, section 8
READABLE_VERSIONS = (1, 2, 3, 4, 5)
WEIGHTS_FILE = "model.safetensors"
STATS_FILE = quantized.STATS_FILE
# Every tensor that is not a packed weight parameter is deployed in fp16 (see fp16_rounded).
FLOAT_DTYPE = torch.float16
# Parameters of packed linears that are not codes (for the bits-per-weight accounting).
CODE_TENSORS = ("qweight",)


def fp16_rounded(t: torch.Tensor) -> torch.Tensor:
    """A float tensor as deployed: rounded to fp16, kept in its dtype.

    The quantized folder's loader applies this too, so the reference path of a quantized
    folder scores exactly what its packed folder scores (docs/format.md, "Float tensors").
    """
    return t.to(FLOAT_DTYPE).to(t.dtype) if t.is_floating_point() else t


def round_as_deployed(model) -> None:
    """Round, in place, every float tensor an in-memory quantized model saves (its parameters
    and center_keys' key shifts) as `fp16_rounded` does, so that it scores what its folder will."""
    from qoqtool.runtime.attention import KEY_SHIFT

    for p in model.parameters():
        p.data = fp16_rounded(p.data)
    for name, b in model.named_buffers():
        if name.endswith(KEY_SHIFT):
            b.data = fp16_rounded(b.data)


# -- pack -----------------------------------------------------------------------------------
def pack_folder(quantized_dir: str, out: str, outliers: OutlierBudget | None = None, overwrite: bool = False) -> dict:
    """Pack a quantized folder into `out` (atomically); returns the size report.

    outliers: choose fp16 outliers now (`pack --outliers`) for a folder quantized without
    them; a folder quantized with outliers keeps its own, packed in Tile-COO.
    """
    t0 = time.perf_counter()
    src = Path(quantized_dir).expanduser()
    manifest = _source_manifest(src, quantized_dir)
    fs.check_output_dir(out, overwrite, inputs=(quantized_dir,))
    from qoqtool.models.loading import ModelSource, load_config

    load_config(ModelSource.local(src))  # (a config the packed folder could not be opened with)
    weights, floats = quantized.load_weights(src, manifest)
    stats = quantized.load_stats(src, manifest)  # verified before it is copied
    sparse = quantized.load_outliers(src, manifest)
    t_read = time.perf_counter()
    errors: dict[str, dict] = {}
    if sparse and outliers is not None:
        raise UserError(
            f"{quantized_dir} already keeps {sum(s.nnz for s in sparse.values()):,} fp16 outliers (quantize --outliers); "
            "pack it without --outliers, or re-quantize it without them to choose them here"
        )
    if sparse:
        choice = {"chosen_by": "quantize", **(manifest.get("outliers") or {})}
    elif outliers is not None:
        weights, sparse, errors, choice = _choose_outliers(src, manifest, weights, stats, outliers)
    t_chosen = time.perf_counter()

    tensors: dict[str, torch.Tensor] = {}
    linears: dict[str, dict] = {}
    sections: dict[str, tile_coo.TileCOO] = {}
    for name, weight in weights.items():
        meta = manifest["linears"][name]
        bias = floats.pop(f"{name}.bias", None)
        module = _pack_linear(name, weight, bias, meta["act_bits"], sparse.get(name))
        tensors.update({f"{name}.{key}": t for key, t in module.state_dict().items()})
        own_errors = {k: v for k, v in meta.items() if k.endswith("_error")} | errors.get(name, {})
        linears[name] = {**module.layout.meta(), "act_bits": module.act_bits, "bias": bias is not None, **own_errors}
        if module.has_outliers:
            sections[name] = module.outlier_section()
    tensors.update({name: t.to(FLOAT_DTYPE) if t.is_floating_point() else t for name, t in floats.items()})

    records = fs.tensor_records(tensors)
    size = size_summary(linears, records)
    packed_manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": fs.now(),
        "versions": fs.versions(),
        "source_model": manifest.get("source_model"),
        "packed_from": {"path": str(src), "created": manifest.get("created"), "manifest_sha256": _manifest_sha(src)},
        "recipe": manifest["recipe"],
        "calibration": manifest.get("calibration"),
        "architecture": manifest.get("architecture"),
        "notes": manifest.get("notes", []),
        "step_log": manifest.get("step_log", []),
        "float_dtype": str(FLOAT_DTYPE).removeprefix("torch."),
        "outliers": outlier_manifest(sections, choice, size) if sparse else None,
        "linears": linears,
        "size": size,
        "files": {WEIGHTS_FILE: records, STATS_FILE: manifest["files"][STATS_FILE]},
    }
    with fs.atomic_output_dir(out, overwrite) as tmp:
        for f in src.iterdir():  # config, tokenizer files, calibration statistics
            if f.is_file() and f.name not in _NOT_COPIED:
                shutil.copy2(f, tmp / f.name)
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        fs.write_manifest(tmp, packed_manifest)
    report = packed_report(Path(out), packed_manifest)
    report["seconds"] = {"read": round(t_read - t0, 2), "choose_outliers": round(t_chosen - t_read, 2),
                         "total": round(time.perf_counter() - t0, 2)}
    return report


# Files of the quantized folder the packed folder does not copy: the codes are re-packed,
# the outliers move into model.safetensors (Tile-COO), float weights are not deployed.
_NOT_COPIED = (quantized.WEIGHTS_FILE, quantized.OUTLIERS_FILE, quantized.FLOAT_WEIGHTS_FILE, fs.MANIFEST)


def _choose_outliers(src: Path, manifest: dict, weights: dict, stats: dict, budget: OutlierBudget):
    """`pack --outliers`: choose the outliers of a folder quantized without them.

    RTN folders (no solver step) are re-fitted: every grid without its outliers, exactly
    what `quantize --outliers` would have written. GPTQ or clipped folders keep their codes
    and grids (they cannot be re-derived without the calibration data); their outliers are
    the weights with the largest own error weighted by E[x^2] (qoqtool.quantizers.outliers).
    Returns (weights, outliers, per-linear errors, the manifest's record of the choice).
    The float weights are the folder's own (`quantize --keep-float-weights`) or, for a
    recipe without transforms, the original model's (`quantized.load_float_weights`).
    """
    from qoqtool.calibration.pipeline import weight_error
    from qoqtool.calibration.steps import STEPS
    from qoqtool.quantizers.outliers import outliers_after_the_fact
    from qoqtool.recipe import recipe_from_dict

    recipe = recipe_from_dict(manifest["recipe"], check_params=False)  # (only its steps' phases are read)
    refit = not any(STEPS[s.name].phase == "solver" for s in recipe.steps)
    from_source = quantized.FLOAT_WEIGHTS_FILE not in manifest["files"] and all(
        STEPS[s.name].phase == "solver" for s in recipe.steps)
    try:
        float_weights = quantized.load_float_weights(src, manifest)
    except UserError as err:
        if not from_source:
            raise
        raise UserError(f"--outliers needs the weights before rounding, and the original model "
                        f"{manifest.get('source_model')!r} of {src} cannot be loaded ({err}); "
                        "re-quantize with --keep-float-weights") from None
    msq = {name: stats[f"{name}.act_mean_sq"] for name in weights}
    chosen = outliers_after_the_fact(weights, float_weights, msq, recipe.weights, refit, budget)
    errors, before, after = {}, [], []
    for name, (qw, sp) in chosen.items():
        st = SimpleNamespace(mean_sq=msq[name])
        before.append(weight_error(float_weights[name], weights[name], st)["output_rel_error"])
        errors[name] = {k: round(v, 6) for k, v in weight_error(float_weights[name], qw, st, sp).items()}
        after.append(errors[name]["output_rel_error"])
    count = sum(sp.nnz for _, sp in chosen.values())
    choice = {
        **budget.to_dict(),
        "chosen_by": "pack",
        "refit": refit,
        "count": count,
        "share": count / max(sum(qw.shape[0] * qw.shape[1] for qw in weights.values()), 1),
        # mean over linears, both against the same float weights (those of the folder)
        "mean_output_rel_error": {"without": sum(before) / len(before), "with": sum(after) / len(after)},
    }
    return {n: qw for n, (qw, _) in chosen.items()}, {n: sp for n, (_, sp) in chosen.items()}, errors, choice


def outlier_manifest(sections: dict[str, tile_coo.TileCOO], choice: dict, size: dict) -> dict:
    """The packed manifest's "outliers": how they were chosen, how many, what they cost."""
    per_linear = {}
    for name, tc in sections.items():
        st = tile_coo.storage(tc)
        per_linear[name] = {"nnz": st["nnz"], "entries": st["entries"], "padding_slots": st["padding_slots"], "bits": st["bits"]}
    dense_bits = 8 * sum(size["linear_bytes"][k] for k in ("codes", "scales_and_zeros"))
    storage = tile_coo.summary(sections, dense_bits, size["quantized_weights"])
    budget = {k: choice[k] for k in ("kind", "value", "scope", "quads") if k in choice}
    extra = {k: v for k, v in choice.items() if k not in budget and k not in ("count", "share")}
    return {
        "format": tile_coo.FORMAT,
        "bucket": [tile_coo.BUCKET_N, tile_coo.BUCKET_K],
        "budget": budget,
        **extra,
        "count": storage["outliers"],
        "share": storage["share"],
        "storage": storage,
        "linears": per_linear,
    }


def _source_manifest(src: Path, given: str) -> dict:
    if not src.is_dir():
        raise UserError(f"{given} is not a folder; pass a folder written by qoqtool quantize")
    manifest = fs.read_manifest(src)
    if manifest is None:
        raise UserError(f"{given} has no qoqtool.json; pass a folder written by qoqtool quantize")
    if manifest.get("format") == FORMAT:
        raise UserError(f"{given} is already packed; pass the quantized folder it came from")
    quantized.check_manifest(manifest, given)
    return manifest


def _pack_linear(name: str, weight, bias, act_bits: int, outliers: SparseOutliers | None = None) -> PackedLinear:
    """Pack one linear (and its outliers) and prove the packing lost nothing (a failure here is a bug)."""
    try:
        module = PackedLinear.pack(weight, None if bias is None else bias.to(FLOAT_DTYPE), act_bits, outliers)
    except ValueError as err:
        raise UserError(f"cannot pack {name}: {err}") from None
    back = module.unpacked()
    same = back.meta() == weight.meta() and all(
        torch.equal(a, b) for a, b in zip(back.tensors().values(), weight.tensors().values())
    )
    if not same or back.tensors().keys() != weight.tensors().keys():
        raise RuntimeError(f"packing {name} is not reversible: a bug in qoqtool.packing.layout")
    if outliers is not None:
        section = module.outlier_section()
        tile_coo.validate(section)
        back = tile_coo.decode(section)
        if not (torch.equal(back.rows, outliers.rows) and torch.equal(back.cols, outliers.cols)
                and torch.equal(back.values.view(torch.int16), outliers.values.view(torch.int16))):
            raise RuntimeError(f"the Tile-COO outliers of {name} do not decode to what was encoded: a bug in qoqtool.packing.tile_coo")
    return module


def _manifest_sha(folder: Path) -> str:
    return hashlib.sha256((folder / fs.MANIFEST).read_bytes()).hexdigest()


# -- load -----------------------------------------------------------------------------------
def check_manifest(manifest: dict, where: str) -> None:
    version = fs.check_format(manifest, where, FORMAT, FORMAT_VERSION, READABLE_VERSIONS, "re-pack it with this qoqtool")
    fs.check_entries(manifest, where, WEIGHTS_FILE, "re-pack it")
    if version == 1 and manifest.get("outliers"):
        raise UserError(f"{where}/qoqtool.json: a version 1 folder cannot hold outliers; the folder is damaged, re-pack it")


def outlier_entries(manifest: dict, where: str) -> dict[str, int]:
    """Linear name -> number of Tile-COO entries, for every linear with outliers."""
    section = manifest.get("outliers")
    if not section:
        return {}
    try:
        found = {name: int(meta["entries"]) for name, meta in section["linears"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise UserError(f"{where}/qoqtool.json: the outliers section cannot be read ({err}); re-pack the folder") from None
    for name, entries in found.items():
        if name not in manifest["linears"] or entries < 0:
            raise UserError(f"{where}/qoqtool.json: outliers listed for {name}, which is no quantized linear; re-pack the folder")
    return found


def load_packed_folder(path: str | Path, manifest: dict, device: str = "cpu",
                       dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A transformers model whose quantized linears are `PackedLinear`, every input checked.

    Float tensors are stored in fp16 and computed in `dtype` (fp32: the reference path).
    """
    from qoqtool.models.loading import ModelSource, load_config
    from qoqtool.runtime.attention import prepare_attention
    from qoqtool.runtime.loading import build_empty_model, finish_loading

    path = Path(path)
    where = str(path)
    check_manifest(manifest, where)
    config = load_config(ModelSource.local(where))
    model = build_empty_model(config, dtype)
    prepare_attention(model, manifest["recipe"])
    entries = outlier_entries(manifest, where)
    packed_names = _install_packed_linears(model, manifest["linears"], entries, where, dtype)

    file = path / WEIGHTS_FILE
    tensors = fs.load_verified(file, manifest["files"][WEIGHTS_FILE], f"{where} has no {WEIGHTS_FILE}; re-pack the folder")
    expected = {name: (t.shape, t.dtype) for name, t in model.state_dict().items()}
    for name, t in list(tensors.items()):
        if name not in expected:
            raise UserError(f"{file} holds tensor {name}, which the model of config.json does not have; re-pack it")
        shape, want = expected[name]
        if t.shape != shape or (name in packed_names and t.dtype != want):
            raise UserError(
                f"{file}: tensor {name} is {str(t.dtype).removeprefix('torch.')}{list(t.shape)}, the model of "
                f"config.json needs {str(want).removeprefix('torch.')}{list(shape)}; the folder does not match its config"
            )
        if name not in packed_names and t.is_floating_point():
            tensors[name] = t.to(dtype)
    for name in entries:
        _check_tile_coo(tensors, name, manifest["linears"][name], file)
    for name, meta in manifest["linears"].items():
        _check_group_params(tensors, name, meta, file)
    return finish_loading(model, tensors, device, manifest["recipe"])


def _check_group_params(tensors: dict[str, torch.Tensor], name: str, meta: dict, file: Path) -> None:
    """What the kernels assume of a progressive linear's group parameters (layout.check_progressive_params),
    checked before the kernels read them: values outside it would be silently wrong sums."""
    scale1, zs1 = tensors.get(f"{name}.scale1"), tensors.get(f"{name}.zero_x_scale1")
    if meta.get("kind") != "progressive" or scale1 is None or zs1 is None:
        return  # (a missing tensor is reported by finish_loading)
    try:
        check_progressive_params(scale1, zs1)
    except ValueError as err:
        raise UserError(f"{file}: the group parameters of {name} are damaged ({err}); re-pack the folder") from None


def _check_tile_coo(tensors: dict[str, torch.Tensor], name: str, meta: dict, file: Path) -> None:
    """Validate (and decode) one linear's Tile-COO section before anything indexes with it:
    offsets and indices are data, and a damaged file must not become an out-of-bounds read."""
    own = [tensors.get(f"{name}.{key}") for key in TILE_COO_BUFFERS]
    if any(t is None for t in own):
        return  # reported as a missing tensor by finish_loading
    layout = PackedLayout.from_meta(meta)
    section = tile_coo.TileCOO(*own, (layout.out_features, layout.in_features), layout.k_padded)
    try:
        tile_coo.decode(section)  # validates every offset and index, then maps them back
    except ValueError as err:
        raise UserError(f"{file}: the Tile-COO outliers of {name} are damaged ({err}); re-pack the folder") from None


def _install_packed_linears(model, linears: dict[str, dict], entries: dict[str, int], where: str,
                            dtype: torch.dtype) -> set[str]:
    """Replace each listed nn.Linear by an empty PackedLinear (with a Tile-COO section of
    entries[name] entries if it has outliers); returns the packed tensor names."""
    names = set()
    for name, meta in linears.items():
        try:
            layout = PackedLayout.from_meta(meta)
            act_bits = int(meta["act_bits"])
            current = model.get_submodule(name)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise UserError(f"{where}/qoqtool.json: linear {name} cannot be read ({err}); re-pack the folder") from None
        if not isinstance(current, torch.nn.Linear):
            raise UserError(f"{where}: {name} is not a linear layer of the model in config.json; re-pack the folder")
        have = (current.out_features, current.in_features)
        if have != (layout.out_features, layout.in_features):
            raise UserError(
                f"{where}: {name} is {layout.out_features}x{layout.in_features} in qoqtool.json but "
                f"{have[0]}x{have[1]} in config.json; the config does not belong to these weights"
            )
        module = PackedLinear.empty(layout, act_bits, dtype if meta.get("bias") else None, entries.get(name))
        parent_name, attr = name.rsplit(".", 1)
        setattr(model.get_submodule(parent_name), attr, module)
        names.update(f"{name}.{key}" for key in PackedLinear.spec_of(layout, entries.get(name)))
    return names


# -- size report ----------------------------------------------------------------------------
def _numel(rec: dict) -> int:
    return math.prod(rec["shape"])


def _nbytes(rec: dict) -> int:
    return _numel(rec) * getattr(torch, rec["dtype"]).itemsize


def size_summary(linears: dict[str, dict], records: dict[str, dict]) -> dict:
    """Bytes and bits per weight, counted from the stored tensors' records themselves.

    Stored weights are N_padded x K_padded per linear (padding is stored, so it counts);
    logical weights are N x K. Bits per weight count codes, scales and zeros (not biases);
    `bits_per_weight_with_outliers` adds the Tile-COO sections (entries and bucket arrays).
    """
    by_linear: dict[str, dict[str, dict]] = {}
    floats: dict[str, dict] = {}
    for key, rec in records.items():
        prefix, _, leaf = key.rpartition(".")
        if prefix in linears and leaf != "bias":
            by_linear.setdefault(prefix, {})[leaf] = rec
        else:
            floats[key] = rec  # embeddings, norms, biases: stored fp16, not quantized
    codes = sum(_nbytes(own[k]) for own in by_linear.values() for k in own if k in CODE_TENSORS)
    sparse = sum(_nbytes(own[k]) for own in by_linear.values() for k in own if k in TILE_COO_BUFFERS)
    params = sum(_nbytes(own[k]) for own in by_linear.values() for k in own if k not in CODE_TENSORS + TILE_COO_BUFFERS)
    by_k: dict[int, dict] = {}
    for meta in linears.values():
        (n, k), stored = meta["shape"], meta["n_padded"] * meta["k_padded"]
        row = by_k.setdefault(k, {"k_padded": meta["k_padded"], "linears": 0, "logical_weights": 0, "stored_weights": 0})
        row["linears"] += 1
        row["logical_weights"] += n * k
        row["stored_weights"] += stored
    for row in by_k.values():
        row["padding_share"] = row["stored_weights"] / row["logical_weights"] - 1
    logical = sum(r["logical_weights"] for r in by_k.values())
    stored = sum(r["stored_weights"] for r in by_k.values())
    embed = sum(_nbytes(r) for key, r in floats.items() if "embed_tokens" in key or key.startswith("lm_head."))
    other = sum(_nbytes(r) for r in floats.values()) - embed
    return {
        "quantized_weights": logical,
        "stored_weights": stored,
        "linear_bytes": {"codes": codes, "scales_and_zeros": params, "outliers": sparse},
        "bits_per_stored_weight": 8 * (codes + params) / max(stored, 1),
        "bits_per_weight": 8 * (codes + params) / max(logical, 1),
        "bits_per_weight_with_outliers": 8 * (codes + params + sparse) / max(logical, 1),
        "padding_by_in_features": {str(k): v for k, v in sorted(by_k.items())},
        "float_bytes": {"embeddings": embed, "other": other},
        "total_bytes": codes + params + sparse + embed + other,
        # The same tensors all in fp16 (the model after its transforms: a rotated model has
        # an untied lm_head; tied embeddings are counted once, as they are stored).
        "fp16_bytes": 2 * (logical + sum(_numel(r) for r in floats.values())),
    }


def packed_report(folder: str | Path, manifest: dict) -> dict:
    """What `qoqtool info` and `qoqtool pack` print for a packed folder."""
    folder = Path(folder)
    check_manifest(manifest, str(folder))
    linears = manifest["linears"]
    size = size_summary(linears, manifest["files"][WEIGHTS_FILE])
    kinds: dict[str, int] = {}
    for meta in linears.values():
        key = f"{meta['kind']} g{meta['group_size']}" if meta.get("group_size") else f"{meta['kind']} per-channel"
        kinds[key] = kinds.get(key, 0) + 1
    files = {f.name: f.stat().st_size for f in folder.iterdir() if f.is_file()}
    return {
        "path": str(folder),
        "format": manifest["format"],
        "format_version": manifest["format_version"],
        "source_model": manifest.get("source_model"),
        "recipe": manifest["recipe"],
        "calibration": manifest.get("calibration"),
        "notes": manifest.get("notes", []),
        "linears": len(linears),
        "formats": kinds,
        "quantized_weights": size["quantized_weights"],
        "stored_weights": size["stored_weights"],
        "bits_per_stored_weight": size["bits_per_stored_weight"],
        "bits_per_weight": size["bits_per_weight"],
        "outliers": manifest.get("outliers"),
        "size": size,
        "files": files,
        "created": manifest.get("created"),
    }
