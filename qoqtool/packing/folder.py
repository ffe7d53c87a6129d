"""Output folders: atomic writes, the manifest, checksums and safetensors validation.

Every folder qoqtool writes (quantized or packed) is built in a hidden temporary folder
beside the target and renamed into place when complete, so an interrupted run leaves
nothing half-written. An existing target is replaced only with `overwrite=True`.

The manifest `qoqtool.json` names the folder's format and version, the recipe, the
calibration, and the sha256 of every tensor, so a loader can refuse what it does not
understand or what was damaged.
"""

from __future__ import annotations

import datetime as _dt
import glob
import hashlib
import json
import os
import shutil
import struct
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import torch

from qoqtool import __version__
from qoqtool.errors import UserError

MANIFEST = "qoqtool.json"


def check_writable(path: Path, what: str, folder: bool) -> None:
    """A one-line UserError now, not after the run, when `path` (a file or, folder=True, a folder
    to create or replace) could not be written: a folder there (for a file), a file where a
    folder should be, or a first existing ancestor that is not a writable folder."""
    if path.is_dir() and not folder:
        raise UserError(f"{what} is a folder; name a file")
    ancestor = path.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UserError(f"{what}: {ancestor} is a file, not a folder; choose another path")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UserError(f"{what}: {ancestor} is not writable; choose another path")


def check_output_dir(out: str | os.PathLike, overwrite: bool, inputs=()) -> Path:
    """Fail early (before any work) if `out` exists and may not be replaced, or if it is or
    holds one of `inputs` (paths read by the run; names that are not local paths, such as hub
    ids, are ignored): replacing it would delete what the run reads."""
    if not str(out).strip():
        raise UserError("-o is empty; name the output folder, or leave -o out for the default name")
    path = Path(out).expanduser()
    resolved = path.resolve()
    if resolved in (Path.cwd(), *Path.cwd().parents):
        raise UserError(f"the output {out} is the current folder or one above it; choose another output folder")
    for name in inputs:
        source = Path(name).expanduser().resolve()
        if name and source.exists() and resolved in (source, *source.parents):
            raise UserError(f"the output {out} is or holds the input {name}; choose another output folder")
    if path.exists() and not overwrite:
        raise UserError(f"output {out} already exists; pass --overwrite to replace it or choose another folder")
    if path.exists() and not path.is_dir():
        raise UserError(f"output {out} exists and is not a folder")
    check_writable(path, f"output {out}", folder=True)
    return path


