"""Bad input: one line on stderr naming the problem, exit code 2, no traceback, nothing written."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import tiny_model


def run_cli(*args, env=None, cwd=None):
    full_env = {**os.environ, "HF_HUB_OFFLINE": "0", **(env or {})}
    return subprocess.run([sys.executable, "-m", "qoqtool", *args], capture_output=True, text=True, env=full_env, cwd=cwd, timeout=300)


def assert_user_error(proc, *words):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    for word in words:
        assert word in lines[0], lines[0]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast  # noqa: F401  (a folder needs no tokenizer to fail)

    path = tmp_path_factory.mktemp("tiny")
    tiny_model("llama").save_pretrained(path)
    return path


def test_missing_model_path(tmp_path):
    out = tmp_path / "out"
    proc = run_cli("quantize", str(tmp_path / "nope"), "-r", "rtn-w8a8", "-o", str(out))
    assert_user_error(proc, "does not exist")
    assert not out.exists()


def test_hub_id_offline(tmp_path):
    out = tmp_path / "out"
    proc = run_cli("quantize", "someorg/some-model", "-r", "rtn-w8a8", "-o", str(out),
                   env={"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")})
    assert_user_error(proc, "hub", "local")
    assert not out.exists()


def test_unsupported_architecture(tmp_path):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    proc = run_cli("quantize", str(folder), "-r", "rtn-w8a8", "-o", str(tmp_path / "out"))
    assert_user_error(proc, "unsupported architecture GPT2LMHeadModel", "LlamaForCausalLM")
    assert not (tmp_path / "out").exists()


def test_truncated_safetensors(tmp_path, tiny_folder):
    import shutil

    folder = tmp_path / "broken"
    shutil.copytree(tiny_folder, folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    proc = run_cli("quantize", str(folder), "-r", "rtn-w8a8", "--calib", "synthetic", "-o", str(tmp_path / "out"))
    assert_user_error(proc, "truncated or corrupt")
    assert not (tmp_path / "out").exists()


class _Payload:
    """A pickle that writes a file when it is read."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_weights_are_refused_unread(tmp_path, tiny_folder):
    import pickle
    import shutil

    folder = tmp_path / "pickled"
    shutil.copytree(tiny_folder, folder)
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "the-pickle-ran"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(_Payload(marker)))
    for command in (("quantize", str(folder), "-r", "rtn-w8a8", "--calib", "synthetic", "-o", str(tmp_path / "out")),
                    ("eval", str(folder), "--tasks", "fidelity")):
        proc = run_cli(*command)
        assert_user_error(proc, "holds no .safetensors weights (only pickles: pytorch_model.bin)", "safetensors only")
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_weights_that_lack_tensors_are_refused(tmp_path, tiny_folder):
    """transformers would fill a missing tensor with random values: refused instead, naming it."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "partial"
    shutil.copytree(tiny_folder, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.0.self_attn.q_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    proc = run_cli("eval", str(folder), "--tasks", "fidelity")
    assert_user_error(proc, "lack 1 of the model's tensors (first: model.layers.0.self_attn.q_proj.weight)")


def test_unknown_recipe_lists_known(tmp_path, tiny_folder):
    proc = run_cli("quantize", str(tiny_folder), "-r", "w3a3", "-o", str(tmp_path / "out"))
    assert_user_error(proc, "unknown recipe", "rtn-w4a8kv4-g128", "qoq-w4a8kv4-g128")


@pytest.mark.parametrize("step, words", [("rotate: {hadamard: 3}", ("hadamard must be one of 1, 2", "not 3")),
                                         ("gptq: {dampening: 0.1}", ("unknown parameter(s) dampening", "damp"))])
def test_bad_recipe_parameter_fails_before_loading_the_model(tmp_path, step, words):
    """A recipe's step parameters are checked when the recipe is read: the model path here does
    not even exist, and the error is the recipe's."""
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(f"name: bad\nweights: {{bits: 4, scheme: progressive, group_size: 128}}\nsteps:\n  - {step}\n")
    proc = run_cli("quantize", str(tmp_path / "no-model"), "-r", str(recipe), "-o", str(tmp_path / "out"))
    assert_user_error(proc, "bad.yaml", *words)
    assert not (tmp_path / "out").exists()


def test_zero_calibration_samples(tmp_path, tiny_folder):
    proc = run_cli("quantize", str(tiny_folder), "-r", "rtn-w8a8", "--calib-samples", "0", "-o", str(tmp_path / "out"))
    assert_user_error(proc, "--calib-samples")
    assert not (tmp_path / "out").exists()


def test_unknown_task(tiny_folder):
    proc = run_cli("eval", str(tiny_folder), "--tasks", "nosuchtask")
    assert_user_error(proc, "unknown task", "wikitext2")


@pytest.mark.parametrize("dtype, words", [("float64", ("unknown dtype 'float64'", "float32, float16, bfloat16")),
                                          ("float16", ("--dtype float16 needs --device cuda",))])
def test_eval_dtype(tiny_folder, dtype, words):
    proc = run_cli("eval", str(tiny_folder), "--tasks", "fidelity", "--dtype", dtype)
    assert_user_error(proc, *words)


def test_data_dir_without_files(tmp_path, tiny_folder):
    empty = tmp_path / "data"
    empty.mkdir()
    proc = run_cli("eval", str(tiny_folder), "--tasks", "wikitext2", "--data-dir", str(empty))
    assert_user_error(proc, "wikitext-2-raw/wiki.test.raw")


