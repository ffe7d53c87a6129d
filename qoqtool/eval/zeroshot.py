"""Zero-shot accuracy through lm-eval (EleutherAI's evaluation harness), offline when asked.

lm-eval owns everything that makes a number comparable with other toolkits: the task
configs (prompts: doc_to_text / doc_to_choice / doc_to_target), the request building, the
scoring (HFLM's log-likelihood of each choice) and the metrics (acc, acc_norm, stderr).
qoqtool only supplies two things:

* the model it built (original, quantized or packed), wrapped in lm-eval's own `HFLM`, so
  the QuantLinear / PackedLinear modules and the KV-quantizing attention are what is scored;
* for the tasks in LOCAL_TASKS, the data rows, read from local files laid out like
  shared/data when --data-dir (or QOQTOOL_DATA_DIR) is given. They reach lm-eval through
  its `custom_dataset` hook, in the schema of the hub data set the task config reads, so
  the prompts and the scoring stay lm-eval's.

Any other task lm-eval knows (hellaswag, winogrande, ...) runs unchanged from the hub.
lm-eval is imported only when a zero-shot task runs: the GPU machine does not have it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from qoqtool.errors import UserError

# The tasks qoqtool can also read from local files, and the aliases that expand to them.
GROUPS = {"arc": ("arc_easy", "arc_challenge")}
LOCAL_TASK_NAMES = ("piqa", "arc_easy", "arc_challenge")
KNOWN_TASKS = LOCAL_TASK_NAMES + tuple(GROUPS)

# HFLM scores requests in slices of this many batches so the progress bar can advance
# between them; each slice is still sorted by length inside HFLM, so padding stays low.
BATCHES_PER_SLICE = 8


@dataclass(frozen=True)
class LocalTask:
    """Where one lm-eval task's splits live under --data-dir, and how to read them."""

    hub_dataset: str  # what lm-eval's config would download (for messages only)
    splits: dict[str, tuple[str, ...]]  # split -> files (rows first, then labels, if any)
    eval_split: str  # the split lm-eval scores (test if the config has one, else validation)
    fewshot_split: str  # where lm-eval samples in-context examples from

    def files(self, split: str) -> str:
        return " and ".join(self.splits[split])


def _arc(name: str) -> LocalTask:
    splits = {s: (f"arc/ARC-{name}-{s}.jsonl",) for s in ("train", "validation", "test")}
    return LocalTask("allenai/ai2_arc", splits, eval_split="test", fewshot_split="train")


LOCAL_TASKS = {
    "piqa": LocalTask(
        "baber/piqa",
        {
            "train": ("piqa/train.jsonl", "piqa/train-labels.lst"),
            "validation": ("piqa/valid.jsonl", "piqa/valid-labels.lst"),
        },
        eval_split="validation",
        fewshot_split="train",
    ),
    "arc_easy": _arc("Easy"),
    "arc_challenge": _arc("Challenge"),
}

# The fields lm-eval's task configs read, exactly as in the hub data sets.
PIQA_FIELDS = ("goal", "sol1", "sol2")
ARC_FIELDS = ("id", "question", "choices", "answerKey")


def expand(tasks: list[str]) -> list[str]:
    """Replace aliases (`arc`) by their tasks, keeping order and dropping repeats."""
    out: list[str] = []
    for t in tasks:
        out.extend(GROUPS.get(t, (t,)))
    return list(dict.fromkeys(out))


# ---------------------------------------------------------------------------------------
# Checks that run before any model is loaded.


def check_settings(limit: int | None, batch_size: int, num_fewshot: int) -> None:
    if limit is not None and limit < 1:
        raise UserError(f"--limit must be at least 1 (got {limit})")
    if batch_size < 1:
        raise UserError(f"--batch-size must be at least 1 (got {batch_size})")
    if num_fewshot < 0:
        raise UserError(f"--num-fewshot must be 0 or more (got {num_fewshot})")


def check_local_data(tasks: list[str], root: Path | None, num_fewshot: int = 0) -> None:
    """Fail fast, in one line, when lm-eval is missing or a task's data is neither under
    `root` nor reachable."""
    if importlib.util.find_spec("lm_eval") is None:
        raise UserError(f"{', '.join(tasks)} run through lm-eval, which is not installed here; run: pip install lm-eval")
    missing = []  # what --data-dir must hold but does not, for every task at once
    for name in expand(tasks):
        local = LOCAL_TASKS.get(name)
        if root is not None and local is not None:
            needed = {local.eval_split: f"for {name}"}
            if num_fewshot > 0:
                needed[local.fewshot_split] = f"for {name}'s --num-fewshot examples"
            for split, purpose in needed.items():
                if not all((root / rel).is_file() for rel in local.splits[split]):
                    missing.append(f"{local.files(split)} {purpose}")
        elif not _hub_reachable():
            if local is not None:
                raise UserError(
                    f"cannot reach the Hugging Face hub to download {local.hub_dataset} for {name}; pass "
                    f"--data-dir DIR holding {local.files(local.eval_split)} (a copy laid out like shared/data)"
                )
            raise UserError(
                f"cannot reach the Hugging Face hub to download the data of {name}; qoqtool reads local "
                f"copies only for {', '.join(LOCAL_TASK_NAMES)}"
            )
    if missing:
        raise UserError(f"--data-dir {root} must hold {'; '.join(missing)} (laid out like shared/data)")


