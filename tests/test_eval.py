"""Perplexity protocol, fidelity, and calibration data sources."""

import json
import math
from pathlib import Path

import pytest
import torch

from qoqtool.data import sources
from qoqtool.data.calibration import build_calibration, sample_synthetic, validate_args
from qoqtool.errors import UserError
from qoqtool.eval.fidelity import fidelity
from qoqtool.eval.perplexity import perplexity
from tests.conftest import tiny_model


def test_wikitext_rows_follow_the_hf_protocol():
    raw = " \n = Title = \n \n Some text . \n"
    rows = sources.wikitext_rows_from_raw(raw)
    assert rows == ["", " = Title = \n", "", " Some text . \n"]
    # joined with blank lines: a row's own newline plus the separator
    assert "\n\n".join(rows) == "\n\n = Title = \n" + "\n\n" + "\n\n" + " Some text . \n"


@pytest.mark.slow
def test_demo_wikitext2_protocol_and_perplexity(demo_model, shared_data):
    """148 windows / 304,986 tokens, and the first 20 windows within 0.5% of the published 20.967."""
    from qoqtool.eval.perplexity import wikitext2_test_ids

    model, tok = demo_model
    ids = wikitext2_test_ids(tok, str(shared_data))
    assert ids.numel() == 304_986 and ids.numel() // 2048 == 148
    res = perplexity(model, ids, 2048, max_windows=20)
    assert res["windows"] == 20 and res["tokens"] == 20 * 2048
    assert abs(res["ppl"] / 20.967 - 1) < 0.005, res["ppl"]


def test_perplexity_matches_a_direct_computation():
    model = tiny_model("llama", seed=7)
    ids = torch.randint(0, 128, (3 * 32 + 5,), generator=torch.Generator().manual_seed(0))
    res = perplexity(model, ids, seqlen=32)
    assert res["windows"] == 3 and res["tokens"] == 96  # the remainder is dropped
    nll = 0.0
    for w in range(3):
        x = ids[w * 32 : (w + 1) * 32]
        with torch.no_grad():
            logp = torch.log_softmax(model(x[None]).logits[0, :-1].float(), -1)
        nll -= float(logp.gather(1, x[1:, None]).sum())
    assert res["ppl"] == pytest.approx(float(torch.exp(torch.tensor(nll / (3 * 31)))), rel=1e-6)


