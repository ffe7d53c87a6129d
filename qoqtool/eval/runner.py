"""Run evaluation tasks on one model, or on two to compare, and report them."""

from __future__ import annotations

import time

from rich.markup import escape

from qoqtool.cli import ui
from qoqtool.errors import UserError
from qoqtool.eval.perplexity import paired_ratio, perplexity, wikitext2_test_ids
from qoqtool.eval.tasks import EvalSettings, lm_eval_tasks
from qoqtool.packing import folder as fs
from qoqtool.runtime.loading import LoadedModel, load_any


def _original_for(loaded: LoadedModel, baseline: LoadedModel | None, device: str, dtype: str) -> LoadedModel:
    if baseline is not None:
        return baseline
    if loaded.kind == "original":
        raise UserError(
            "fidelity compares a quantized model with its original; pass a folder written by "
            "qoqtool quantize/pack, or two models (original first)"
        )
    return load_any(loaded.source_model, device=device, dtype=dtype)


def evaluate_model(
    loaded: LoadedModel, tasks: list[str], settings: EvalSettings, device: str, show_progress: bool,
    baseline: LoadedModel | None = None,
) -> dict:
    from qoqtool.data.calibration import token_count
    from qoqtool.eval.fidelity import fidelity, held_out_text

    results: dict[str, dict] = {}
    label = loaded.spec
    if "wikitext2" in tasks:
        ids = wikitext2_test_ids(loaded.tokenizer, settings.data_dir)
        t0 = time.perf_counter()
        with ui.progress_bar(f"wikitext2 {label}", show_progress) as bar:
            res = perplexity(loaded.model, ids, settings.seqlen, settings.max_windows, bar, settings.decode_batch)
        res["seconds"] = round(time.perf_counter() - t0, 1)
        results["wikitext2"] = res
    if "fidelity" in tasks:
        original = _original_for(loaded, baseline, device, settings.dtype)
        text = held_out_text(original.model, settings.fidelity_samples, settings.fidelity_seqlen, settings.seed,
                             token_count(original.tokenizer))
        with ui.progress_bar(f"fidelity {label}", show_progress) as bar:
            results["fidelity"] = fidelity(original.model, loaded.model, text, bar)
        results["fidelity"]["original"] = original.spec
    zs = lm_eval_tasks(tasks)
    if zs:
        from qoqtool.eval.zeroshot import average, run_zero_shot

        results.update(run_zero_shot(loaded, zs, settings, show_progress))
        if (avg := average(results)) is not None:
            results["average"] = avg
    return results


# Numbers in a task's results that describe the run rather than score the model.
BOOKKEEPING = ("seconds", "sample_len", "n-shot")


def _scores(entry: dict) -> list[tuple[str, str, float, float | None]]:
    """(key, label, value, stderr) for each score of one task's results.

    lm-eval names a metric "acc,none" (metric, filter) and its error "acc_stderr,none";
    the label drops the default filter, and the stderr rides along with its metric.
    """
    out = []
    for key, value in entry.items():
        if key in BOOKKEEPING or "_stderr" in key or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        metric, _, flt = key.partition(",")
        stderr = entry.get(f"{metric}_stderr,{flt}") if flt else None
        label = metric if flt in ("", "none") else f"{metric} ({flt})"
        out.append((key, label, value, stderr if isinstance(stderr, float) else None))
    return out


def _rows(results: dict) -> list[list]:
    return [
        [task, label, value, "" if err is None else err]
        for task, entry in results.items()
        for _, label, value, err in _scores(entry)
    ]


def counting_linear_paths(evaluate) -> tuple[dict, dict[str, int]]:
    """evaluate()'s results, and how many calls of packed linears took each path meanwhile
    (a kernel or the reference path: packed_linear.path_calls; empty for other models)."""
    from qoqtool.runtime import packed_linear

    packed_linear.path_calls.clear()
    res = evaluate()
    return res, dict(packed_linear.path_calls.most_common())


def print_paths(spec: str, paths: dict[str, int]) -> None:
    """One line under the results: on a GPU it says whether the kernels ran, and which."""
    if paths:
        ui.out.print(f"{escape(spec)}: packed linear calls by path: " + ", ".join(f"{n:,} {p}" for p, n in paths.items()))


def run_eval(models: list[str], tasks: list[str], settings: EvalSettings, device: str, show_progress: bool) -> dict:
    loaded = [load_any(spec, device=device, dtype=settings.dtype) for spec in models]
    config = {k: v for k, v in vars(settings).items()}
    if len(loaded) == 1:
        res, paths = counting_linear_paths(lambda: evaluate_model(loaded[0], tasks, settings, device, show_progress))
        ui.table(f"{models[0]} ({loaded[0].kind})", ["task", "metric", "value", "± stderr"], _rows(res))
        print_paths(models[0], paths)
        return {"model": models[0], "kind": loaded[0].kind, "results": res, "linear_paths": paths, "config": config,
                "versions": fs.versions()}

    base, other = loaded
    # A is the reference: fidelity is measured for B against A only.
    res_a, paths_a = counting_linear_paths(
        lambda: evaluate_model(base, [t for t in tasks if t != "fidelity"], settings, device, show_progress))
    res_b, paths_b = counting_linear_paths(
        lambda: evaluate_model(other, tasks, settings, device, show_progress, baseline=base))
    diff: dict[str, dict] = {}
    rows = []
    for task in res_b:
        for key, label, vb, _ in _scores(res_b[task]):
            va = res_a.get(task, {}).get(key)
            if isinstance(va, (int, float)) and not isinstance(va, bool):
                diff.setdefault(task, {})[key] = vb - va
                rows.append([task, label, va, vb, vb - va])
            else:  # B's alone: fidelity, which is B measured against A
                rows.append([task, label, "", vb, ""])
    if "window_nll" in res_a.get("wikitext2", {}) and "window_nll" in res_b.get("wikitext2", {}):
        ratio, stderr = paired_ratio(res_a["wikitext2"], res_b["wikitext2"])
        diff["wikitext2"] |= {"ppl_ratio": ratio, "ppl_ratio_stderr": stderr}
        rows.append(["wikitext2", "ppl B / A (± paired stderr)", "", ratio, "" if stderr is None else f"± {ui.fmt(stderr)}"])
    ui.table(f"{models[1]} against {models[0]}", ["task", "metric", "A", "B", "B - A"], rows)
    print_paths(models[0], paths_a)
    print_paths(models[1], paths_b)
    return {
        "models": models,
        "results": {models[0]: res_a, models[1]: res_b},
        "difference": diff,
        "linear_paths": {models[0]: paths_a, models[1]: paths_b},
        "config": config,
        "versions": fs.versions(),
    }
