"""The evaluation tasks `qoqtool eval --tasks` knows, and how each is run.

    wikitext2   perplexity on the WikiText-2 test split (ppl, tokens, windows)
    fidelity    data-free: KL divergence and top-1 agreement against the original model
    piqa, arc_easy, arc_challenge (arc = both), and any other task lm-eval knows:
                zero-shot accuracy through lm-eval (`qoqtool.eval.zeroshot`)
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
    decode_batch: int | None = None  # wikitext2 by teacher-forced decoding, this many windows at a time
    dtype: str = "float32"  # the float tensors of original models and packed folders (runtime.loading.load_any)


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
        if t not in known and not _lm_eval_knows(t):
            raise UserError(f"unknown task {t!r}; known tasks: {', '.join(known)}, or any lm-eval task name")
    return list(dict.fromkeys(tasks))


def _lm_eval_knows(task: str) -> bool:
    from qoqtool.eval.zeroshot import is_lm_eval_task  # imports lm-eval only now

    return is_lm_eval_task(task)


def lm_eval_tasks(tasks: list[str]) -> list[str]:
    """The tasks of `tasks` that run through lm-eval: all but perplexity and fidelity."""
    return [t for t in tasks if t not in PERPLEXITY_TASKS + FIDELITY_TASKS]


def check_task_data(tasks: list[str], settings: EvalSettings) -> None:
    """Fail before loading any model if a task's local data is missing."""
    from qoqtool.data import sources

    root = sources.data_dir(settings.data_dir)
    if root is not None and "wikitext2" in tasks:
        sources.require_file(root, sources.WIKITEXT_FILES["test"], "the WikiText-2 raw test split")
    zs = lm_eval_tasks(tasks)
    if zs:
        from qoqtool.eval.zeroshot import check_local_data, check_settings

        check_settings(settings.limit, settings.batch_size, settings.num_fewshot)
        check_local_data(zs, root, settings.num_fewshot)
