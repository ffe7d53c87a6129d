"""Run evaluation tasks on one model, or on two to compare, and report them."""

from __future__ import annotations

import time

from qoqtool.cli import ui
from qoqtool.errors import UserError
from qoqtool.eval.tasks import EvalSettings, zero_shot_tasks
from qoqtool.packing import folder as fs
from qoqtool.runtime.loading import LoadedModel, load_any


def _original_for(loaded: LoadedModel, baseline: LoadedModel | None, device: str) -> LoadedModel:
    if baseline is not None:
        return baseline
    if loaded.kind == "original":
        raise UserError(
            "fidelity compares a quantized model with its original; pass a folder written by "
            "qoqtool quantize/pack, or two models (original first)"
        )
    return load_any(loaded.source_model, device=device)


def evaluate_model(
    loaded: LoadedModel, tasks: list[str], settings: EvalSettings, device: str, show_progress: bool,
    baseline: LoadedModel | None = None,
) -> dict:
    from qoqtool.eval.fidelity import fidelity, held_out_text
    from qoqtool.eval.perplexity import perplexity, wikitext2_test_ids

    results: dict[str, dict] = {}
    label = loaded.spec
    if "wikitext2" in tasks:
        ids = wikitext2_test_ids(loaded.tokenizer, settings.data_dir)
        t0 = time.perf_counter()
        with ui.progress_bar(f"wikitext2 {label}", show_progress) as bar:
            res = perplexity(loaded.model, ids, settings.seqlen, settings.max_windows, bar)
        res["seconds"] = round(time.perf_counter() - t0, 1)
        results["wikitext2"] = res
    if "fidelity" in tasks:
        original = _original_for(loaded, baseline, device)
        text = held_out_text(original.model, settings.fidelity_samples, settings.fidelity_seqlen, settings.seed)
        with ui.progress_bar(f"fidelity {label}", show_progress) as bar:
            results["fidelity"] = fidelity(original.model, loaded.model, text, bar)
        results["fidelity"]["original"] = original.spec
    zs = [t for t in tasks if t in zero_shot_tasks()]
    if zs:
        from qoqtool.eval.zeroshot import run_zero_shot

        results.update(run_zero_shot(loaded, zs, settings, show_progress))
    return results


def _rows(results: dict) -> list[list]:
    rows = []
    for task, metrics in results.items():
        for metric, value in metrics.items():
            if isinstance(value, (int, float)) and metric not in ("seconds",):
                rows.append([task, metric, value])
    return rows


def run_eval(models: list[str], tasks: list[str], settings: EvalSettings, device: str, show_progress: bool) -> dict:
    loaded = [load_any(spec, device=device) for spec in models]
    config = {k: v for k, v in vars(settings).items()}
    if len(loaded) == 1:
        res = evaluate_model(loaded[0], tasks, settings, device, show_progress)
        ui.table(f"{models[0]} ({loaded[0].kind})", ["task", "metric", "value"], _rows(res))
        return {"model": models[0], "kind": loaded[0].kind, "results": res, "config": config, "versions": fs.versions()}

    base, other = loaded
    # A is the reference: fidelity is measured for B against A only.
    res_a = evaluate_model(base, [t for t in tasks if t != "fidelity"], settings, device, show_progress)
    res_b = evaluate_model(other, tasks, settings, device, show_progress, baseline=base)
    diff: dict[str, dict] = {}
    rows = []
    for task in res_b:
        for metric, vb in res_b[task].items():
            va = res_a.get(task, {}).get(metric)
            if isinstance(vb, (int, float)) and isinstance(va, (int, float)) and metric != "seconds":
                diff.setdefault(task, {})[metric] = vb - va
                rows.append([task, metric, va, vb, vb - va])
    ui.table(f"{models[1]} against {models[0]}", ["task", "metric", "A", "B", "B - A"], rows)
    return {
        "models": models,
        "results": {models[0]: res_a, models[1]: res_b},
        "difference": diff,
        "config": config,
        "versions": fs.versions(),
    }
