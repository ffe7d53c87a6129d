"""fp16 outliers through `qoqtool pack`: Tile-COO in the packed folder, identical outputs,
`pack --outliers` after the fact, damaged sections refused, bad budgets, the size report.

Tiny random models (the helpers of test_packing_folder.py); the `slow` test packs the demo
model with outliers and checks its perplexity against the quantized folder's.
"""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_packing_folder import WEIGHTS, _copy, adhoc_recipe, assert_one_line_error, assert_round_trip, cli, tiny_qwen2
from test_packing_folder import quantize_to as quantize_folder

from qoqtool.errors import UserError
from qoqtool.packing import folder as fs
from qoqtool.packing import packed, quantized, tile_coo
from qoqtool.quantizers.outliers import parse_outliers
from qoqtool.recipe import load_recipe, recipe_from_dict
from qoqtool.runtime.loading import load_quantized_folder
from qoqtool.runtime.packed_linear import PackedLinear

TOKENS = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
IDS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))


def quantize_to(model, recipe, out: Path, outliers=None, keep_float_weights=False, tokenizer=None, source="tiny",
                tokens=TOKENS) -> Path:
    budget = None if outliers is None else parse_outliers(*outliers)
    return quantize_folder(model, recipe, out, tokens, tokenizer, source, outliers=budget,
                           keep_float_weights=keep_float_weights)


def logits(folder: Path, ids=IDS) -> torch.Tensor:
    man = fs.read_manifest(folder)
    load = packed.load_packed_folder if man["format"] == packed.FORMAT else load_quantized_folder
    with torch.no_grad():
        return load(folder, man)(ids).logits


