"""Zero-shot evaluation through lm-eval: offline data, errors, the result tables, and
equivalence with lm-eval's own HFLM on the demo model."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from qoqtool.errors import UserError
from qoqtool.eval import zeroshot

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed")

# A fixed sample of items per task (indices into the split lm-eval scores): both ends of
# each file and a few in between.
SAMPLE = {
    "piqa": [0, 1, 100, 917, 1837],
    "arc_easy": [0, 5, 999, 2375],
    "arc_challenge": [0, 3, 600, 1171],
}


def write_piqa(root, rows, labels):
    (root / "piqa").mkdir(parents=True, exist_ok=True)
    (root / "piqa" / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "piqa" / "valid-labels.lst").write_text("".join(f"{x}\n" for x in labels))


PIQA_ROWS = [
    {"goal": "Open a jar", "sol1": "twist the lid", "sol2": "paint the lid"},
    {"goal": "Dry a towel", "sol1": "put it in water", "sol2": "hang it in the sun"},
]


# ---------------------------------------------------------------------------------------
# Task names and settings


def test_arc_expands_to_both_sets_once():
    assert zeroshot.expand(["arc", "piqa", "arc_easy"]) == ["arc_easy", "arc_challenge", "piqa"]


def test_unknown_task_is_a_user_error():
    from qoqtool.eval.tasks import parse_tasks

    with pytest.raises(UserError, match="unknown task 'no_such_task'"):
        parse_tasks("piqa,no_such_task")


def test_other_lm_eval_tasks_are_accepted():
    from qoqtool.eval.tasks import parse_tasks

    assert parse_tasks("wikitext2,arc,hellaswag") == ["wikitext2", "arc", "hellaswag"]


@pytest.mark.parametrize(
    "limit, batch, shots, word", [(0, 16, 0, "--limit"), (None, 0, 0, "--batch-size"), (None, 16, -1, "--num-fewshot")]
)
def test_bad_settings(limit, batch, shots, word):
    with pytest.raises(UserError, match=word):
        zeroshot.check_settings(limit, batch, shots)


# ---------------------------------------------------------------------------------------
# Missing data


def test_missing_local_files_name_what_data_dir_must_hold(tmp_path):
    with pytest.raises(UserError, match="must hold piqa/valid.jsonl and piqa/valid-labels.lst for piqa"):
        zeroshot.check_local_data(["piqa"], tmp_path)
    with pytest.raises(UserError) as e:
        zeroshot.check_local_data(["arc"], tmp_path)
    assert "arc/ARC-Easy-test.jsonl for arc_easy; arc/ARC-Challenge-test.jsonl for arc_challenge" in str(e.value)


def test_few_shot_needs_the_training_split(shared_data):
    zeroshot.check_local_data(["piqa", "arc"], shared_data)  # zero-shot: all present
    zeroshot.check_local_data(["arc"], shared_data, num_fewshot=5)  # ARC ships its train split
    with pytest.raises(UserError, match="piqa/train.jsonl and piqa/train-labels.lst for piqa's --num-fewshot"):
        zeroshot.check_local_data(["piqa"], shared_data, num_fewshot=5)


def test_no_local_data_and_no_hub(monkeypatch):
    monkeypatch.setattr(zeroshot, "_hub_reachable", lambda: False)
    with pytest.raises(UserError, match="baber/piqa.*--data-dir DIR holding piqa/valid.jsonl"):
        zeroshot.check_local_data(["piqa"], None)
    with pytest.raises(UserError, match="data of hellaswag"):
        zeroshot.check_local_data(["hellaswag"], None)


def test_cli_missing_data_is_one_line(tmp_path):
    from tests.test_cli_errors import assert_user_error, run_cli

    proc = run_cli("eval", "smollm2-135m", "--tasks", "arc", "--data-dir", str(tmp_path))
    assert_user_error(proc, "arc/ARC-Easy-test.jsonl", "--data-dir")


# ---------------------------------------------------------------------------------------
# Offline rows in lm-eval's task objects


def test_local_tasks_keep_lm_eval_prompts(shared_data):
    manager, tasks = zeroshot.build_tasks(["piqa", "arc"], str(shared_data))
    sizes = {"piqa": 1838, "arc_easy": 2376, "arc_challenge": 1172}
    for name, task in tasks.items():
        registered = manager.task_index[name].cfg
        for field in ("doc_to_text", "doc_to_choice", "doc_to_target", "metric_list", "output_type"):
            assert getattr(task.config, field) == registered[field], (name, field)
        assert len(task.eval_docs) == sizes[name]

    raw = [json.loads(line) for line in (shared_data / "piqa" / "valid.jsonl").read_text().splitlines()]
    labels = (shared_data / "piqa" / "valid-labels.lst").read_text().split()
    piqa = tasks["piqa"]
    for i in SAMPLE["piqa"]:
        doc = piqa.eval_docs[i]
        assert piqa.doc_to_text(doc) == f"Question: {raw[i]['goal']}\nAnswer:"
        assert piqa.doc_to_choice(doc) == [raw[i]["sol1"], raw[i]["sol2"]]
        assert piqa.doc_to_target(doc) == int(labels[i])

    raw = [json.loads(line) for line in (shared_data / "arc" / "ARC-Challenge-test.jsonl").read_text().splitlines()]
    arc = tasks["arc_challenge"]
    for i in SAMPLE["arc_challenge"]:
        doc = arc.eval_docs[i]
        assert arc.doc_to_text(doc) == f"Question: {raw[i]['question']}\nAnswer:"
        assert arc.doc_to_choice(doc) == raw[i]["choices"]["text"]
        assert arc.doc_to_target(doc) == raw[i]["choices"]["label"].index(raw[i]["answerKey"])


def test_piqa_rows_from_a_small_folder(tmp_path):
    write_piqa(tmp_path, PIQA_ROWS, [0, 1])
    _, tasks = zeroshot.build_tasks(["piqa"], str(tmp_path))
    docs = tasks["piqa"].eval_docs
    assert [d["label"] for d in docs] == [0, 1]
    assert docs[1]["sol2"] == "hang it in the sun"


@pytest.mark.parametrize(
    "labels, word", [([0], "has 1 labels for the 2 rows"), ([0, 2], "label '2'")]
)
def test_bad_piqa_labels(tmp_path, labels, word):
    write_piqa(tmp_path, PIQA_ROWS, labels)
    with pytest.raises(UserError, match=word):
        zeroshot.piqa_rows(tmp_path / "piqa" / "valid.jsonl", tmp_path / "piqa" / "valid-labels.lst")


def test_bad_rows(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"goal": "g", "sol1": "a"}) + "\n")
    with pytest.raises(UserError, match="lacks field 'sol2'"):
        zeroshot._read_jsonl(path, zeroshot.PIQA_FIELDS)
    row = {"id": "x", "question": "q", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "C"}
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(UserError, match="answerKey 'C'"):
        zeroshot.arc_rows(path)


# ---------------------------------------------------------------------------------------
# Average and comparison output


def fake_results(acc: float, norm: float) -> dict:
    return {
        t: {"alias": t, "acc,none": acc + i / 100, "acc_stderr,none": 0.01, "acc_norm,none": norm,
            "acc_norm_stderr,none": 0.02, "sample_len": 10, "n-shot": 0, "seconds": 1.0}
        for i, t in enumerate(["piqa", "arc_easy"])
    }


def test_average_is_the_unweighted_mean_over_tasks():
    res = {"wikitext2": {"ppl": 20.0}, **fake_results(0.5, 0.4)}
    avg = zeroshot.average(res)
    assert avg["tasks"] == ["piqa", "arc_easy"]
    assert avg["acc,none"] == pytest.approx(0.505)
    assert avg["acc_norm,none"] == pytest.approx(0.4)
    assert avg["acc_norm_stderr,none"] == pytest.approx((2 * 0.02**2) ** 0.5 / 2)
    assert zeroshot.average({"piqa": res["piqa"]}) is None  # one task: nothing to average


def test_comparison_reports_score_differences_only(monkeypatch):
    from qoqtool.eval import runner
    from qoqtool.eval.tasks import EvalSettings
    from qoqtool.runtime.loading import LoadedModel

    by_spec = {"A": fake_results(0.60, 0.50), "B": fake_results(0.55, 0.52)}
    monkeypatch.setattr(runner, "load_any", lambda spec, device, dtype: LoadedModel(None, None, "original", spec))

    def evaluate(loaded, tasks, settings, device, show_progress, baseline=None):
        res = copy.deepcopy(by_spec[loaded.spec])
        res["average"] = zeroshot.average(res)
        return res

    monkeypatch.setattr(runner, "evaluate_model", evaluate)
    payload = runner.run_eval(["A", "B"], ["piqa", "arc_easy"], EvalSettings(), "cpu", False)
    diff = payload["difference"]
    assert set(diff["piqa"]) == {"acc,none", "acc_norm,none"}  # no stderr, n-shot, seconds
    assert diff["piqa"]["acc,none"] == pytest.approx(-0.05)
    assert diff["average"]["acc_norm,none"] == pytest.approx(0.02)
    rows = runner._rows(payload["results"]["A"])
    assert ["piqa", "acc", 0.6, 0.01] in rows


# ---------------------------------------------------------------------------------------
# Equivalence with lm-eval's own HFLM on the demo model


def reference_requests(shared_data, name: str, index: int) -> tuple[list[tuple[str, str]], int]:
    """(context, continuation) pairs and gold index of one item, built from the raw file
    with the prompt lm-eval's task YAML documents (independently of qoqtool's loader)."""
    if name == "piqa":
        row = json.loads((shared_data / "piqa" / "valid.jsonl").read_text().splitlines()[index])
        gold = int((shared_data / "piqa" / "valid-labels.lst").read_text().split()[index])
        return [(f"Question: {row['goal']}\nAnswer:", " " + row[s]) for s in ("sol1", "sol2")], gold
    part = {"arc_easy": "Easy", "arc_challenge": "Challenge"}[name]
    row = json.loads((shared_data / "arc" / f"ARC-{part}-test.jsonl").read_text().splitlines()[index])
    gold = row["choices"]["label"].index(row["answerKey"])
    return [(f"Question: {row['question']}\nAnswer:", " " + t) for t in row["choices"]["text"]], gold


def qoqtool_loglikelihoods(model, tokenizer, shared_data, batch_size: int) -> dict:
    """{(task, doc index): (requests, log-likelihoods, acc)} through qoqtool's path."""
    manager, tasks = zeroshot.build_tasks(list(SAMPLE), str(shared_data))
    lm = zeroshot.scoring_lm(model, tokenizer, batch_size)
    out = {}
    for name, task in tasks.items():
        res = zeroshot.score(lm, manager, task, samples=SAMPLE[name], log_samples=True)
        for s in res["samples"][name]:
            requests = [tuple(a) for a in s["arguments"]]
            out[(name, s["doc_id"])] = (requests, [r[0][0] for r in s["resps"]], s["acc"])
    return out


