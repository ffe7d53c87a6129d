"""Packed folders: `qoqtool pack` round trips, equal outputs, the size report, bad input.

Fast tests use a tiny random Qwen2 model (biases on q/k/v, tied embeddings, N and K off
the 32-tile); the `slow` ones quantize the demo model (RTN, 4 x 128 calibration tokens).
"""

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qoqtool.cli import main
from qoqtool.errors import UserError
from qoqtool.packing import folder as fs
from qoqtool.packing import packed, quantized
from qoqtool.packing.layout import PackedLayout
from qoqtool.recipe import load_recipe, recipe_from_dict
from qoqtool.runtime.loading import load_quantized_folder
from qoqtool.runtime.packed_linear import PackedLinear

WEIGHTS = {
    "prog-g32": {"bits": 4, "scheme": "progressive", "group_size": 32},
    "uint4-chn": {"bits": 4, "scheme": "asymmetric", "group_size": None},
    "uint4-g64": {"bits": 4, "scheme": "asymmetric", "group_size": 64},
    "int8": {"bits": 8, "scheme": "symmetric", "group_size": None},
}


def adhoc_recipe(name: str, weights: dict, act_bits: int = 8):
    return recipe_from_dict({"name": name, "weights": weights, "activations": {"bits": act_bits},
                             "kv_cache": {"bits": 4}, "steps": []})


def tiny_qwen2():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "qwen2", hidden_size=64, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=256, tie_word_embeddings=True,
    )
    config.architectures = ["Qwen2ForCausalLM"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name:
                p.normal_(0, 0.1)
    return model


def quantize_to(model, recipe, out: Path, tokens: torch.Tensor, tokenizer=None, source="tiny", **options) -> Path:
    """Quantize (options go to quantize_model) and save the folder."""
    from qoqtool.calibration.pipeline import quantize_model

    result = quantize_model(model, recipe, tokens, **options)
    return quantized.save(result, tokenizer, str(out), source, {"source": "test", "samples": tokens.shape[0]})


def cli(capsys, *args) -> tuple[int, str, str]:
    """Run the CLI in-process: (exit code, stdout, stderr)."""
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code, err, *words):
    assert code == 2, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], lines[0]


def assert_round_trip(qdir: Path, pdir: Path) -> int:
    """Every linear of the packed file unpacks bit for bit to the quantized folder's tensors."""
    qman, pman = fs.read_manifest(qdir), fs.read_manifest(pdir)
    weights, _ = quantized.load_weights(qdir, qman)
    stored = load_file(str(pdir / packed.WEIGHTS_FILE))
    for name, w in weights.items():
        lay = PackedLayout.from_meta(pman["linears"][name])
        back = lay.unpack({key: stored[f"{name}.{key}"] for key in lay.spec()})
        assert back.meta() == w.meta(), name
        for key, t in w.tensors().items():
            assert torch.equal(back.tensors()[key], t), f"{name}.{key}"
    return len(weights)


# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    """name -> (quantized folder, packed folder) for each weight format, from one tiny model."""
    root = tmp_path_factory.mktemp("packing")
    tokens = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    folders = {}
    for name, weights in WEIGHTS.items():
        qdir = quantize_to(tiny_qwen2(), adhoc_recipe(name, weights), root / f"q-{name}", tokens)
        packed.pack_folder(str(qdir), str(root / f"p-{name}"))
        folders[name] = (qdir, root / f"p-{name}")
    return folders


@pytest.mark.parametrize("name", list(WEIGHTS))
def test_tiny_round_trip_and_identical_logits(tiny_folders, name):
    qdir, pdir = tiny_folders[name]
    assert assert_round_trip(qdir, pdir) == 14
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = load_quantized_folder(qdir, fs.read_manifest(qdir))(ids).logits
        model = packed.load_packed_folder(pdir, fs.read_manifest(pdir))
        out = model(ids).logits
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == 14
    assert torch.equal(out, ref)


