"""Terminal output shared by the commands: one console, progress bars, tables, JSON."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

# Progress and messages go to stderr, result tables to stdout - or to stderr as well when
# stdout carries the JSON (`--json -`, see reserve_stdout), so that it stays parseable.
err = Console(stderr=True)
_stdout = Console()
out = _stdout


def reserve_stdout(json_target: str | None) -> None:
    """Where this command's tables go: stdout, or stderr with `--json -` (main() calls it
    with None before every command, and each command with --json with its target)."""
    global out
    out = err if json_target == "-" else _stdout
    if json_target not in (None, "-"):
        from qoqtool.packing.folder import check_writable

        check_writable(Path(json_target).expanduser(), f"--json {json_target}", folder=False)


@contextmanager
def progress_bar(description: str, enabled: bool = True):
    """Yield a callback (what, done, total) that drives one Rich progress bar."""
    if not enabled:
        yield lambda what, done, total: None
        return
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[what]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=False,
    )
    task = progress.add_task(description, total=None, what="")
    with progress:

        def update(what: str, done: int, total: int) -> None:
            progress.update(task, completed=done, total=total, what=what)

        yield update


def table(title: str, columns: list[str], rows: list[list], console: Console | None = None) -> None:
    t = Table(title=title, title_justify="left")
    for i, col in enumerate(columns):
        t.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        t.add_row(*[fmt(v) for v in row])
    (console or out).print(t)


def fmt(v) -> str:
    if isinstance(v, float):
        if v != 0 and abs(v) < 1e-3:
            return f"{v:.4e}"
        return f"{v:.1f}" if abs(v) >= 1e5 else f"{v:.5g}"
    return str(v)


def write_json(target: str | None, payload: dict) -> None:
    if not target:
        return
    text = json.dumps(payload, indent=2, sort_keys=False)
    if target == "-":
        sys.stdout.write(text + "\n")
    else:
        path = Path(target).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
        err.print(f"wrote {escape(str(target))}")