@contextmanager
def atomic_output_dir(out: str | os.PathLike, overwrite: bool):
    """Yield a temporary folder; on success it replaces `out`, on failure it is removed."""
    target = check_output_dir(out, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(target)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(target, old)
    os.replace(tmp, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


STALE_SECONDS = 3600


def _remove_stale(target: Path) -> None:
    """The temporary folders of earlier runs into `target` that were killed while writing
    (SIGKILL, a power cut: nothing could clean up), untouched for an hour - a run writes its
    folder in minutes, so none of these is still being written."""
    now = time.time()
    for stale in target.parent.glob(f".{glob.escape(target.name)}.*-*"):
        if stale.is_dir() and stale.name.rsplit("-", 1)[0].endswith((".tmp", ".old")) and now - stale.stat().st_mtime > STALE_SECONDS:
            shutil.rmtree(stale, ignore_errors=True)


def tensor_sha256(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


def versions() -> dict:
    import transformers

    return {"qoqtool": __version__, "torch": torch.__version__, "transformers": transformers.__version__}


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def write_manifest(folder: Path, manifest: dict) -> None:
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=False) + "\n")


def check_format(manifest: dict, where: str, fmt: str, current: int, readable: tuple[int, ...], redo: str) -> int:
    """The manifest's format version, after checking that it names `fmt` and a version this
    qoqtool reads; a one-line UserError otherwise (newer versions: upgrade; older unreadable
    ones: `redo`, e.g. "re-pack it with this qoqtool")."""
    if manifest.get("format") != fmt:
        raise UserError(f"{where} is a {manifest.get('format')!r} folder, not {fmt!r}")
    version = manifest.get("format_version")
    if version not in readable:
        newer = isinstance(version, int) and version > current
        fix = "upgrade qoqtool" if newer else redo
        raise UserError(f"{where} has {fmt} format version {version!r}; this qoqtool reads versions "
                        f"{', '.join(map(str, readable))} ({fix})")
    return version


def check_entries(manifest: dict, where: str, weights_file: str, redo: str) -> None:
    """The manifest entries every loader reads, of the types it reads them as (recipe, linears,
    files: mappings; each linear's record a mapping; checksums for `weights_file`): a one-line
    UserError naming the entry, instead of a loader's AttributeError."""
    for key in ("recipe", "linears", "files"):
        if not isinstance(manifest.get(key), dict):
            got = "no" if key not in manifest else f"a {type(manifest[key]).__name__} as its"
            raise UserError(f"{where}/qoqtool.json has {got} {key!r} entry (a mapping is expected); the folder is damaged, {redo}")
    bad = next((name for name, meta in manifest["linears"].items() if not isinstance(meta, dict)), None)
    if bad is not None:
        raise UserError(f"{where}/qoqtool.json: the record of linear {bad} is not a mapping; the folder is damaged, {redo}")
    if not isinstance(manifest["files"].get(weights_file), dict):
        raise UserError(f"{where}/qoqtool.json lists no checksums for {weights_file}; the folder is damaged, {redo}")


def read_manifest(folder: str | os.PathLike) -> dict | None:
    """The folder's manifest, or None if it is not a qoqtool folder."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{path} is not valid JSON ({getattr(err, 'msg', None) or err.reason}); "
                        "the folder is damaged, re-create it") from None
    if not isinstance(manifest, dict):
        raise UserError(f"{path} is not a JSON object; the folder is damaged, re-create it")
    return manifest


def check_safetensors(path: str | os.PathLike) -> None:
    """Validate a safetensors file's header against its size without reading the data.

    Catches truncated and corrupt files with a one-line error, before any loader does.
    """
    path = Path(path)
    size = path.stat().st_size
    problem = None
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            problem = "shorter than a header"
        else:
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100_000_000:
                problem = "header length runs past the end"
            else:
                try:
                    header = json.loads(fh.read(n))
                    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
                    if 8 + n + end != size:
                        problem = f"expected {8 + n + end} bytes, found {size}"
                except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, IndexError, AttributeError):
                    problem = "header is not valid"
    if problem:
        raise UserError(f"{path} is truncated or corrupt ({problem}); re-create or re-download it")


def load_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from safetensors import SafetensorError

    check_safetensors(path)
    try:
        return load_file(str(path))
    except SafetensorError as err:  # a header that fits the file's size but not its data (dtype, shape)
        raise UserError(f"{path} is corrupt ({str(err).splitlines()[0]}); re-create or re-download it") from None


def check_records(path: str | os.PathLike, records) -> None:
    """The manifest's checksums for the tensor file `path` are tensor records ({dtype, shape,
    sha256} per tensor): a one-line UserError blaming the manifest, before the file is read."""
    path = Path(path)
    sound = path.name.endswith(".safetensors") and isinstance(records, dict) and all(
        isinstance(r, dict) and {"dtype", "shape", "sha256"} <= r.keys() for r in records.values())
    if not sound:
        raise UserError(f"{path.parent}/{MANIFEST}: the checksums listed for {path.name} are not tensor records; "
                        "the manifest is damaged, re-create the folder")


def load_verified(path: str | os.PathLike, records: dict[str, dict], missing: str) -> dict[str, torch.Tensor]:
    """A safetensors file the manifest lists, read and checked against its records;
    `missing` is the one-line error when the file is not there."""
    check_records(path, records)
    if not Path(path).is_file():
        raise UserError(missing)
    tensors = load_tensors(path)
    verify_checksums(tensors, records, str(path))
    return tensors


def verify_checksums(tensors: dict[str, torch.Tensor], expected: dict[str, dict], where: str) -> None:
    """Compare each tensor's sha256 (and shape, dtype) with the manifest's record."""
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise UserError(f"{where} is missing tensor {missing[0]} (and {len(missing) - 1} more); re-create the folder")
    for name, rec in expected.items():
        t = tensors[name]
        if list(t.shape) != rec["shape"] or str(t.dtype).removeprefix("torch.") != rec["dtype"]:
            raise UserError(
                f"{where}: tensor {name} is {str(t.dtype).removeprefix('torch.')}{list(t.shape)}, "
                f"the manifest says {rec['dtype']}{rec['shape']}; re-create the folder"
            )
        if tensor_sha256(t) != rec["sha256"]:
            raise UserError(f"{where}: tensor {name} fails its sha256 checksum (damaged file); re-create the folder")


def tensor_records(tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    return {
        name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "sha256": tensor_sha256(t)}
        for name, t in sorted(tensors.items())
    }