def test_eval_counts_the_packed_linears_calls_by_path(tiny_folders):
    """What `qoqtool eval` reports under its results (and as linear_paths in --json): the calls
    of packed linears by path while a model is evaluated - on the CPU, all the reference path."""
    from qoqtool.eval import runner

    model = packed.load_packed_folder(tiny_folders["prog-g32"][1], fs.read_manifest(tiny_folders["prog-g32"][1]))
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        res, paths = runner.counting_linear_paths(lambda: {"forwards": [model(ids) for _ in range(3)]})
    assert len(res["forwards"]) == 3 and paths == {"reference path": 3 * 14}
    _, paths = runner.counting_linear_paths(lambda: {})  # counts start afresh for each model
    assert paths == {}


@pytest.mark.parametrize("recipe", ["qoq-w4a8kv4-g128", "qoq-w4a8kv4-chn"])
def test_tiny_qoq_recipes_pack_exactly(tmp_path, recipe):
    """The full QoQ pipelines (rotation unties the embeddings, smoothing, reordering, GPTQ)."""
    from qoqtool.recipe import known_recipes

    if recipe not in known_recipes():
        pytest.skip(f"recipe {recipe} is not bundled")
    tokens = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    qdir = quantize_to(tiny_qwen2(), load_recipe(recipe), tmp_path / "q", tokens)
    packed.pack_folder(str(qdir), str(tmp_path / "p"))
    assert assert_round_trip(qdir, tmp_path / "p") == 14
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = load_quantized_folder(qdir, fs.read_manifest(qdir))(ids).logits
        out = packed.load_packed_folder(tmp_path / "p", fs.read_manifest(tmp_path / "p"))(ids).logits
    assert torch.equal(out, ref)


def test_online_down_rotation_survives_save_and_pack(tmp_path):
    """A recipe that rotates down_proj's input online: the saved and the packed folder rebuild
    the rotation from the manifest's recipe, and compute what the model did in memory up to
    the folder's fp16 storage of the float tensors (1.7% here, with or without the rotation);
    a different rotation would be far off."""
    raw = load_recipe("qoq-w4a8kv4-g128").to_dict()
    raw["steps"] = [{"rotate": {"seed": 1, "down_hadamard": True}}, {"gptq": {}}]
    tokens = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    model = tiny_qwen2()
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    from qoqtool.calibration.pipeline import quantize_model

    result = quantize_model(model, recipe_from_dict(raw), tokens)
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    qdir = quantized.save(result, None, str(tmp_path / "q"), "tiny", {"source": "test", "samples": 4})
    packed.pack_folder(str(qdir), str(tmp_path / "p"))
    with torch.no_grad():
        saved = load_quantized_folder(qdir, fs.read_manifest(qdir))
        assert sum(hasattr(m, "qoq_down_rotation") for m in saved.modules()) == 2
        ref = saved(ids).logits
        out = packed.load_packed_folder(tmp_path / "p", fs.read_manifest(tmp_path / "p"))(ids).logits
        for m in saved.modules():
            if hasattr(m, "qoq_down_rotation"):
                m.qoq_down_rotation.signs.neg_()  # another rotation
        wrong = saved(ids).logits
    rel = lambda a: float((a - want).norm() / want.norm())  # noqa: E731
    assert torch.equal(out, ref) and rel(ref) < 0.03 and rel(wrong) > 0.1, (rel(ref), rel(wrong))


def test_manifest_and_files(tiny_folders):
    qdir, pdir = tiny_folders["prog-g32"]
    qman, man = fs.read_manifest(qdir), fs.read_manifest(pdir)
    assert (man["format"], man["format_version"], man["float_dtype"]) == ("qoqtool-packed", 5, "float16")
    assert man["outliers"] is None
    assert man["recipe"] == qman["recipe"] and man["calibration"] == qman["calibration"]
    gate = man["linears"]["model.layers.0.mlp.gate_proj"]
    assert gate["shape"] == [72, 64] and gate["n_padded"] == 96 and gate["k_padded"] == 64
    assert man["linears"]["model.layers.0.self_attn.q_proj"]["bias"] is True
    tensors = load_file(str(pdir / packed.WEIGHTS_FILE))
    assert fs.tensor_records(tensors) == man["files"][packed.WEIGHTS_FILE]
    floats = [k for k in tensors if k.rpartition(".")[0] not in man["linears"] or k.endswith(".bias")]
    assert floats and all(tensors[k].dtype == torch.float16 for k in floats)
    assert "lm_head.weight" not in tensors  # tied: stored once, as the embeddings
    assert (pdir / "calib_stats.safetensors").read_bytes() == (qdir / "calib_stats.safetensors").read_bytes()
    assert (pdir / "config.json").read_bytes() == (qdir / "config.json").read_bytes()