def _hub_reachable() -> bool:
    from qoqtool.models.loading import hub_reachable

    return hub_reachable()


def is_lm_eval_task(name: str) -> bool:
    """Whether lm-eval knows `name` (a task, group or tag); False without lm-eval."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        return False
    with _quiet_lm_eval():
        return name in TaskManager().all_tasks


# ---------------------------------------------------------------------------------------
# Local rows in the hub schemas.


def _read_jsonl(path: Path, fields: tuple[str, ...]) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise UserError(f"{path}:{lineno} is not valid JSON; restore the file from the data set") from None
            missing = [f for f in fields if not isinstance(row, dict) or f not in row]
            if missing:
                raise UserError(f"{path}:{lineno} lacks field {missing[0]!r}; every row needs {', '.join(fields)}")
            rows.append({f: row[f] for f in fields})
    return rows


def piqa_rows(jsonl: Path, labels: Path) -> list[dict]:
    """PIQA as `baber/piqa` has it: goal, sol1, sol2 and the integer label (0 or 1)."""
    rows = _read_jsonl(jsonl, PIQA_FIELDS)
    marks = [line.strip() for line in labels.read_text(encoding="utf-8").splitlines() if line.strip()]
    if len(marks) != len(rows):
        raise UserError(f"{labels} has {len(marks)} labels for the {len(rows)} rows of {jsonl}; they must align line by line")
    bad = next((m for m in marks if m not in ("0", "1")), None)
    if bad is not None:
        raise UserError(f"{labels} holds label {bad!r}; PIQA labels are 0 or 1, one per line")
    return [{**row, "label": int(m)} for row, m in zip(rows, marks)]


def arc_rows(jsonl: Path) -> list[dict]:
    """ARC as `allenai/ai2_arc` has it: id, question, choices{text, label}, answerKey."""
    rows = _read_jsonl(jsonl, ARC_FIELDS)
    for i, row in enumerate(rows):
        choices = row["choices"]
        if not (isinstance(choices, dict) and len(choices.get("text", [])) == len(choices.get("label", [])) > 0):
            raise UserError(f"{jsonl} row {i + 1}: choices must be {{text: [...], label: [...]}} of equal length")
        if row["answerKey"] not in choices["label"]:
            raise UserError(f"{jsonl} row {i + 1}: answerKey {row['answerKey']!r} is not one of its choice labels")
    return rows


def local_dataset(name: str, root: Path):
    """A `datasets.DatasetDict` of every split of `name` present under `root`."""
    import datasets

    local = LOCAL_TASKS[name]
    splits = {}
    for split, files in local.splits.items():
        paths = [root / f for f in files]
        if all(p.is_file() for p in paths):
            rows = piqa_rows(*paths) if name == "piqa" else arc_rows(*paths)
            splits[split] = datasets.Dataset.from_list(rows)
    return datasets.DatasetDict(splits)


# ---------------------------------------------------------------------------------------
# lm-eval's task objects and model wrapper.


def build_tasks(names: list[str], data_dir: str | None) -> tuple[object, dict[str, object]]:
    """(lm-eval TaskManager, {name: Task or name}) for `names`.

    Local tasks become lm-eval ConfigurableTasks built from lm-eval's own config for that
    task, with `custom_dataset` returning the local rows. Other names stay strings, for
    lm-eval to load from the hub as usual.
    """
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.tasks import TaskManager

    from qoqtool.data import sources

    root = sources.data_dir(data_dir)
    with _quiet_lm_eval():
        manager = TaskManager()
        tasks: dict[str, object] = {}
        for name in expand(names):
            if root is None or name not in LOCAL_TASKS:
                tasks[name] = name
                continue
            dataset = local_dataset(name, root)
            # lm-eval's YAML for the task with its includes resolved (these three configs
            # hold no !function entries, which this copy would leave unresolved).
            config = dict(manager.task_index[name].cfg)
            config.pop("tag", None)  # tags are index bookkeeping, not task fields
            # lm-eval reads a split only if its config names it; drop splits we lack locally
            # (e.g. PIQA's train split, needed only for few-shot examples).
            for key in ("training_split", "validation_split", "test_split"):
                if config.get(key) not in dataset:
                    config[key] = None
            config["custom_dataset"] = _returning(dataset)
            tasks[name] = ConfigurableTask(config=config)
    return manager, tasks


def _returning(dataset):
    """A `custom_dataset` hook; lm-eval calls it with the task's metadata, which we ignore."""

    def load(**_metadata):
        return dataset

    return load


