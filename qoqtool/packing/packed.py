"""The packed folder `qoqtool pack` writes: the deployable artifact (docs/format.md).

    config.json, tokenizer files     copied from the quantized folder
    model.safetensors                per quantized linear PREFIX: the packed buffers of
                                     `PackedLinear` (PREFIX.qweight, scales, zeros, bias);
                                     every other tensor (embeddings, norms) in fp16
    calib_stats.safetensors          copied: outlier selection after the fact needs it
    qoqtool.json                     format "qoqtool-packed", version, recipe, calibration,
                                     per-linear layout, bits per weight, sha256 of every tensor

The tensor names are the state-dict names of the model with `PackedLinear` modules, so
loading is `load_state_dict` after every check has passed.
"""

from __future__ import annotations

import hashlib
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from qoqtool.errors import UserError
from qoqtool.packing import folder as fs
from qoqtool.packing import quantized
from qoqtool.packing.layout import PackedLayout
from qoqtool.runtime.packed_linear import PackedLinear

FORMAT = "qoqtool-packed"
FORMAT_VERSION = 1
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


# -- pack -----------------------------------------------------------------------------------
def pack_folder(quantized_dir: str, out: str, outliers: str | None = None, overwrite: bool = False) -> dict:
    """Pack a quantized folder into `out` (atomically); returns the size report."""
    if outliers is not None:
        raise UserError("--outliers is not yet supported (fp16 outliers come with the Tile-COO issue); pack without it")
    src = Path(quantized_dir).expanduser()
    manifest = _source_manifest(src, quantized_dir)
    target = fs.check_output_dir(out, overwrite)
    if target.resolve() == src.resolve():
        raise UserError(f"the output {out} is the quantized folder itself; choose another output folder")
    weights, floats = quantized.load_weights(src, manifest)
    quantized.load_stats(src, manifest)  # verified before it is copied

    tensors: dict[str, torch.Tensor] = {}
    linears: dict[str, dict] = {}
    for name, weight in weights.items():
        meta = manifest["linears"][name]
        bias = floats.pop(f"{name}.bias", None)
        module = _pack_linear(name, weight, bias, meta["act_bits"])
        tensors.update({f"{name}.{key}": t for key, t in module.state_dict().items()})
        errors = {k: v for k, v in meta.items() if k.endswith("_error")}
        linears[name] = {**module.layout.meta(), "act_bits": module.act_bits, "bias": bias is not None, **errors}
    tensors.update({name: t.to(FLOAT_DTYPE) if t.is_floating_point() else t for name, t in floats.items()})

    records = fs.tensor_records(tensors)
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
        "outliers": None,
        "linears": linears,
        "size": size_summary(linears, records),
        "files": {WEIGHTS_FILE: records, STATS_FILE: manifest["files"][STATS_FILE]},
    }
    with fs.atomic_output_dir(out, overwrite) as tmp:
        for f in src.iterdir():  # config, tokenizer files, calibration statistics
            if f.is_file() and f.name not in (quantized.WEIGHTS_FILE, fs.MANIFEST):
                shutil.copy2(f, tmp / f.name)
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        fs.write_manifest(tmp, packed_manifest)
    return packed_report(Path(out), packed_manifest)


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


def _pack_linear(name: str, weight, bias, act_bits: int) -> PackedLinear:
    """Pack one linear and prove the packing lost nothing (a failure here is a bug)."""
    try:
        module = PackedLinear.pack(weight, None if bias is None else bias.to(FLOAT_DTYPE), act_bits)
    except ValueError as err:
        raise UserError(f"cannot pack {name}: {err}") from None
    back = module.unpacked()
    same = back.meta() == weight.meta() and all(
        torch.equal(a, b) for a, b in zip(back.tensors().values(), weight.tensors().values())
    )
    if not same or back.tensors().keys() != weight.tensors().keys():
        raise RuntimeError(f"packing {name} is not reversible: a bug in qoqtool.packing.layout")
    return module


