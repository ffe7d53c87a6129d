"""The `qoqtool` command line: quantize, pack, eval, generate, info, recipes.

Each command validates its arguments before any heavy work, reports progress on stderr,
prints a result table on stdout, and can write machine-readable JSON (`--json FILE`, or
`--json -` for stdout). A problem with the input is one line on stderr and exit code 2.
"""

from __future__ import annotations

import signal
import sys

import typer
from rich.markup import escape

from qoqtool.errors import UserError

app = typer.Typer(
    name="qoqtool",
    help=(
        "Quantize Llama-family LLMs to W4A8KV4 with QoQ (4-bit weights, 8-bit activations, "
        "4-bit KV cache), pack them for Hopper kernels, and evaluate them.\n\n"
        "Typical run on the bundled demo model:\n\n"
        "  qoqtool quantize smollm2-135m -r qoq-w4a8kv4-g128 --calib synthetic -o smol-qoq\n\n"
        "  qoqtool eval smol-qoq --tasks fidelity\n\n"
        "  qoqtool pack smol-qoq -o smol-qoq-packed\n\n"
        "  qoqtool generate smol-qoq-packed -p \"The capital of France is\"\n\n"
        "MODEL is a hub id (org/name), a local Hugging Face folder, a .gguf file, or "
        "smollm2-135m. Offline evaluation data: --data-dir DIR or QOQTOOL_DATA_DIR."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)

# Commands register themselves on `app` when their modules are imported.
from qoqtool.cli import commands  # noqa: E402,F401


def _quiet_libraries() -> None:
    """Our own progress bars only: silence transformers' and the hub's tqdm bars."""
    import os

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # tqdm reads TQDM_* when it is first imported: this reaches the bars that bypass
    # transformers' switch, e.g. its GGUF loader's "Converting and de-quantizing GGUF tensors".
    os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    """Console entry point: user errors become one line and exit code 2."""
    from qoqtool.cli import ui

    _quiet_libraries()
    ui.reserve_stdout(None)
    # SIGTERM (a scheduler, `kill`) ends a run as Ctrl-C does: the temporary output folder is removed.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        code = app(args=argv, standalone_mode=False)
        # typer turns Ctrl-C inside a command into Exit(130), which standalone_mode=False returns
        if isinstance(code, int) and not isinstance(code, bool) and code != 0:
            if code == 130:
                _say_interrupted()
            sys.exit(code)
    except UserError as e:
        ui.err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        _say_interrupted()
        sys.exit(130)
    except Exception as e:  # click's own usage errors carry their exit code
        for ex in _click_exception_modules():
            # (not every vendored click has every class: typer 0.29's lacks Exit and Abort)
            if isinstance(e, getattr(ex, "UsageError", ())):  # one line, as our own errors
                if not e.format_message():  # `qoqtool` alone: typer printed the help, nothing went wrong
                    sys.exit(e.exit_code)
                where = f"{e.ctx.command_path} --help" if e.ctx is not None else "qoqtool --help"
                ui.err.print(f"[bold red]error:[/] {escape(e.format_message())} (see '{escape(where)}')",
                             highlight=False, soft_wrap=True)
                sys.exit(e.exit_code)
            if isinstance(e, getattr(ex, "ClickException", ())):
                e.show()
                sys.exit(e.exit_code)
            if isinstance(e, getattr(ex, "Exit", ())):
                sys.exit(e.exit_code)
            if isinstance(e, getattr(ex, "Abort", ())):
                sys.exit(130)
        raise


def _say_interrupted() -> None:
    # Straight to stderr, not through Rich: the interrupt may have landed inside a Rich print,
    # whose buffer still holds the line it had already written and would write it again.
    sys.stderr.write("interrupted; nothing was written\n")
    sys.stderr.flush()


def _click_exception_modules() -> list:
    """click's exception classes: recent typer releases vendor their own click
    (`typer._click`), older ones use the click package."""
    modules = []
    for name in ("typer._click.exceptions", "click.exceptions"):
        try:
            modules.append(__import__(name, fromlist=["ClickException"]))
        except ImportError:
            pass
    return modules