def test_size_counts_the_stored_bytes(tiny_folders):
    _, pdir = tiny_folders["prog-g32"]
    size = fs.read_manifest(pdir)["size"]
    tensors = load_file(str(pdir / packed.WEIGHTS_FILE))
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert size["total_bytes"] == nbytes
    codes = sum(t.numel() for k, t in tensors.items() if k.endswith(".qweight"))
    assert size["linear_bytes"]["codes"] == codes
    # down_proj: K = 72 padded to 96 (g32) in 2 linears; gate/up: N = 72 padded to 96.
    assert size["padding_by_in_features"]["72"] == {
        "k_padded": 96, "linears": 2, "logical_weights": 2 * 64 * 72, "stored_weights": 2 * 64 * 96, "padding_share": 96 / 72 - 1,
    }
    assert size["float_bytes"]["embeddings"] == 128 * 64 * 2


def test_info_cli(tiny_folders, tmp_path, capsys):
    _, pdir = tiny_folders["uint4-chn"]
    code, out, err = cli(capsys, "info", str(pdir), "--json", str(tmp_path / "info.json"))
    assert code == 0, err
    assert "w4 asymmetric per-channel" in out and "same model in fp16" in out
    report = json.loads((tmp_path / "info.json").read_text())
    assert report["format"] == "qoqtool-packed" and report["formats"] == {"uint4 per-channel": 14}
    assert report["size"]["bits_per_stored_weight"] == pytest.approx(report["bits_per_stored_weight"])


def test_info_verify_checks_every_file(tiny_folders, tmp_path, capsys):
    """--verify reads the files info otherwise only lists: a flipped byte in the quantized
    folder's calibration statistics is found there, in one line and exit 2."""
    qdir, pdir = tiny_folders["prog-g32"]
    for d in (qdir, pdir):
        code, out, err = cli(capsys, "info", str(d), "--verify", "--json", str(tmp_path / "v.json"))
        assert code == 0, err
        counts = json.loads((tmp_path / "v.json").read_text())["verified"]
        assert counts == {f: len(r) for f, r in fs.read_manifest(d)["files"].items()} and "match the manifest" in out
    bad = _copy(qdir, tmp_path / "bad")
    stats = bytearray((bad / "calib_stats.safetensors").read_bytes())
    stats[-3] ^= 0x10
    (bad / "new").write_bytes(bytes(stats))
    os.replace(bad / "new", bad / "calib_stats.safetensors")
    assert cli(capsys, "info", str(bad))[0] == 0  # without --verify the files are listed, not read
    code, out, err = cli(capsys, "info", str(bad), "--verify")
    assert code == 2 and "calib_stats.safetensors: tensor" in err and "sha256" in err and len(err.strip().splitlines()) == 1
    manifest = json.loads((bad / fs.MANIFEST).read_text())
    manifest["files"]["config.json"] = {"a": {"dtype": "int8"}}  # a damaged manifest, not a damaged file
    (bad / "new").write_text(json.dumps(manifest))
    os.replace(bad / "new", bad / fs.MANIFEST)
    code, out, err = cli(capsys, "info", str(bad), "--verify")
    assert code == 2 and "config.json are not tensor records" in err and len(err.strip().splitlines()) == 1


def test_json_on_stdout_is_the_json_alone(tiny_folders, capsys):
    """`--json -`: stdout parses as JSON (the table goes to stderr); the next command's
    table is back on stdout."""
    _, pdir = tiny_folders["uint4-chn"]
    code, out, err = cli(capsys, "info", str(pdir), "--json", "-")
    assert code == 0, err
    assert json.loads(out)["format"] == "qoqtool-packed" and "same model in fp16" in err
    code, out, _ = cli(capsys, "info", str(pdir))
    assert code == 0 and "same model in fp16" in out


