"""Text for calibration and evaluation: WikiText-2, Pile validation, local files.

Hub data sets load through `datasets`. Offline, `--data-dir DIR` (or QOQTOOL_DATA_DIR)
points at local copies laid out like this:

    DIR/wikitext-2-raw/wiki.test.raw     WikiText-2 raw v1 test split (evaluation)
    DIR/wikitext-2-raw/wiki.valid.raw    validation split (calibration)
    DIR/pile/val.jsonl                   Pile validation, one {"text": ...} per line
    DIR/piqa/valid.jsonl, valid-labels.lst
    DIR/arc/ARC-{Easy,Challenge}-{test,validation,train}.jsonl

The WikiText-2 text is rebuilt exactly as the Hugging Face `wikitext-2-raw-v1` rows: the
file's lines, a blank line becoming "", the others keeping their "\\n", joined with "\\n\\n"
(the GPTQ/AWQ/QoQ perplexity protocol).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from qoqtool.errors import UserError

DATA_DIR_ENV = "QOQTOOL_DATA_DIR"

WIKITEXT_FILES = {"test": "wikitext-2-raw/wiki.test.raw", "validation": "wikitext-2-raw/wiki.valid.raw"}
PILE_FILE = "pile/val.jsonl"


def data_dir(explicit: str | os.PathLike | None) -> Path | None:
    """The local data folder: --data-dir, else $QOQTOOL_DATA_DIR, else None (use the hub)."""
    chosen = explicit if explicit else os.environ.get(DATA_DIR_ENV) or None
    if chosen is None:
        return None
    path = Path(chosen).expanduser()
    if not path.is_dir():
        raise UserError(f"--data-dir {chosen} is not a folder; point it at a copy laid out like shared/data")
    return path


def require_file(root: Path, relative: str, what: str) -> Path:
    path = root / relative
    if not path.is_file():
        raise UserError(f"--data-dir {root} has no {relative}; it must hold {what} there")
    return path


def wikitext_rows_from_raw(raw: str) -> list[str]:
    """The Hugging Face rows of a wikitext raw file: its lines, blank lines as ""."""
    return ["" if line.strip() == "" else line for line in raw.splitlines(keepends=True)]


def wikitext2_text(split: str, root: Path | None) -> str:
    """WikiText-2 raw v1 `split` ("test" or "validation") joined with "\\n\\n"."""
    if root is not None:
        path = require_file(root, WIKITEXT_FILES[split], f"the WikiText-2 raw {split} split")
        rows = wikitext_rows_from_raw(read_utf8(path))
    else:
        rows = _hub_rows("wikitext", "wikitext-2-raw-v1", split, "text")
    return "\n\n".join(rows)


def pile_documents(root: Path | None, limit_chars: int) -> list[str]:
    """Pile validation documents (mit-han-lab/pile-val-backup), at most `limit_chars` in all."""
    if root is not None:
        path = require_file(root, PILE_FILE, 'Pile validation as JSON lines with a "text" field')
        return _jsonl_texts(path, limit_chars)
    docs, total = [], 0
    for text in _hub_rows("mit-han-lab/pile-val-backup", None, "validation", "text"):
        docs.append(text)
        total += len(text)
        if total >= limit_chars:
            break
    return docs


def local_texts(path: Path, limit_chars: int) -> list[str]:
    """A local calibration file: .txt (one document) or .jsonl with a "text" field."""
    check_local_suffix(path)
    if path.suffix == ".jsonl":
        return _jsonl_texts(path, limit_chars)
    return [read_utf8(path)[: max(limit_chars, 1)]]


def read_utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise _not_utf8(path, err) from None


def _not_utf8(path: Path, err: UnicodeDecodeError) -> UserError:
    return UserError(f"{path} is not UTF-8 text (byte {err.start}: {err.reason}); convert it to UTF-8")


def check_local_suffix(path: Path) -> None:
    if path.suffix not in (".txt", ".jsonl"):
        raise UserError(f"calibration file {path} must be .txt or .jsonl (with a \"text\" field)")


def _utf8_lines(path: Path, fh):
    """(line number, line) of a text file opened as UTF-8, a one-line UserError at a bad byte."""
    try:
        yield from enumerate(fh, 1)
    except UnicodeDecodeError as err:
        raise _not_utf8(path, err) from None


def _jsonl_texts(path: Path, limit_chars: int) -> list[str]:
    docs, total = [], 0
    with path.open(encoding="utf-8") as fh:
        for lineno, line in _utf8_lines(path, fh):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise UserError(f'{path}:{lineno} is not a JSON object with a "text" field') from None
            if not isinstance(text, str):
                raise UserError(f'{path}:{lineno}: "text" is {type(text).__name__}, not a string; make it the document\'s text')
            docs.append(text)
            total += len(text)
            if total >= limit_chars:
                break
    if not docs:
        raise UserError(f"{path} holds no text")
    return docs


def require_hub(name: str) -> None:
    """A one-line UserError unless `name` can be downloaded: `datasets` installed, the hub reachable."""
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise UserError(f"loading {name} from the hub needs `pip install datasets`, or pass --data-dir") from None
    from qoqtool.models.loading import hub_reachable

    if not hub_reachable():
        raise UserError(
            f"cannot reach the Hugging Face hub to download {name}; pass --data-dir DIR "
            f"(or set {DATA_DIR_ENV}) pointing at a local copy"
        )


def _hub_rows(name: str, config: str | None, split: str, field: str) -> list[str]:
    require_hub(name)
    import datasets

    ds = datasets.load_dataset(name, config, split=split)
    return list(ds[field])
