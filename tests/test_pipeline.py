"""quantize_model + the quantized folder: every recipe on tiny models, save/load exactness."""

import pytest
import torch

from qoqtool.calibration.pipeline import _qualified, quantize_model
from qoqtool.packing import quantized
from qoqtool.packing.folder import read_manifest
from qoqtool.recipe import known_recipes, load_recipe
from qoqtool.packing.packed import round_as_deployed
from qoqtool.runtime.loading import load_quantized_folder
from qoqtool.runtime.reference import QuantLinear
from tests.conftest import tiny_model


def _tokens(seed=0, n=4, length=32):
    return torch.randint(0, 128, (n, length), generator=torch.Generator().manual_seed(seed))


def _small(recipe):
    """Bundled recipes with their grids shrunk for tiny models (hidden 64: groups of 32)."""
    if recipe.weights.group_size and recipe.weights.group_size > 32:
        recipe.weights.group_size = 32
    for step in recipe.steps:
        if step.name == "smooth_output":
            step.params.update(grid=4)
        if step.name == "clip":
            step.params.update(steps=4)
    return recipe


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # q/k biases; per-head q/k norms
@pytest.mark.parametrize("name", known_recipes())
def test_every_recipe_quantizes_and_reloads_exactly(name, arch, tmp_path):
    model = tiny_model(arch, seed=1)
    recipe = _small(load_recipe(name))
    tokens = _tokens()
    with torch.no_grad():
        fp = model(tokens, use_cache=False).logits
    result = quantize_model(model, recipe, tokens)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 7 * model.config.num_hidden_layers
    assert all(m.act_bits == recipe.act_bits for m in linears)
    with torch.no_grad():
        # float tensors are deployed in fp16 (docs/format.md): score the model as deployed
        round_as_deployed(model)
        q = model(tokens, use_cache=False).logits
    rel = float((q - fp).norm() / fp.norm())
    assert 0 < rel < 0.5, rel  # quantized: different, but still the same model

    out = tmp_path / "q"
    quantized.save(result, None, str(out), "tiny", {"source": "random", "samples": 4, "seqlen": 32})
    manifest = read_manifest(out)
    assert manifest["format"] == "qoqtool-quantized" and manifest["recipe"]["name"] == recipe.name
    assert set(manifest["linears"]) == {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    reloaded = load_quantized_folder(out, manifest)
    with torch.no_grad():
        again = reloaded(tokens, use_cache=False).logits
    assert torch.equal(again, q), "a reloaded quantized folder must compute exactly the same logits"
    stats = quantized.load_stats(out, manifest)
    some = next(iter(manifest["linears"]))
    assert stats[f"{some}.act_mean_sq"].shape[0] == manifest["linears"][some]["shape"][1]


def test_kv4_changes_attention_only_through_kv(tmp_path):
    """A W8A8KV16 and a W8A8KV4 model differ; KV4 alone is what changed."""
    tokens = _tokens(2)
    base = load_recipe("rtn-w8a8")
    kv4 = load_recipe("rtn-w8a8")
    kv4.kv_bits = 4
    a, b = tiny_model("llama", seed=2), tiny_model("llama", seed=2)
    quantize_model(a, base, tokens)
    quantize_model(b, kv4, tokens)
    with torch.no_grad():
        la, lb = a(tokens, use_cache=False).logits, b(tokens, use_cache=False).logits
    assert not torch.equal(la, lb)
    assert all(m.qoq_kv_bits == 4 for m in b.modules() if hasattr(m, "qoq_kv_bits"))


def test_interrupted_save_leaves_nothing(tmp_path, monkeypatch):
    model = tiny_model("llama")
    result = quantize_model(model, load_recipe("rtn-w8a8"), _tokens())

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(quantized, "save_file", boom)
    with pytest.raises(KeyboardInterrupt):
        quantized.save(result, None, str(tmp_path / "out"), "tiny", {})
    assert list(tmp_path.iterdir()) == []


def test_calibration_uses_quantized_previous_layers():
    """Layer 1's statistics must come from layer 0's *quantized* outputs."""
    tokens = _tokens(3)
    model_a, model_b = tiny_model("mistral", seed=4), tiny_model("mistral", seed=4)
    ra = quantize_model(model_a, load_recipe("rtn-w4a8kv4-chn"), tokens)
    # quantize only layer 0 of b by hand, run it, and compare with a's layer-1 statistics
    from qoqtool.calibration.runner import capture_first_layer_inputs, run_layer
    from qoqtool.calibration.stats import collect_input_stats
    from qoqtool.models.adapter import ModelAdapter

    adapter = ModelAdapter(model_b)
    inputs = capture_first_layer_inputs(adapter, tokens, "cpu")
    fp_out = run_layer(adapter.layers[0], inputs, "cpu")
    inputs.hidden = fp_out
    fp_stats, _ = collect_input_stats(adapter.parts(1), inputs, "cpu")
    quant_stats = ra.input_stats["model.layers.1.self_attn.q_proj"]
    assert not torch.allclose(fp_stats["q_proj"].absmax, quant_stats.absmax)


def test_a_model_a_step_cannot_take_is_refused_before_any_work():
    """hidden size 172 has no Hadamard matrix: check_recipe_fits (what quantize runs right after
    loading the model, before gathering calibration text) says so; a recipe without the rotate
    step fits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from qoqtool.calibration.pipeline import check_recipe_fits
    from qoqtool.errors import UserError

    config = AutoConfig.for_model("llama", hidden_size=172, intermediate_size=256, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=64)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UserError, match="hidden size 172 has no Hadamard rotation"):
        check_recipe_fits(model, load_recipe("qoq-w4a8kv4-g128"))
    check_recipe_fits(model, load_recipe("rtn-w4a8kv4-g128"))


@pytest.mark.parametrize("window", [8, None])
def test_the_runner_gives_each_layer_its_own_attention_mask(window):
    """Qwen2 with sliding-window layers from layer 1 on (use_sliding_window, max_window_layers):
    the model hands those layers another mask than layer 0's. Run layer by layer on windows
    longer than the sliding window, the runner reproduces the model's own hidden states."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from qoqtool.calibration.runner import capture_first_layer_inputs, run_layer
    from qoqtool.models.adapter import ModelAdapter

    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=128, use_sliding_window=window is not None,
                                  sliding_window=window, max_window_layers=1)
    config.architectures = ["Qwen2ForCausalLM"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tokens = torch.randint(0, 128, (3, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(tokens, use_cache=False, output_hidden_states=True).hidden_states
    inputs = capture_first_layer_inputs(ModelAdapter(model), tokens, "cpu")
    assert (inputs.layer_masks is None) == (window is None)
    for i in range(3):
        inputs.layer = i
        inputs.hidden = run_layer(model.model.layers[i], inputs, "cpu")
        if i < 2:  # (the last hidden state is after the final norm)
            torch.testing.assert_close(inputs.hidden, expected[i + 1], atol=1e-6, rtol=0)


@pytest.mark.parametrize("sequential", [True, False])
def test_true_sequential_calibrates_each_linear_on_its_quantized_inputs(sequential):
    """gptq.true_sequential: every linear's statistics are those of its input in the finished
    quantized layer (q/k/v quantized before o_proj's are gathered, with the KV4 cache, and so
    on); without it, o_proj, gate/up and down_proj are calibrated on the float layer's."""
    from qoqtool.calibration.runner import capture_first_layer_inputs, forward_hooks, run_layer
    from qoqtool.models.adapter import ModelAdapter

    tokens = _tokens(5)
    recipe = _small(load_recipe("qoq-w4a8kv4-g128"))
    recipe.step("gptq").params["true_sequential"] = sequential
    model = tiny_model("llama", seed=6)
    result = quantize_model(model, recipe, tokens)
    inputs = capture_first_layer_inputs(ModelAdapter(model), tokens, "cpu")  # the (rotated) embeddings
    parts = ModelAdapter(model).parts(0)
    seen = {}
    watched = {name: getattr(parts, name) for name in ("o_proj", "gate_proj", "down_proj")}
    with forward_hooks(watched, lambda name, x: seen.setdefault(name, []).append(x.reshape(-1, x.shape[-1]))):
        run_layer(parts.layer, inputs, "cpu")
    for name, xs in seen.items():
        x = torch.cat(xs).double()
        recorded = result.input_stats[_qualified(0, name)].sum_sq
        assert torch.allclose(recorded, (x * x).sum(0), rtol=1e-6) == sequential, name