@pytest.mark.parametrize("kv_bits", [16, 4])
@pytest.mark.parametrize("decode_batch", [1, 2, 3])
def test_perplexity_by_decoding_is_the_same_score(kv_bits, decode_batch):
    """--decode-batch scores the same windows token by token through the paged KV cache (its
    torch path on the CPU): the same perplexity as the full-window forward pass, up to float
    rounding (with KV4, both quantize each token's K and V alike), for any batching of the
    windows (3 windows in batches of 1, 2 + 1, 3). (The random model is confidently wrong,
    perplexity ~5e5, which magnifies any difference.)"""
    from qoqtool.runtime.attention import enable_kv_quantization
    from tests.test_kv_cache import tiny_decoder  # head_dim 64, as the paged cache needs

    model = tiny_decoder("llama", seed=7)
    if kv_bits < 16:
        enable_kv_quantization(model, kv_bits)
    ids = torch.randint(0, 512, (3 * 32 + 5,), generator=torch.Generator().manual_seed(0))
    full = perplexity(model, ids, seqlen=32)
    steps = []
    decoded = perplexity(model, ids, seqlen=32, decode_batch=decode_batch, progress=lambda *a: steps.append(a))
    assert decoded["windows"] == 3 and decoded["decode_batch"] == decode_batch
    # (an fp16 cache, KV16, rounds the K/V the fp32 forward pass keeps exact: looser there)
    assert decoded["ppl"] == pytest.approx(full["ppl"], rel=1e-5 if kv_bits < 16 else 5e-4)
    assert decoded["window_nll"] == pytest.approx(full["window_nll"], rel=1e-5 if kv_bits < 16 else 5e-4)  # window by window
    assert steps[-1] == ("decode steps", -(-3 // decode_batch) * 31, -(-3 // decode_batch) * 31)
    if kv_bits < 16:  # KV4 is really in both paths: without it the score moves
        plain = tiny_decoder("llama", seed=7)
        assert abs(perplexity(plain, ids, seqlen=32)["ppl"] / full["ppl"] - 1) > 1e-4


def test_perplexity_rejects_bad_arguments():
    model = tiny_model("llama")
    with pytest.raises(UserError, match="fewer than one"):
        perplexity(model, torch.arange(10), seqlen=32)
    with pytest.raises(UserError, match="--max-windows"):
        perplexity(model, torch.arange(100) % 128, seqlen=32, max_windows=0)
    with pytest.raises(UserError, match="--decode-batch"):
        perplexity(model, torch.arange(100) % 128, seqlen=32, decode_batch=0)
    with pytest.raises(UserError, match="head_dim 64 and 128, not 16.*--decode-batch"):  # (tiny_model: head_dim 16)
        perplexity(model, torch.arange(100) % 128, seqlen=32, decode_batch=2)


def test_fidelity_is_zero_against_itself_and_positive_against_a_quantized_copy():
    from qoqtool.calibration.pipeline import quantize_model
    from qoqtool.recipe import load_recipe

    model = tiny_model("qwen2", seed=2)
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    same = fidelity(model, model, tokens)
    assert same["kl"] == pytest.approx(0.0, abs=1e-6) and same["top1"] == 1.0
    quant = tiny_model("qwen2", seed=2)
    quantize_model(quant, load_recipe("rtn-w4a8kv4-g64"), tokens)
    res = fidelity(model, quant, tokens)
    assert res["kl"] > 1e-4 and res["top1"] < 1.0 and res["tokens"] == 2 * 23


def test_synthetic_calibration_is_deterministic_for_a_seed():
    model = tiny_model("llama", seed=3)
    a = sample_synthetic(model, 3, 12, seed=5)
    b = sample_synthetic(model, 3, 12, seed=5)
    c = sample_synthetic(model, 3, 12, seed=6)
    assert a.shape == (3, 12) and torch.equal(a, b) and not torch.equal(a, c)


def test_synthetic_text_stays_within_the_tokenizer():
    """An embedding padded past the tokenizer (Qwen2: 151936 rows, 151665 tokens): no draw or
    sample lands on the padding, even where the model favours it."""
    model = tiny_model("qwen2", seed=3)
    vocab = model.config.vocab_size
    real = vocab // 2
    with torch.no_grad():
        model.lm_head.bias = torch.nn.Parameter(torch.zeros(vocab))
        model.lm_head.bias[real:] = 50.0  # the padded rows would win every sample
    unbounded = sample_synthetic(model, 4, 10, seed=1)
    bounded = sample_synthetic(model, 4, 10, seed=1, tokens=real)
    assert int(unbounded.max()) >= real  # the check can fail
    assert int(bounded.max()) < real


class _CharTokenizer:
    """Enough of a tokenizer for the calibration builder: one id per character."""

    def __call__(self, text, return_tensors=None, add_special_tokens=False):
        class Out:
            input_ids = torch.tensor([[ord(c) % 128 for c in text]])

        return Out()


def test_calibration_from_local_files(tmp_path):
    txt = tmp_path / "corpus.txt"
    txt.write_text("hello world " * 100)
    jl = tmp_path / "corpus.jsonl"
    jl.write_text("\n".join(json.dumps({"text": f"document {i} " * 20}) for i in range(20)))
    for path in (txt, jl):
        calib = build_calibration(str(path), _CharTokenizer(), 4, 16, seed=1)
        assert calib.tokens.shape == (4, 16)
        again = build_calibration(str(path), _CharTokenizer(), 4, 16, seed=1)
        assert calib.sha256 == again.sha256
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"content": "no text field"}\n')
    with pytest.raises(UserError, match='"text" field'):
        build_calibration(str(bad), _CharTokenizer(), 1, 8)
    bad.write_text('{"text": "fine"}\n{"text": null}\n')
    with pytest.raises(UserError, match='bad.jsonl:2: "text" is NoneType, not a string'):
        build_calibration(str(bad), _CharTokenizer(), 1, 8)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café au lait ".encode("latin-1") * 50)
    with pytest.raises(UserError, match="latin1.txt is not UTF-8 text .byte 3"):
        build_calibration(str(latin1), _CharTokenizer(), 1, 8)
    csv = tmp_path / "corpus.csv"
    csv.write_text("a,b\n")
    with pytest.raises(UserError, match="corpus.csv must be .txt or .jsonl"):
        validate_args(str(csv), 1, 8)  # (what quantize checks before it loads the model)
    with pytest.raises(UserError, match="only"):
        build_calibration(str(txt), _CharTokenizer(), 1, 5000)


def test_calibration_from_the_data_dir(shared_data):
    calib = build_calibration("wikitext2", _CharTokenizer(), 2, 64, seed=0, data_dir=str(shared_data))
    assert calib.tokens.shape == (2, 64) and calib.describe()["source"] == "wikitext2"


def test_missing_data_dir_files_are_named(tmp_path):
    with pytest.raises(UserError, match="wikitext-2-raw/wiki.valid.raw"):
        build_calibration("wikitext2", _CharTokenizer(), 2, 64, data_dir=str(tmp_path))


def test_comparing_two_models_reports_fidelity_for_b(monkeypatch, capsys):
    """eval A B --tasks fidelity: fidelity is B measured against A, so its rows show B's values
    with A and B - A left empty (they were dropped, leaving an empty table), and no difference."""
    from qoqtool.calibration.pipeline import quantize_model
    from qoqtool.eval import runner
    from qoqtool.eval.tasks import EvalSettings
    from qoqtool.recipe import load_recipe
    from qoqtool.runtime.loading import LoadedModel

    original, quant = tiny_model("qwen3", seed=2), tiny_model("qwen3", seed=2)
    quantize_model(quant, load_recipe("rtn-w4a8kv4-g64"), torch.randint(0, 128, (2, 24)))
    models = {"a": LoadedModel(original, None, "original", "a"), "b": LoadedModel(quant, None, "quantized", "b")}
    monkeypatch.setattr(runner, "load_any", lambda spec, device, dtype: models[spec])
    res = runner.run_eval(["a", "b"], ["fidelity"], EvalSettings(fidelity_samples=2, fidelity_seqlen=16), "cpu", False)
    assert res["results"]["a"] == {} and res["difference"] == {}
    assert 0 < res["results"]["b"]["fidelity"]["kl"] and res["results"]["b"]["fidelity"]["original"] == "a"
    table = capsys.readouterr().out
    assert "kl" in table and "top1" in table


def test_eval_loads_models_in_the_asked_dtype(monkeypatch):
    """--dtype reaches the loader for every model, and the original that fidelity compares with."""
    from qoqtool.eval import runner
    from qoqtool.eval.tasks import EvalSettings
    from qoqtool.runtime.loading import LoadedModel

    asked = []

    def load_any(spec, device, dtype):
        asked.append((spec, dtype))
        model = tiny_model("llama", seed=3).to(getattr(torch, dtype))
        return LoadedModel(model, None, "original" if spec == "a" else "packed", spec, {"source_model": "a"})

    monkeypatch.setattr(runner, "load_any", load_any)
    runner.run_eval(["b"], ["fidelity"], EvalSettings(fidelity_samples=1, fidelity_seqlen=8, dtype="bfloat16"), "cpu", False)
    assert asked == [("b", "bfloat16"), ("a", "bfloat16")]


def test_paired_ratio_is_the_perplexity_ratio_with_the_windows_spread():
    """B / A of two results of the same windows is exactly ppl_B / ppl_A; its error is the spread
    of the per-window differences (zero when B is A shifted by the same amount in every window),
    not of the windows' own NLLs."""
    from qoqtool.eval.perplexity import _result, paired_ratio

    a = _result([310.0, 250.0, 420.0, 180.0], seqlen=101)
    shifted = _result([n + 2.0 for n in a["window_nll"]], seqlen=101)
    ratio, stderr = paired_ratio(a, shifted)
    assert ratio == pytest.approx(shifted["ppl"] / a["ppl"], rel=1e-12) and ratio == pytest.approx(math.exp(0.02))
    assert stderr == pytest.approx(0.0, abs=1e-12)
    noisy = _result([311.0, 249.0, 422.0, 180.0], seqlen=101)
    d = [0.01, -0.01, 0.02, 0.0]  # per-token differences per window
    mean = sum(d) / 4
    ratio, stderr = paired_ratio(a, noisy)
    assert ratio == pytest.approx(math.exp(mean))
    assert stderr == pytest.approx(math.exp(mean) * (sum((x - mean) ** 2 for x in d) / 3 / 4) ** 0.5)
    assert paired_ratio(_result([5.0], 11), _result([6.0], 11))[1] is None
    with pytest.raises(ValueError, match="same windows"):
        paired_ratio(a, _result([1.0, 2.0], seqlen=101))


def test_compare_ppl_prints_the_ratio_of_each_block_of_windows(tmp_path, monkeypatch, capsys):
    """benchmarks/compare_ppl.py --blocks 2: the whole sample's ratio, then each pair of windows'
    own (here 1% and 2% more NLL per token in the first pair, none in the second)."""
    import runpy

    from qoqtool.eval.perplexity import _result

    a, b = [100.0, 200.0, 150.0, 120.0], [101.0, 202.0, 150.0, 120.0]  # seqlen 101: 100 scored tokens
    for name, nll in (("a", a), ("b", b)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"results": {"wikitext2": _result(nll, seqlen=101)}}))
    script = str(Path(__file__).parents[1] / "benchmarks" / "compare_ppl.py")
    monkeypatch.setattr("sys.argv", [script, str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--blocks", "2"])
    runpy.run_path(script, run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    whole = 100 * (math.exp(0.03 / 4) - 1)
    assert f"{whole:+.3f}%" in lines[2]
    assert lines[3].split("|")[1].split() == [f"{100 * (math.exp(0.015) - 1):+.2f}%", "+0.00%"]


def test_comparing_two_models_reports_the_paired_perplexity_ratio(monkeypatch):
    from qoqtool.eval import runner
    from qoqtool.eval.perplexity import _result
    from qoqtool.eval.tasks import EvalSettings
    from qoqtool.runtime.loading import LoadedModel

    monkeypatch.setattr(runner, "load_any", lambda spec, device, dtype: LoadedModel(spec, None, "original", spec))
    monkeypatch.setattr(runner, "wikitext2_test_ids", lambda tokenizer, data_dir: None)
    nll = {"a": [100.0, 120.0, 90.0], "b": [101.0, 122.0, 90.0]}
    monkeypatch.setattr(runner, "perplexity", lambda model, *args: _result(nll[model], seqlen=11))
    res = runner.run_eval(["a", "b"], ["wikitext2"], EvalSettings(), "cpu", False)
    diff = res["difference"]["wikitext2"]
    assert diff["ppl_ratio"] == pytest.approx(res["results"]["b"]["wikitext2"]["ppl"] / res["results"]["a"]["wikitext2"]["ppl"])
    assert diff["ppl_ratio_stderr"] > 0