# -- bad input ------------------------------------------------------------------------------
def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, copy_function=os.link)  # hard links: replace files, never edit them
    return dst


def _missing_tensor(d: Path):
    t = load_file(str(d / "model.safetensors"))
    del t["model.layers.1.mlp.down_proj.scale1"]
    save_file(t, str(d / "new.safetensors"))
    os.replace(d / "new.safetensors", d / "model.safetensors")


def _flipped_byte(d: Path):
    data = bytearray((d / "model.safetensors").read_bytes())
    data[-100] ^= 0x10
    (d / "new.safetensors").write_bytes(bytes(data))
    os.replace(d / "new.safetensors", d / "model.safetensors")


def _future_version(d: Path):
    man = fs.read_manifest(d)
    man["format_version"] = packed.FORMAT_VERSION + 1
    (d / "qoqtool.json").unlink()
    fs.write_manifest(d, man)


def _config_mismatch(d: Path):
    config = json.loads((d / "config.json").read_text())
    config["intermediate_size"] = 64
    (d / "config.json").unlink()
    (d / "config.json").write_text(json.dumps(config))


def _group_params_past_the_kernels(d: Path):
    """zero_x_scale1 = 130 (the kernels assume <= 128) in a file whose checksums agree."""
    t = load_file(str(d / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj"
    t[f"{name}.scale1"] = torch.full_like(t[f"{name}.scale1"], 2)
    t[f"{name}.zero_x_scale1"] = torch.full_like(t[f"{name}.zero_x_scale1"], 130)
    save_file(t, str(d / "new.safetensors"))
    os.replace(d / "new.safetensors", d / "model.safetensors")
    man = fs.read_manifest(d)
    man["files"]["model.safetensors"] = fs.tensor_records(t)
    (d / "qoqtool.json").unlink()
    fs.write_manifest(d, man)


def _manifest_a_list(d: Path):
    (d / "qoqtool.json").unlink()
    (d / "qoqtool.json").write_text("[1, 2]")


def _linears_a_list(d: Path):
    man = fs.read_manifest(d)
    man["linears"] = list(man["linears"])
    (d / "qoqtool.json").unlink()
    fs.write_manifest(d, man)


def _header_a_list(d: Path):
    header = b"[]"
    (d / "new.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    os.replace(d / "new.safetensors", d / "model.safetensors")


def _record_without_sha(d: Path):
    man = fs.read_manifest(d)
    del next(iter(man["files"]["model.safetensors"].values()))["sha256"]
    (d / "qoqtool.json").unlink()
    fs.write_manifest(d, man)


def _config_not_json(d: Path):
    (d / "config.json").unlink()
    (d / "config.json").write_text("{not json")


DAMAGES = {
    "manifest a list": (_manifest_a_list, "qoqtool.json is not a JSON object"),
    "linears a list": (_linears_a_list, "has a list as its 'linears' entry"),
    "safetensors header a list": (_header_a_list, "truncated or corrupt (header is not valid)"),
    "config not JSON": (_config_not_json, "cannot read the config of"),
    "record without sha256": (_record_without_sha, "the checksums listed for model.safetensors are not tensor records"),
    "missing tensor": (_missing_tensor, "missing tensor model.layers.1.mlp.down_proj.scale1"),
    "group parameters": (_group_params_past_the_kernels, "group parameters of model.layers.1.mlp.down_proj are damaged"),
    "flipped byte": (_flipped_byte, "sha256"),
    "future version": (_future_version, "upgrade qoqtool"),
    "config mismatch": (_config_mismatch, "does not belong"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_folder_is_refused(tiny_folders, tmp_path, capsys, damage):
    spoil, words = DAMAGES[damage]
    d = _copy(tiny_folders["prog-g32"][1], tmp_path / "damaged")
    spoil(d)
    with pytest.raises(UserError, match=re.escape(words)):
        packed.load_packed_folder(d, fs.read_manifest(d))
    code, _, err = cli(capsys, "eval", str(d), "--tasks", "fidelity")
    assert_one_line_error(code, err, words)


@pytest.mark.parametrize("damage", ["manifest a list", "linears a list", "config not JSON", "record without sha256"])
def test_a_damaged_quantized_folder_is_refused_by_every_command(tiny_folders, tmp_path, capsys, damage):
    spoil, words = DAMAGES[damage]
    d = _copy(tiny_folders["prog-g32"][0], tmp_path / "damaged")
    spoil(d)
    for command in (["eval", str(d), "--tasks", "fidelity"], ["pack", str(d), "-o", str(tmp_path / "p")]) + (
            (["info", str(d)],) if damage not in ("config not JSON", "record without sha256") else ()):  # (info reads the manifest only)
        code, _, err = cli(capsys, *command)
        assert_one_line_error(code, err, words)
    assert not (tmp_path / "p").exists()


def test_pack_refuses_an_empty_output(tiny_folders, capsys):
    """-o "" is refused, as quantize refuses it, not read as "the default name"."""
    qdir = tiny_folders["prog-g32"][0]
    default = Path(f"{qdir}-packed")
    existed = default.exists()
    code, _, err = cli(capsys, "pack", str(qdir), "-o", "")
    assert_one_line_error(code, err, "-o is empty")
    assert default.exists() == existed


@pytest.mark.parametrize("version,words", [(quantized.FORMAT_VERSION + 1, "upgrade qoqtool"), (0, "re-quantize it")])
def test_quantized_folder_of_another_version_is_refused(tiny_folders, tmp_path, capsys, version, words):
    d = _copy(tiny_folders["prog-g32"][0], tmp_path / "other-version")
    man = fs.read_manifest(d)
    man["format_version"] = version
    (d / "qoqtool.json").unlink()
    fs.write_manifest(d, man)
    code, _, err = cli(capsys, "eval", str(d), "--tasks", "fidelity")
    assert_one_line_error(code, err, f"format version {version}", words)


def test_pack_refuses_bad_input(tiny_folders, tmp_path, capsys):
    qdir, pdir = tiny_folders["prog-g32"]
    code, _, err = cli(capsys, "pack", str(qdir), "-o", str(tmp_path / "x"), "--outliers", "150%")
    assert_one_line_error(code, err, "--outliers 150%")
    code, _, err = cli(capsys, "pack", str(qdir), "-o", str(pdir))
    assert_one_line_error(code, err, "already exists", "--overwrite")
    code, _, err = cli(capsys, "pack", str(pdir), "-o", str(tmp_path / "y"))
    assert_one_line_error(code, err, "already packed")
    code, _, err = cli(capsys, "pack", str(tmp_path / "nope"), "-o", str(tmp_path / "z"))
    assert_one_line_error(code, err, "not a folder")
    assert not any(tmp_path.iterdir())  # nothing written
    for out in (qdir, qdir.parent):  # --overwrite would delete the folder being packed
        code, _, err = cli(capsys, "pack", str(qdir), "-o", str(out), "--overwrite")
        assert_one_line_error(code, err, "is or holds the input", "choose another output folder")
    assert (qdir / "qoqtool.json").is_file()


def test_pack_overwrite_replaces_atomically(tiny_folders, tmp_path, capsys):
    qdir, _ = tiny_folders["int8"]
    out = tmp_path / "p"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    code, stdout, err = cli(capsys, "pack", str(qdir), "-o", str(out), "--overwrite")
    assert code == 0, err
    assert "bits / stored weight" in stdout and not (out / "stale.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["p"]  # no temporary folder left behind


def test_a_killed_runs_temporary_folder_is_removed_by_the_next_run_an_hour_later(tiny_folders, tmp_path, capsys):
    """SIGKILL leaves .OUT.tmp-XXXX behind (nothing can clean up): the next run into OUT removes
    it once untouched for an hour, and leaves younger ones (a run may be writing them)."""
    qdir, _ = tiny_folders["int8"]
    old, young, other = tmp_path / ".p.tmp-0badf00d", tmp_path / ".p.tmp-12345678", tmp_path / ".q.tmp-0badf00d"
    for d in (old, young, other):
        d.mkdir()
        (d / "config.json").write_text("{}")
    hours_ago = time.time() - 2 * fs.STALE_SECONDS
    os.utime(old, (hours_ago, hours_ago))
    os.utime(other, (hours_ago, hours_ago))
    code, _, err = cli(capsys, "pack", str(qdir), "-o", str(tmp_path / "p"))
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [".p.tmp-12345678", ".q.tmp-0badf00d", "p"]


# -- the demo model -------------------------------------------------------------------------
# QoQ recipes by name can be tested with e.g.
#   QOQTOOL_PACK_TEST_RECIPES=qoq-w4a8kv4-g128,qoq-w4a8kv4-chn pytest -m slow tests/test_packing_folder.py
DEMO_RECIPES = {
    "g128": adhoc_recipe("adhoc-progressive-g128", {"bits": 4, "scheme": "progressive", "group_size": 128}),
    "chn": adhoc_recipe("adhoc-asymmetric-chn", {"bits": 4, "scheme": "asymmetric", "group_size": None}),
}
if os.environ.get("QOQTOOL_PACK_TEST_RECIPES"):
    named = os.environ["QOQTOOL_PACK_TEST_RECIPES"].split(",")
    DEMO_RECIPES = {"g128" if "g128" in n else n: load_recipe(n) for n in named}


@pytest.fixture(scope="module")
def demo_folders(demo_model, shared_data, tmp_path_factory):
    import copy

    from qoqtool.data.calibration import build_calibration

    model, tokenizer = demo_model
    root = tmp_path_factory.mktemp("demo")
    calib = build_calibration("wikitext2", tokenizer, 4, 128, 0, str(shared_data))
    folders = {}
    for key, recipe in DEMO_RECIPES.items():
        qdir = quantize_to(copy.deepcopy(model), recipe, root / f"q-{key}", calib.tokens, tokenizer, "smollm2-135m")
        report = packed.pack_folder(str(qdir), str(root / f"p-{key}"))
        folders[key] = (qdir, root / f"p-{key}", report)
    return folders


@pytest.mark.slow
@pytest.mark.parametrize("key", list(DEMO_RECIPES))
def test_demo_every_layer_round_trips(demo_folders, key):
    qdir, pdir, _ = demo_folders[key]
    assert assert_round_trip(qdir, pdir) == 210


@pytest.mark.slow
def test_demo_bits_per_weight(demo_folders):
    size = demo_folders["g128"][2]["size"]
    assert size["bits_per_stored_weight"] <= 4.20
    pad = size["padding_by_in_features"]
    assert pad["576"]["k_padded"] == 640 and pad["576"]["linears"] == 180
    assert pad["576"]["padding_share"] == pytest.approx(640 / 576 - 1)
    assert pad["1536"]["padding_share"] == 0
    # the rotation of QoQ recipes unties lm_head from the embeddings: then both are stored
    tied = json.loads((demo_folders["g128"][1] / "config.json").read_text()).get("tie_word_embeddings", False)
    assert size["float_bytes"]["embeddings"] == 49152 * 576 * 2 * (1 if tied else 2)


@pytest.mark.slow
@pytest.mark.parametrize("key", list(DEMO_RECIPES))
def test_demo_packed_perplexity_equals_quantized(demo_folders, shared_data, key):
    from qoqtool.eval.perplexity import perplexity, wikitext2_test_ids
    from qoqtool.runtime.loading import load_any

    qdir, pdir, _ = demo_folders[key]
    a, b = load_any(str(qdir)), load_any(str(pdir))
    assert (a.kind, b.kind) == ("quantized", "packed")
    ids = wikitext2_test_ids(a.tokenizer, str(shared_data))
    ppl_q = perplexity(a.model, ids, seqlen=256, max_windows=2)["ppl"]
    ppl_p = perplexity(b.model, ids, seqlen=256, max_windows=2)["ppl"]
    assert abs(ppl_p - ppl_q) <= 1e-6 * ppl_q