@pytest.mark.slow
def test_loglikelihoods_equal_lm_eval_hflm(demo_model, shared_data):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    model, tokenizer = demo_model
    reference = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1)
    exact = qoqtool_loglikelihoods(model, tokenizer, shared_data, batch_size=1)
    batched = qoqtool_loglikelihoods(model, tokenizer, shared_data, batch_size=4)
    assert sorted(exact) == sorted((t, i) for t, ids in SAMPLE.items() for i in ids)
    for (name, index), (requests, ours, acc) in exact.items():
        pairs, gold = reference_requests(shared_data, name, index)
        assert requests == pairs, (name, index)
        instances = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
        ref = torch.tensor([ll for ll, _ in reference.loglikelihood(instances, disable_tqdm=True)])
        # Same requests, batch of one on both sides: the same computation.
        torch.testing.assert_close(torch.tensor(ours), ref, rtol=0, atol=1e-5)
        # Batched and padded: different matmul shapes round differently, by ~1e-7 relative.
        torch.testing.assert_close(torch.tensor(batched[(name, index)][1]), ref, rtol=1e-5, atol=1e-5)
        assert acc == float(int(ref.argmax()) == gold)


@pytest.mark.slow
def test_the_model_object_is_what_gets_scored(demo_model, shared_data):
    """KV4 on a copy of the demo model changes the scores: HFLM runs our module, not a reload."""
    from qoqtool.runtime.attention import enable_kv_quantization

    model, tokenizer = demo_model
    kv4 = copy.deepcopy(model)
    enable_kv_quantization(kv4, 4)
    manager, tasks = zeroshot.build_tasks(["piqa"], str(shared_data))
    lls = []
    for m in (model, kv4):
        res = zeroshot.score(zeroshot.scoring_lm(m, tokenizer, 4), manager, tasks["piqa"],
                             samples=SAMPLE["piqa"], log_samples=True)
        lls.append(torch.tensor([r[0][0] for s in res["samples"]["piqa"] for r in s["resps"]]))
    assert (lls[0] - lls[1]).abs().mean() > 1e-2


@pytest.mark.slow
def test_cli_eval_json_has_lm_eval_shape(tmp_path, shared_data):
    from tests.test_cli_errors import run_cli

    out = tmp_path / "res.json"
    proc = run_cli("eval", "smollm2-135m", "--tasks", "arc_easy", "--limit", "2", "--batch-size", "8",
                   "--data-dir", str(shared_data), "--json", str(out), "-q")
    assert proc.returncode == 0, proc.stderr
    entry = json.loads(out.read_text())["results"]["arc_easy"]
    assert entry["n-samples"] == {"original": 2376, "effective": 2}
    assert entry["n-shot"] == 0
    assert 0.0 <= entry["acc,none"] <= 1.0 and "acc_norm_stderr,none" in entry
    assert "acc_norm" in proc.stdout  # the table
