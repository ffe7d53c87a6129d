"""`qoqtool info`: what a quantized or packed folder holds."""

from __future__ import annotations

from pathlib import Path

from qoqtool.cli import ui
from qoqtool.errors import UserError
from qoqtool.packing import folder as fs

# Bits a format needs per stored weight element and per group/row parameter, as packed.
_PARAM_BITS = {
    "int8_channel": lambda m: (8, 16, 0),  # (code bits, bits per row, bits per group)
    "uint4": lambda m: (4, 0, 16 + 4),  # FP16 scale + UINT4 zero per group (per-channel: one group)
    "progressive": lambda m: (4, 16, 8 + 4),  # FP16 level-0 scale per row; UINT8 scale + UINT4 zero per group
}


def format_bits(meta: dict) -> tuple[int, int]:
    """(stored weight elements including padding, total bits) of one linear as packed."""
    n, k = meta["shape"]
    g = meta.get("group_size") or k
    kp = -(-k // g) * g
    code, per_row, per_group = _PARAM_BITS[meta["kind"]](meta)
    return n * kp, n * kp * code + n * per_row + n * (kp // g) * per_group


def folder_report(path: str) -> dict:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise UserError(f"{path} is not a folder; pass a folder written by qoqtool quantize or pack")
    manifest = fs.read_manifest(folder)
    if manifest is None:
        raise UserError(f"{path} has no qoqtool.json; it was not written by qoqtool quantize or pack")
    if manifest.get("format") == "qoqtool-packed":
        from qoqtool.packing.packed import packed_report

        return packed_report(folder, manifest)
    from qoqtool.packing import quantized

    quantized.check_manifest(manifest, str(path))  # (another format, a version it cannot read, damaged entries)
    linears = manifest["linears"]
    stored = sum(format_bits(m)[0] for m in linears.values())
    bits = sum(format_bits(m)[1] for m in linears.values())
    logical = sum(m["shape"][0] * m["shape"][1] for m in linears.values())
    kinds: dict[str, int] = {}
    for m in linears.values():
        kinds[m["kind"]] = kinds.get(m["kind"], 0) + 1
    files = {f.name: f.stat().st_size for f in folder.iterdir() if f.is_file()}
    return {
        "path": str(folder),
        "format": manifest.get("format"),
        "format_version": manifest.get("format_version"),
        "source_model": manifest.get("source_model"),
        "recipe": manifest.get("recipe"),
        "calibration": manifest.get("calibration"),
        "notes": manifest.get("notes", []),
        "linears": len(linears),
        "formats": kinds,
        "quantized_weights": logical,
        "stored_weights": stored,
        "bits_per_stored_weight": bits / max(stored, 1),
        "bits_per_weight": bits / max(logical, 1),
        "outliers": manifest.get("outliers"),
        "float_weights_kept": _kept_float_weights(manifest),
        "files": files,
        "created": manifest.get("created"),
    }


def verify_files(path: str) -> dict[str, int]:
    """Read every tensor file the folder's manifest lists and check each tensor's shape, dtype
    and sha256 against it (what the loaders check of the files they read). Returns the tensors
    checked per file; a damaged or missing file is a one-line UserError."""
    folder = Path(path).expanduser()
    records = fs.read_manifest(folder)["files"]
    for name, tensors in records.items():  # the whole manifest first: its damage is not a file's
        fs.check_records(folder / name, tensors)
    checked = {}
    for name, tensors in sorted(records.items()):
        fs.load_verified(folder / name, tensors, f"{path} has no {name}, which its qoqtool.json lists; re-create the folder")
        checked[name] = len(tensors)
    return checked


def _kept_float_weights(manifest: dict) -> bool:
    """Whether a quantized folder kept its weights before rounding (--keep-float-weights)."""
    from qoqtool.packing.quantized import FLOAT_WEIGHTS_FILE

    return FLOAT_WEIGHTS_FILE in manifest.get("files", {})


def _describe_outliers(o: dict | None) -> str:
    """One line: how many outliers, from which budget, chosen where."""
    if not o:
        return "none"
    budget = o.get("budget", o)  # a quantized folder's record is the budget itself
    if budget.get("kind") == "fraction":
        asked = f"{100 * budget['value']:g}%"
    elif budget.get("kind") == "count":
        asked = f"{int(budget['value']):,}"
    else:
        asked = f"gain > {budget.get('value')}"
    where = f", chosen by {o['chosen_by']}" if o.get("chosen_by") else ""
    refit = " (grids re-fitted)" if o.get("refit") else ""
    return f"{o.get('count', 0):,} fp16 ({100 * o.get('share', 0):.3f}%; budget {asked} {budget.get('scope', '')}{where}{refit})"


def _describe_weights(w: dict) -> str:
    group = f"g{w['group_size']}" if w.get("group_size") else "per-channel"
    return f"w{w.get('bits')} {w.get('scheme')} {group}"


def print_folder_report(report: dict) -> None:
    recipe = report.get("recipe") or {}
    calib = report.get("calibration") or {}
    rows = [
        ["format", f"{report['format']} v{report['format_version']}"],
        ["source model", report.get("source_model")],
        ["recipe", recipe.get("name")],
        ["weights", _describe_weights(recipe.get("weights") or {})],
        ["activations / KV cache", f"{recipe.get('activations', {}).get('bits')} / {recipe.get('kv_cache', {}).get('bits')} bits"],
        ["steps", ", ".join(next(iter(s)) for s in recipe.get("steps", [])) or "round to nearest"],
        ["calibration", f"{calib.get('source')} {calib.get('samples')}x{calib.get('seqlen')}" if calib else "-"],
        ["quantized linears", f"{report['linears']} {report['formats']}"],
        ["outliers", _describe_outliers(report.get("outliers"))],
    ]
    if report.get("float_weights_kept"):
        rows.append(["float weights", "kept (pack --outliers can choose outliers)"])
    if "size" not in report:  # packed folders show these, with their counts, in the size table
        rows.append(["bits / stored weight", report["bits_per_stored_weight"]])
        rows.append(["bits / weight (logical)", report["bits_per_weight"]])
    for name, size in sorted(report["files"].items()):
        rows.append([f"file {name}", f"{size / 2**20:.2f} MiB"])
    if "verified" in report:
        counts = report["verified"]
        rows.append(["checksums", f"{sum(counts.values())} tensors in {len(counts)} files match the manifest (sha256)"])
    for note in report.get("notes", []):
        rows.append(["note", note])
    ui.table(report["path"], ["", "value"], rows)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def print_size_report(report: dict) -> None:
    """The folder table, then (packed folders) where the bytes go, against fp16."""
    print_folder_report(report)
    size = report.get("size")
    if not size:
        return
    lin = size["linear_bytes"]
    rows = [
        ["linear codes", _mib(lin["codes"])],
        ["linear scales + zeros", _mib(lin["scales_and_zeros"])],
        ["bits / stored weight", f"{size['bits_per_stored_weight']:.4f} ({size['stored_weights']:,} stored, K padded)"],
        ["bits / weight", f"{size['bits_per_weight']:.4f} ({size['quantized_weights']:,} weights)"],
    ]
    rows += _outlier_rows(report.get("outliers"), size)
    for k, row in size["padding_by_in_features"].items():
        if row["k_padded"] != int(k):
            share = f"+{100 * row['padding_share']:.1f}% stored weights in {row['linears']} linears"
            rows.append([f"padding K {k} -> {row['k_padded']}", share])
    ratio = size["fp16_bytes"] / size["total_bytes"]
    rows += [
        ["embeddings (fp16)", _mib(size["float_bytes"]["embeddings"])],
        ["other float tensors (fp16)", _mib(size["float_bytes"]["other"])],
        ["total tensors", _mib(size["total_bytes"])],
        ["same model in fp16", f"{_mib(size['fp16_bytes'])} ({ratio:.2f}x larger)"],
    ]
    ui.table(f"size of {report['path']}", ["", "value"], rows)


def _outlier_rows(outliers: dict | None, size: dict) -> list[list[str]]:
    """Tile-COO's cost: bits per outlier (metadata and padding included) against CSR, and
    bits per weight dense-only and dense + outliers."""
    if not outliers:
        return []
    st = outliers["storage"]
    return [
        ["outliers (Tile-COO)", f"{_mib(size['linear_bytes']['outliers'])}, {st['outliers']:,} fp16 weights "
                                f"({100 * st['share']:.3f}%)"],
        ["bits / outlier", f"{st['bits_per_outlier']:.2f} Tile-COO (padding {100 * st['padding_share']:.1f}% of slots), "
                           f"{st['csr16_bits_per_outlier']:.2f} as CSR (16-bit indices)"],
        ["bits / weight + outliers", f"{st['bits_per_weight_with_outliers']:.4f} (dense only {st['bits_per_weight_dense']:.4f}; "
                                     f"with CSR {st['bits_per_weight_with_csr16']:.4f})"],
    ]