def tiny_llama_128():
    """A tiny Llama whose K (128, 160) spans whole and partial groups of 128."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama", hidden_size=128, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=128, max_position_embeddings=256,
    )
    config.architectures = ["LlamaForCausalLM"]
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


# -- quantize --outliers, then pack ------------------------------------------------------------
@pytest.fixture(scope="module")
def with_outliers(tmp_path_factory):
    """name -> (quantized folder with 2% outliers, its packed folder) for each weight format."""
    root = tmp_path_factory.mktemp("outliers")
    folders = {}
    for name, weights in WEIGHTS.items():
        qdir = quantize_to(tiny_qwen2(), adhoc_recipe(name, weights), root / f"q-{name}", ("2%",))
        packed.pack_folder(str(qdir), str(root / f"p-{name}"))
        folders[name] = (qdir, root / f"p-{name}")
    return folders


@pytest.mark.parametrize("name", list(WEIGHTS))
def test_packed_outliers_give_identical_logits(with_outliers, name):
    qdir, pdir = with_outliers[name]
    assert assert_round_trip(qdir, pdir) == 14
    kept = quantized.load_outliers(qdir, fs.read_manifest(qdir))
    assert len(kept) == 14 and sum(s.nnz for s in kept.values()) > 0
    model = packed.load_packed_folder(pdir, fs.read_manifest(pdir))
    for lname, sparse in kept.items():
        module = model.get_submodule(lname)
        assert isinstance(module, PackedLinear) and module.has_outliers
        back = module.sparse()
        assert torch.equal(back.rows, sparse.rows) and torch.equal(back.cols, sparse.cols)
        assert torch.equal(back.values.view(torch.int16), sparse.values.view(torch.int16))
    assert torch.equal(logits(pdir), logits(qdir))


def test_outliers_change_the_packed_output(with_outliers, tmp_path):
    """The sparse term is really applied: dropping the sections changes the logits."""
    qdir, pdir = with_outliers["uint4-g64"]
    plain = _copy(pdir, tmp_path / "plain")
    tensors = {k: v for k, v in load_file(str(plain / "model.safetensors")).items() if ".tc_" not in k}
    _rewrite(plain, tensors, lambda man: man.update(outliers=None))
    assert not torch.equal(logits(plain), logits(pdir))


def test_manifest_outliers_section(with_outliers):
    qdir, pdir = with_outliers["prog-g32"]
    qman, man = fs.read_manifest(qdir), fs.read_manifest(pdir)
    assert man["format_version"] == packed.FORMAT_VERSION == 5
    section = man["outliers"]
    assert section["format"] == tile_coo.FORMAT and section["chosen_by"] == "quantize"
    assert section["budget"] == {"kind": "fraction", "value": 0.02, "scope": "layer", "quads": True}
    assert section["count"] == qman["outliers"]["count"] == sum(v["nnz"] for v in section["linears"].values())
    tensors = load_file(str(pdir / packed.WEIGHTS_FILE))
    for lname, meta in section["linears"].items():
        entries = tensors[f"{lname}.tc_entries"]
        assert entries.shape == (meta["entries"], 16)
        assert meta["bits"] == 8 * sum(tensors[f"{lname}.{b}"].numel() * tensors[f"{lname}.{b}"].element_size()
                                       for b in ("tc_entries", "tc_start", "tc_count"))
    size, st = man["size"], section["storage"]
    assert size["linear_bytes"]["outliers"] * 8 == sum(v["bits"] for v in section["linears"].values())
    assert size["total_bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
    weights = size["quantized_weights"]
    assert st["bits_per_weight_dense"] == pytest.approx(size["bits_per_weight"])
    assert st["bits_per_weight_with_outliers"] == pytest.approx(size["bits_per_weight_with_outliers"])
    assert st["bits_per_weight_with_outliers"] - st["bits_per_weight_dense"] == pytest.approx(
        st["bits_per_outlier"] * st["outliers"] / weights)
    assert not (pdir / quantized.OUTLIERS_FILE).exists()  # moved into model.safetensors


def test_info_reports_outliers(with_outliers, tmp_path, capsys):
    qdir, pdir = with_outliers["uint4-chn"]
    code, out, err = cli(capsys, "info", str(pdir), "--json", str(tmp_path / "info.json"))
    assert code == 0, err
    assert "bits / outlier" in out and "as CSR" in out and "bits / weight + outliers" in out
    report = json.loads((tmp_path / "info.json").read_text())
    assert report["outliers"]["count"] == fs.read_manifest(qdir)["outliers"]["count"]
    code, out, err = cli(capsys, "info", str(qdir))
    assert code == 0, err
    assert f"{report['outliers']['count']:,} fp16" in out


def test_version_1_folders_still_load(tmp_path):
    qdir = quantize_to(tiny_qwen2(), adhoc_recipe("prog", WEIGHTS["prog-g32"]), tmp_path / "q")
    pdir = tmp_path / "p"
    packed.pack_folder(str(qdir), str(pdir))
    man = fs.read_manifest(pdir)
    assert man["outliers"] is None
    man["format_version"] = 1
    (pdir / fs.MANIFEST).unlink()
    fs.write_manifest(pdir, man)
    assert torch.equal(logits(pdir), logits(qdir))


# -- pack --outliers after the fact ------------------------------------------------------------
@pytest.fixture(scope="module")
def rtn_g128(tmp_path_factory):
    """An RTN w4a16 g128 folder without outliers (float weights kept) and the float model."""
    root = tmp_path_factory.mktemp("rtn")
    qdir = quantize_to(tiny_llama_128(), load_recipe("rtn-w4a16-g128"), root / "q", keep_float_weights=True)
    return qdir, tiny_llama_128()


def test_pack_outliers_after_the_fact(rtn_g128, tmp_path, capsys):
    qdir, float_model = rtn_g128
    code, out, err = cli(capsys, "pack", str(qdir), "-o", str(tmp_path / "p"), "--outliers", "1%")
    assert code == 0, err
    assert "bits / outlier" in out
    man = fs.read_manifest(tmp_path / "p")
    section = man["outliers"]
    assert (section["chosen_by"], section["refit"]) == ("pack", True)  # RTN: grids re-fitted
    # 1% in every linear: round(0.01 N K) each, as parse_outliers defines a share
    budget = parse_outliers("1%")
    for name, meta in man["linears"].items():
        n, k = meta["shape"]
        assert section["linears"][name]["nnz"] == budget.total(n * k) == int(0.01 * n * k + 0.5)
    assert section["count"] == sum(budget.total(m["shape"][0] * m["shape"][1]) for m in man["linears"].values())
    err_before, err_after = section["mean_output_rel_error"]["without"], section["mean_output_rel_error"]["with"]
    assert err_after < 0.97 * err_before

    # and the model's outputs move towards the float model's
    packed.pack_folder(str(qdir), str(tmp_path / "plain"))
    with torch.no_grad():
        ref = float_model(IDS).logits
    plain = (logits(tmp_path / "plain") - ref).pow(2).mean()
    kept = (logits(tmp_path / "p") - ref).pow(2).mean()
    assert kept < plain


def test_pack_outliers_keeps_gptq_codes(tmp_path):
    """A GPTQ folder keeps its dense codes; the outliers come on top."""
    recipe = recipe_from_dict({"name": "g", "weights": {"bits": 4, "scheme": "asymmetric", "group_size": 32},
                               "activations": {"bits": 8}, "kv_cache": {"bits": 4}, "steps": [{"gptq": {}}]})
    qdir = quantize_to(tiny_qwen2(), recipe, tmp_path / "q", keep_float_weights=True)
    packed.pack_folder(str(qdir), str(tmp_path / "p"), parse_outliers("300", "global"))
    man = fs.read_manifest(tmp_path / "p")
    assert man["outliers"]["refit"] is False and man["outliers"]["count"] == 300
    assert assert_round_trip(qdir, tmp_path / "p") == 14  # the same codes, bit for bit
    assert man["outliers"]["mean_output_rel_error"]["with"] < man["outliers"]["mean_output_rel_error"]["without"]


@pytest.mark.parametrize("steps, words", [
    ([{"rotate": {}}], "quantized with transforms (rotate)"),  # the original weights would not do
    ([], "the original model 'tiny-nowhere'"),  # RTN: the original model's, which cannot be found here
])
def test_pack_outliers_needs_float_weights(tmp_path, capsys, steps, words):
    recipe = recipe_from_dict({"name": "s", "weights": {"bits": 4, "scheme": "asymmetric", "group_size": 32},
                               "activations": {"bits": 8}, "kv_cache": {"bits": 4}, "steps": steps})
    qdir = quantize_to(tiny_qwen2(), recipe, tmp_path / "q", source="tiny-nowhere")
    code, _, err = cli(capsys, "pack", str(qdir), "-o", str(tmp_path / "p"), "--outliers", "1%")
    assert_one_line_error(code, err, words, "--keep-float-weights")
    assert not (tmp_path / "p").exists()


def test_pack_outliers_refuses_a_folder_with_outliers(with_outliers, tmp_path, capsys):
    qdir, _ = with_outliers["int8"]
    code, _, err = cli(capsys, "pack", str(qdir), "-o", str(tmp_path / "p"), "--outliers", "1%")
    assert_one_line_error(code, err, "already keeps", "fp16 outliers (quantize --outliers)")
    assert not (tmp_path / "p").exists()


# -- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, words", [
    ("150%", "between 0% and 100%"),
    ("-1", "cannot be negative"),
    ("abc", "is not a budget"),
])
@pytest.mark.parametrize("command", ["pack", "quantize"])
def test_bad_outlier_specs(with_outliers, tmp_path, capsys, command, spec, words):
    qdir, _ = with_outliers["int8"]
    args = [str(qdir)] if command == "pack" else ["smollm2-135m", "-r", "rtn-w4a16-g128"]
    code, _, err = cli(capsys, command, *args, "-o", str(tmp_path / "x"), f"--outliers={spec}")
    assert_one_line_error(code, err, words)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("command", ["pack", "quantize"])
def test_bad_outlier_budget_scope(with_outliers, tmp_path, capsys, command):
    qdir, _ = with_outliers["int8"]
    args = [str(qdir)] if command == "pack" else ["smollm2-135m", "-r", "rtn-w4a16-g128"]
    code, _, err = cli(capsys, command, *args, "-o", str(tmp_path / "x"), "--outliers", "1%", "--outliers-budget", "model")
    assert_one_line_error(code, err, "--outliers-budget", "global")
    code, _, err = cli(capsys, command, *args, "-o", str(tmp_path / "x"), "--outliers-budget", "global")
    assert_one_line_error(code, err, "needs --outliers")
    assert not (tmp_path / "x").exists()


def _rewrite(d: Path, tensors: dict, edit_manifest=None) -> None:
    """Replace model.safetensors and re-record its checksums: damage that the sha256 check
    cannot catch (a buggy writer), so the validator must."""
    save_file(tensors, str(d / "new.safetensors"))
    os.replace(d / "new.safetensors", d / "model.safetensors")
    man = fs.read_manifest(d)
    man["files"]["model.safetensors"] = fs.tensor_records(tensors)
    if edit_manifest:
        edit_manifest(man)
    (d / fs.MANIFEST).unlink()
    fs.write_manifest(d, man)


def _busiest_bucket(tensors: dict, name: str) -> int:
    return int(torch.argmax(tensors[f"{name}.tc_count"].flatten()))


def _offsets_past_entries(tensors, name):
    start = tensors[f"{name}.tc_start"].clone()
    start.view(-1)[_busiest_bucket(tensors, name)] = tensors[f"{name}.tc_entries"].shape[0]
    tensors[f"{name}.tc_start"] = start


def _row_outside_tile(tensors, name):
    entries = tensors[f"{name}.tc_entries"].clone()
    entries[0, 8] = 200  # a tile-local row past the 32-row tile
    tensors[f"{name}.tc_entries"] = entries


def _column_outside_tile(tensors, name):
    entries = tensors[f"{name}.tc_entries"].clone()
    entries[-1, 12] = 64  # a bucket-local column past the 64-column bucket
    tensors[f"{name}.tc_entries"] = entries


DAMAGES = {
    "offsets past entries": (_offsets_past_entries, "runs past"),
    "row outside tile": (_row_outside_tile, "outside its tile"),
    "column outside tile": (_column_outside_tile, "outside its tile"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_tile_coo_is_refused(with_outliers, tmp_path, capsys, damage):
    spoil, words = DAMAGES[damage]
    d = _copy(with_outliers["prog-g32"][1], tmp_path / "damaged")
    tensors = load_file(str(d / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj"
    spoil(tensors, name)
    _rewrite(d, tensors)
    with pytest.raises(UserError, match=f"Tile-COO outliers of {name} are damaged.*{words}"):
        packed.load_packed_folder(d, fs.read_manifest(d))
    code, _, err = cli(capsys, "eval", str(d), "--tasks", "fidelity")
    assert_one_line_error(code, err, "damaged", words)


def test_entries_count_must_match_the_manifest(with_outliers, tmp_path):
    d = _copy(with_outliers["prog-g32"][1], tmp_path / "damaged")
    tensors = load_file(str(d / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj"
    tensors[f"{name}.tc_entries"] = tensors[f"{name}.tc_entries"][:-1].clone()
    _rewrite(d, tensors)
    with pytest.raises(UserError, match="does not match its config"):
        packed.load_packed_folder(d, fs.read_manifest(d))


# -- CUDA (the stopgap sparse term after the dense kernel) ------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and the kernel library")
@pytest.mark.parametrize("name", ["prog-g32", "uint4-chn", "int8"])
def test_cuda_adds_the_outliers_after_the_dense_kernel(with_outliers, name):
    from qoqtool.runtime import packed_linear
    from qoqtool.runtime.reference import QuantLinear

    _, pdir = with_outliers[name]
    module = packed.load_packed_folder(pdir, fs.read_manifest(pdir)).get_submodule("model.layers.0.mlp.down_proj")
    x = torch.randn(5, module.in_features, generator=torch.Generator().manual_seed(2)).half()
    with torch.no_grad():
        ref = module(x.float())  # the exact CPU reference, outliers included
        dense = QuantLinear(module.unpacked(), module.bias, module.act_bits)(x.float())
        y = module.cuda()(x.cuda()).float().cpu()
    assert packed_linear._kernels() is not None and module.use_kernels, "the kernel path did not run"
    sparse = (ref - dense).norm()
    assert sparse > 0.01 * ref.norm()  # the outliers matter here, so the check below can fail
    assert (y - ref).norm() <= 0.05 * sparse  # fp16 output rounding; without the term it would be 1x


# -- the demo model ------------------------------------------------------------------------------
@pytest.mark.slow
def test_demo_packed_outliers_perplexity_equals_quantized(demo_model, shared_data, tmp_path):
    """The demo model with 1% outliers (RTN W4A8KV4 progressive g128): the packed folder
    scores the quantized folder's perplexity, and every section round trips."""
    import copy

    from qoqtool.data.calibration import build_calibration
    from qoqtool.eval.perplexity import perplexity, wikitext2_test_ids
    from qoqtool.runtime.loading import load_any

    model, tokenizer = demo_model
    calib = build_calibration("wikitext2", tokenizer, 4, 128, 0, str(shared_data))
    recipe = adhoc_recipe("adhoc-progressive-g128", {"bits": 4, "scheme": "progressive", "group_size": 128})
    qdir = quantize_to(copy.deepcopy(model), recipe, tmp_path / "q", ("1%",), tokenizer=tokenizer,
                       source="smollm2-135m", tokens=calib.tokens)
    report = packed.pack_folder(str(qdir), str(tmp_path / "p"))
    assert report["outliers"]["count"] == fs.read_manifest(qdir)["outliers"]["count"] > 0
    assert report["outliers"]["storage"]["bits_per_outlier"] <= 40
    a, b = load_any(str(qdir)), load_any(str(tmp_path / "p"))
    ids = wikitext2_test_ids(a.tokenizer, str(shared_data))
    ppl_q = perplexity(a.model, ids, seqlen=256, max_windows=2)["ppl"]
    ppl_p = perplexity(b.model, ids, seqlen=256, max_windows=2)["ppl"]
    assert abs(ppl_p - ppl_q) <= 1e-6 * ppl_q
