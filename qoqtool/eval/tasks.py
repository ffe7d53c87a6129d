"""The evaluation tasks `qoqtool eval --tasks` knows, and how each is run.

    wikitext2   perplexity on the WikiText-2 test split (ppl, tokens, windows)
    fidelity    data-free: KL divergence and top-1 agreement against the original model
"""

from __future__ import annotations

from dataclasses import dataclass

from qoqtool.errors import UserError

PERPLEXITY_TASKS = ("wikitext2",)
FIDELITY_TASKS = ("fidelity",)


@dataclass
class EvalSettings:
    seqlen: int = 2048
    max_windows: int | None = None
    data_dir: str | None = None
    fidelity_samples: int = 8
    fidelity_seqlen: int = 512
    seed: int = 0
    limit: int | None = None
    batch_size: int = 16
    num_fewshot: int = 0


def zero_shot_tasks() -> tuple[str, ...]:
    try:
        from qoqtool.eval.zeroshot import KNOWN_TASKS
    except ImportError:
        return ()
    return tuple(KNOWN_TASKS)


def known_tasks() -> tuple[str, ...]:
    return PERPLEXITY_TASKS + FIDELITY_TASKS + zero_shot_tasks()


def parse_tasks(spec: str) -> list[str]:
    tasks = [t.strip() for t in spec.split(",") if t.strip()]
    if not tasks:
        raise UserError("--tasks is empty; name at least one task, e.g. --tasks wikitext2")
    known = known_tasks()
    for t in tasks:
        if t not in known:
            raise UserError(f"unknown task {t!r}; known tasks: {', '.join(known)}")
    return list(dict.fromkeys(tasks))


def check_task_data(tasks: list[str], settings: EvalSettings) -> None:
    """Fail before loading any model if a task's local data is missing."""
    from qoqtool.data import sources

    root = sources.data_dir(settings.data_dir)
    if root is None:
        return
    if "wikitext2" in tasks:
        sources.require_file(root, sources.WIKITEXT_FILES["test"], "the WikiText-2 raw test split")
    zs = [t for t in tasks if t in zero_shot_tasks()]
    if zs:
        from qoqtool.eval.zeroshot import check_local_data

        check_local_data(zs, root)