def test_existing_output_needs_overwrite(tmp_path, tiny_folder):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    proc = run_cli("quantize", str(tiny_folder), "-r", "rtn-w8a8", "-o", str(out))
    assert_user_error(proc, "already exists", "--overwrite")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_an_output_that_holds_the_input_is_refused_even_with_overwrite(tmp_path, tiny_folder):
    """--overwrite replaces the output folder: never one that is or holds what the run reads."""
    import shutil

    parent = tmp_path / "models"
    shutil.copytree(tiny_folder, parent / "tiny")
    data = parent / "data"
    data.mkdir()
    for extra in ([], ["--data-dir", str(data)]):
        source = str(parent / "tiny") if not extra else str(tiny_folder)
        for out in ([str(parent)] if extra else [str(parent), str(parent / "tiny")]):
            proc = run_cli("quantize", source, "-r", "rtn-w8a8", "--calib", "synthetic", "-o", out, "--overwrite", *extra)
            assert_user_error(proc, f"the output {out} is or holds the input", "choose another output folder")
    assert sorted(p.name for p in parent.iterdir()) == ["data", "tiny"]
    assert sorted(p.name for p in (parent / "tiny").iterdir()) == sorted(p.name for p in tiny_folder.iterdir())


@pytest.mark.parametrize("extra, words", [
    (["-o", "{tmp}/afile.txt/out"], "afile.txt is a file, not a folder"),
    (["-o", "."], "the output . is the current folder or one above it"),
    (["-o", ""], "-o is empty"),
    (["-o", "{tmp}/out", "--json", "{tmp}"], "is a folder; name a file"),
    (["-o", "{tmp}/out", "--json", "{tmp}/afile.txt/x.json"], "afile.txt is a file, not a folder"),
    (["-o", "{tmp}/out", "--calib", "wikitext2"], "cannot reach the Hugging Face hub to download wikitext; pass --data-dir"),
    (["-o", "{tmp}/out", "-r", "{tmp}/latin1.yaml"], "latin1.yaml is not UTF-8 text"),
])
def test_outputs_and_inputs_are_checked_before_the_model_loads(tmp_path, tiny_folder, extra, words):
    (tmp_path / "afile.txt").write_text("a file")
    (tmp_path / "latin1.yaml").write_bytes("name: café\n".encode("latin-1"))
    args = [a.replace("{tmp}", str(tmp_path)) for a in extra]
    if "-r" not in args:
        args += ["-r", "rtn-w8a8"]
    calib = [] if "--calib" in args else ["--calib", "synthetic"]
    proc = run_cli("quantize", str(tiny_folder), *calib, *args, env={"HF_HUB_OFFLINE": "1", "QOQTOOL_DATA_DIR": ""},
                   cwd=tmp_path)
    assert_user_error(proc, words)  # (one line: "loading ..." never printed)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile.txt", "latin1.yaml"]


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_an_interrupted_run_says_so_and_leaves_nothing(tmp_path, tiny_folder, sig):
    """Ctrl-C or a SIGTERM during calibration: exit 130, one line, no output and no temporary folder."""
    import shutil
    import signal

    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path / "model"
    shutil.copytree(tiny_folder, folder)
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))).save_pretrained(folder)
    tmp_path = tmp_path / "runs"
    tmp_path.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "qoqtool", "quantize", str(folder), "-r", "rtn-w8a8", "--calib",
                             "synthetic", "--calib-samples", "8192", "--calib-seqlen", "256", "-o", str(tmp_path / "out")],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = [proc.stderr.readline() for _ in range(2)]  # "loading ...", then "calibration: ..." as sampling starts
    assert lines[1].startswith("calibration:"), lines
    proc.send_signal(getattr(signal, sig))
    rest = proc.stderr.read()
    assert proc.wait(timeout=60) == 130 and rest.strip() == "interrupted; nothing was written", rest
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("args, words", [(("eval", "x", "--json"), "'--json' requires an argument"),
                                         (("quantize", "x", "--bogus"), "No such option: --bogus"),
                                         (("quantize",), "Missing argument 'MODEL'"),
                                         (("evl",), "No such command 'evl'"),
                                         (("quantize", "x", "--bo[/x]"), "No such option: --bo[/x]")])
def test_usage_errors_are_one_line_with_exit_2(args, words):
    """Option parsing errors come from click (vendored by recent typer): its message in one
    line, as qoqtool's own errors, naming the command's --help; exit 2."""
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert words in proc.stderr and proc.stderr.startswith("error: ") and "--help')" in proc.stderr


def test_qoqtool_alone_prints_the_help_and_no_error():
    proc = run_cli()
    assert "Usage" in proc.stdout and "quantize" in proc.stdout and proc.stderr.strip() == ""


def test_user_input_is_printed_as_text_not_markup():
    """A path with Rich markup in it is quoted as it is, not parsed (a MarkupError traceback)."""
    proc = run_cli("info", "no/[/x]folder")
    assert proc.returncode == 2 and proc.stderr.strip() == "error: no/[/x]folder is not a folder; pass a folder written by qoqtool quantize or pack"


def test_the_cli_silences_other_libraries_progress_bars():
    """Only qoqtool's own Rich bars: transformers' GGUF loader, for one, draws a tqdm bar that
    its progress-bar switch does not reach."""
    script = ("from qoqtool.cli import _quiet_libraries; _quiet_libraries(); "
              "from tqdm.auto import tqdm; list(tqdm(range(3), desc='other-library-bar'))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TQDM_")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "other-library-bar" not in proc.stderr
    env["TQDM_DISABLE"] = ""  # a user's own setting is kept
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert "other-library-bar" in proc.stderr