def scoring_lm(model, tokenizer, batch_size: int):
    """lm-eval's HFLM around the in-memory `model`, reporting progress to `.progress`."""
    from lm_eval.models.huggingface import HFLM

    class ProgressHFLM(HFLM):
        # progress(what, done, total): the callback qoqtool's Rich bar hands in.
        progress = staticmethod(lambda what, done, total: None)

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            step = self.batch_size * BATCHES_PER_SLICE
            scores = []
            for start in range(0, len(requests), step):
                self.progress("requests", start, len(requests))
                scores += super().loglikelihood(requests[start : start + step], disable_tqdm=True)
            self.progress("requests", len(requests), len(requests))
            return scores

    with _quiet_lm_eval():
        return ProgressHFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)


def score(lm, manager, task, num_fewshot: int = 0, limit: int | None = None,
          samples: list[int] | None = None, log_samples: bool = False) -> dict:
    """lm-eval's `evaluate` of one task (object or name): its results dict, unchanged.

    This is `simple_evaluate` without its side effects (global seeds, a `git describe`
    of the working directory): the same few-shot setting and few-shot sampling seed.
    """
    from lm_eval.defaults import DEFAULT_OTHER_SEED
    from lm_eval.evaluator import evaluate

    with _quiet_lm_eval():
        loaded = manager.load([task])
        for t in loaded["tasks"].values():
            if t.get_config("num_fewshot") != 0:  # a config that pins 0 shots keeps it
                t.set_config(key="num_fewshot", value=num_fewshot)
            t.set_fewshot_seed(seed=DEFAULT_OTHER_SEED)
        return evaluate(
            lm=lm,
            task_dict=loaded,
            limit=limit,
            samples={name: samples for name in loaded["tasks"]} if samples is not None else None,
            log_samples=log_samples,
        )


@contextmanager
def _quiet_lm_eval():
    """lm-eval logs every setting at INFO/WARNING; keep the terminal for qoqtool's output."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


# ---------------------------------------------------------------------------------------
# The entry point `qoqtool eval` calls, and the average over tasks.


def run_zero_shot(loaded, tasks: list[str], settings, show_progress: bool) -> dict[str, dict]:
    """Score `loaded` on `tasks`: {task: lm-eval's result entry + n-samples, n-shot, seconds}."""
    from qoqtool.cli import ui

    manager, task_objs = build_tasks(tasks, settings.data_dir)
    lm = scoring_lm(loaded.model, loaded.tokenizer, settings.batch_size)
    results: dict[str, dict] = {}
    for name, task in task_objs.items():
        t0 = time.perf_counter()
        with ui.progress_bar(f"{name} {loaded.spec}", show_progress) as bar:
            lm.progress = bar
            out = score(lm, manager, task, settings.num_fewshot, settings.limit)
        seconds = round(time.perf_counter() - t0, 1)
        # A group (e.g. lm-eval's mmlu) answers with itself and its subtasks: keep them all.
        for key, entry in out["results"].items():
            results[key] = {
                **entry,
                "n-samples": out["n-samples"].get(key),
                "n-shot": out["n-shot"].get(key),
                "seconds": seconds if key == name else None,
            }
    return results


AVERAGED = ("acc,none", "acc_norm,none")


def average(results: dict[str, dict]) -> dict | None:
    """Unweighted mean of acc and acc_norm over the zero-shot tasks in `results`.

    This is the "average" of the QoQ paper's zero-shot tables: each task counts once,
    whatever its size. The stderr assumes the tasks' errors are independent.
    """
    scored = [t for t, m in results.items() if all(isinstance(m.get(k), float) for k in AVERAGED)]
    if len(scored) < 2:
        return None
    entry: dict = {"alias": "average of " + ", ".join(scored), "tasks": scored}
    for key in AVERAGED:
        metric, flt = key.split(",")
        entry[key] = sum(results[t][key] for t in scored) / len(scored)
        errs = [results[t].get(f"{metric}_stderr,{flt}") for t in scored]
        if all(isinstance(e, float) for e in errs):
            entry[f"{metric}_stderr,{flt}"] = math.sqrt(sum(e * e for e in errs)) / len(scored)
    return entry
