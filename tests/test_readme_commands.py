"""Every `qoqtool ...` example the README and the CLI's own help show must still parse.

Options get renamed and recipes or tasks retired; an example that no longer runs is the first
thing a new user meets. Each example line is split as a shell would, parsed by the real click
command (no callback runs), and its recipe, tasks and outlier budget are checked by the same
functions the commands call.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

from qoqtool.cli import _click_exception_modules, app
from qoqtool.cli.commands import _outlier_budget
from qoqtool.errors import UserError
from qoqtool.eval.tasks import parse_tasks
from qoqtool.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
CLI = typer.main.get_command(app)
USAGE_ERRORS = tuple(m.UsageError for m in _click_exception_modules())


def _commands_in(text: str) -> list[list[str]]:
    """Each `qoqtool` invocation in the text's fenced shell blocks, as argv after `qoqtool`."""
    found = []
    for block in re.findall(r"^```(?:bash|sh|console)?\n(.*?)^```", text, re.S | re.M):
        found += _invocations(block.splitlines())
    return found


def _invocations(lines) -> list[list[str]]:
    """Each `qoqtool` command in these shell lines, as argv after `qoqtool`."""
    return [words[1:] for line in lines if "qoqtool" in line
            for words in _shell_commands(line) if words[:1] == ["qoqtool"]]


def _shell_commands(line: str) -> list[list[str]]:
    """The simple commands of one shell line (split at &&, ||, | and ;), comments dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, words = [], []
    for token in lexer:
        if token in ("&&", "||", "|", ";"):
            commands.append(words)
            words = []
        else:
            words.append(token)
    return commands + [words]


def _help_examples() -> list[list[str]]:
    """The example lines of the top-level help and of each command's help."""
    texts = [CLI.help or ""] + [cmd.help or "" for cmd in CLI.commands.values()]
    return _invocations(line for text in texts for line in text.splitlines() if line.strip().startswith("qoqtool "))


README_EXAMPLES = _commands_in((ROOT / "README.md").read_text(encoding="utf-8"))
HELP_EXAMPLES = _help_examples()


def check_example(argv: list[str]) -> None:
    assert argv, "an example with no command"
    name, args = argv[0], argv[1:]
    assert name in CLI.commands, f"unknown command {name!r} in example: qoqtool {shlex.join(argv)}"
    command = CLI.commands[name]
    # Parses and converts every option exactly as a run would, without calling the command.
    ctx = command.make_context(name, list(args))
    params = ctx.params
    if params.get("recipe") is not None:
        load_recipe(params["recipe"])
    if params.get("tasks") is not None:
        parse_tasks(params["tasks"])
    _outlier_budget(params.get("outliers"), params.get("outliers_budget"))


def test_the_readme_and_the_help_show_examples_of_every_command():
    shown = {argv[0] for argv in README_EXAMPLES if argv}
    # info and recipes are shown inline in the README; the rest have fenced examples.
    assert {"quantize", "pack", "eval", "generate"} <= shown
    assert {argv[0] for argv in HELP_EXAMPLES if argv} >= {"quantize", "eval", "pack", "generate"}


@pytest.mark.parametrize("argv", README_EXAMPLES + HELP_EXAMPLES, ids=shlex.join)
def test_example_parses(argv):
    check_example(argv)


@pytest.mark.parametrize(
    "argv, problem",
    [
        (["quantize", "smollm2-135m", "--calibration", "wikitext2"], USAGE_ERRORS),
        (["eval", "smol-qoq", "--max-windows", "twenty"], USAGE_ERRORS),
        (["quantize", "smollm2-135m", "-r", "qoq-w4a8kv4-g32"], UserError),
        (["eval", "smol-qoq", "--tasks", "wikitext3"], UserError),
        (["pack", "smol-qoq", "--outliers", "1 percent"], UserError),
        (["pack", "smol-qoq", "--outliers-budget", "global"], UserError),
        (["evaluate", "smol-qoq"], AssertionError),
    ],
)
def test_a_stale_example_fails(argv, problem):
    # The check must be able to fail: renamed options, unknown recipes, tasks and commands.
    with pytest.raises(problem):
        check_example(argv)


def test_the_example_finder_reads_chains_and_comments():
    text = "```bash\npip install x && qoqtool eval a --tasks fidelity   # a comment\n```\n"
    assert _commands_in(text) == [["eval", "a", "--tasks", "fidelity"]]