def _manifest_sha(folder: Path) -> str:
    return hashlib.sha256((folder / fs.MANIFEST).read_bytes()).hexdigest()


# -- load -----------------------------------------------------------------------------------
def check_manifest(manifest: dict, where: str) -> None:
    if manifest.get("format") != FORMAT:
        raise UserError(f"{where} is a {manifest.get('format')!r} folder, not {FORMAT!r}")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        newer = isinstance(version, int) and version > FORMAT_VERSION
        fix = "upgrade qoqtool" if newer else "re-pack it with this qoqtool"
        raise UserError(f"{where} has packed format version {version}; this qoqtool reads version {FORMAT_VERSION} ({fix})")
    for key in ("recipe", "linears", "files"):
        if key not in manifest:
            raise UserError(f"{where}/qoqtool.json has no {key!r} entry; the folder is damaged, re-pack it")
    if WEIGHTS_FILE not in manifest["files"]:
        raise UserError(f"{where}/qoqtool.json lists no checksums for {WEIGHTS_FILE}; the folder is damaged, re-pack it")


def load_packed_folder(path: str | Path, manifest: dict, device: str = "cpu",
                       dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A transformers model whose quantized linears are `PackedLinear`, every input checked.

    Float tensors are stored in fp16 and computed in `dtype` (fp32: the reference path).
    """
    from transformers import AutoConfig

    from qoqtool.runtime.attention import enable_kv_quantization
    from qoqtool.runtime.loading import build_empty_model, finish_loading

    path = Path(path)
    where = str(path)
    check_manifest(manifest, where)
    config = AutoConfig.from_pretrained(path)
    model = build_empty_model(config, dtype)
    packed_names = _install_packed_linears(model, manifest["linears"], where, dtype)

    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise UserError(f"{where} has no {WEIGHTS_FILE}; re-pack the folder")
    tensors = fs.load_tensors(file)
    fs.verify_checksums(tensors, manifest["files"][WEIGHTS_FILE], str(file))
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
    model = finish_loading(model, tensors, device)
    enable_kv_quantization(model, int(manifest["recipe"]["kv_cache"]["bits"]))
    return model


def _install_packed_linears(model, linears: dict[str, dict], where: str, dtype: torch.dtype) -> set[str]:
    """Replace each listed nn.Linear by an empty PackedLinear; returns the packed tensor names."""
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
        module = PackedLinear.empty(layout, act_bits, dtype if meta.get("bias") else None)
        parent_name, attr = name.rsplit(".", 1)
        setattr(model.get_submodule(parent_name), attr, module)
        names.update(f"{name}.{key}" for key in layout.spec())
    return names


# -- size report ----------------------------------------------------------------------------
def _numel(rec: dict) -> int:
    return math.prod(rec["shape"])


def _nbytes(rec: dict) -> int:
    return _numel(rec) * getattr(torch, rec["dtype"]).itemsize


def size_summary(linears: dict[str, dict], records: dict[str, dict]) -> dict:
    """Bytes and bits per weight, counted from the stored tensors' records themselves.

    Stored weights are N_padded x K_padded per linear (padding is stored, so it counts);
    logical weights are N x K. Bits per weight count codes, scales and zeros (not biases).
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
    params = sum(_nbytes(own[k]) for own in by_linear.values() for k in own if k not in CODE_TENSORS)
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
        "linear_bytes": {"codes": codes, "scales_and_zeros": params},
        "bits_per_stored_weight": 8 * (codes + params) / max(stored, 1),
        "bits_per_weight": 8 * (codes + params) / max(logical, 1),
        "padding_by_in_features": {str(k): v for k, v in sorted(by_k.items())},
        "float_bytes": {"embeddings": embed, "other": other},
        "total_bytes": codes + params + embed + other,
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
        "size": size,
        "files": files,
        "created": manifest.get("created"),
    }
