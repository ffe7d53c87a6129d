"""QoQ's transforms are exact in full precision; Hadamard construction."""

import pytest
import torch

from qoqtool.calibration.pipeline import quantize_model
from qoqtool.errors import UserError
from qoqtool.recipe import load_recipe, recipe_from_dict
from qoqtool.transforms.hadamard import decompose, hadamard, random_hadamard
from tests.conftest import tiny_model


@pytest.mark.parametrize("n", [1, 2, 4, 12, 20, 28, 36, 64, 576, 768, 1536, 3584, 5120,
                               52, 100, 244, 344, 2 * 344])  # then Paley over GF(25), GF(49), GF(121), GF(343)
def test_hadamard_orders(n):
    h = hadamard(n)
    assert torch.equal(h.abs(), torch.ones(n, n, dtype=h.dtype))
    assert torch.equal(h @ h.t(), n * torch.eye(n, dtype=h.dtype))


def test_hadamard_unsupported_size_names_it():
    for n in (9, 172, 6):  # 172 = 4 x 43: neither 171 nor 85 is a prime power
        assert decompose(n) is None
        with pytest.raises(UserError, match=f"order {n}"):
            hadamard(n)
    assert decompose(100, version=1) is None and decompose(100) == [1, 100]  # 100 = 2 (49 + 1)
    with pytest.raises(UserError, match="hadamard must be one of 1, 2"):
        decompose(64, version=3)


def test_hadamard_versions_differ_only_where_primes_fall_short():
    """Version 2 (prime-power fields too) keeps every order a prime gives as it was, so a
    folder's rotation changes only for sizes version 1 built from a larger factor or not at
    all; over a prime field both versions are the same circulant."""
    from qoqtool.transforms.hadamard import _field_character, constructions, paley_character

    assert constructions(11008, version=1) == [(2, "sylvester", 0), (5504, "paley1", 5503)]
    assert constructions(11008) == [(32, "sylvester", 0), (344, "paley1", 343)]
    assert constructions(53248, version=1)[1] == (104, "paley1", 103) and constructions(53248)[1] == (52, "paley2", 25)
    for n in (576, 768, 896, 1536, 2560, 3584, 4864, 5120, 5632, 8960, 13824, 14336, 18944, 27648, 28672, 29568):
        assert constructions(n, version=1) == constructions(n), n
    for q in (5, 7, 13, 19):
        assert torch.equal(_field_character(q)[1], paley_character(q))


def test_random_hadamard_is_orthogonal_and_seeded():
    a, b, c = random_hadamard(576, 0), random_hadamard(576, 0), random_hadamard(576, 1)
    assert torch.allclose(a @ a.t(), torch.eye(576, dtype=a.dtype), atol=1e-12)
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("n,fft_above,version", [(12, None, 2), (64, None, 2), (72, None, 2), (576, None, 2),
                                                 (1536, None, 2), (14336, None, 2), (1848, None, 2), (1848, 256, 2),
                                                 (5504, None, 1), (5504, None, 2), (1376, 256, 2)])
def test_kronecker_rotation_is_the_random_hadamard(n, fft_above, version, monkeypatch):
    """The online down_proj rotation, applied factor by factor, is x @ random_hadamard(n),
    and stays float32 in a model cast to half. In version 1, 5504 (Paley I, q = 5503; Llama-2's
    11008 = 2 x 5504) takes the FFT path; version 2 builds it as 16 x 344 (GF(7^3)), dense.
    1848 = 2 x 924 (Paley II, q = 461) is dense unless the FFT threshold is lowered; a factor
    over a prime-power field (1376 = 4 x 344) stays dense whatever the threshold."""
    from qoqtool.runtime import mlp
    from qoqtool.runtime.mlp import KroneckerRotation

    if fft_above is not None:
        monkeypatch.setattr(mlp, "FFT_ABOVE", fft_above)
    rotation = KroneckerRotation(n, seed=7, version=version)
    by_fft = (n == 5504 and version == 1) or n == 1848 and fft_above is not None
    assert bool(rotation.paley) == by_fft
    x = torch.randn(3, 5, n, generator=torch.Generator().manual_seed(n))
    want = (x.double() @ random_hadamard(n, 7, version=version)).float()
    assert torch.allclose(rotation(x), want, rtol=0, atol=1e-5 * float(want.abs().max()))
    rotation.half()
    assert rotation.signs.dtype == torch.float32 and rotation(x.half()).dtype == torch.float16


def test_down_rotation_leaves_down_proj_to_itself():
    """With down_hadamard, smoothing and reordering skip down_proj (its input is rotated
    online: their scales and permutations could not be folded into up/gate) and say so."""
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    rotate = [{"rotate": {"down_hadamard": True}}]
    rotated = tiny_model("llama", seed=2)
    quantize_model(rotated, _transform_recipe(rotate), tokens, transform_only=True)
    model = tiny_model("llama", seed=2)
    steps = rotate + [{"smooth_output": {"grid": 4}}, {"reorder": {}}]
    result = quantize_model(model, _transform_recipe(steps), tokens, transform_only=True)
    up = [layer.mlp.up_proj.weight for layer in rotated.model.layers]
    assert all(torch.equal(layer.mlp.up_proj.weight, w) for layer, w in zip(model.model.layers, up))
    assert sum("down_proj left alone" in line for line in result.step_log) == 2 * len(up)


def test_down_rotation_refuses_an_intermediate_size_without_hadamard():
    model = tiny_model("llama", seed=2)
    model.config.intermediate_size = 172  # checked before any weight changes
    with pytest.raises(UserError, match="intermediate size 172"):
        quantize_model(model, _transform_recipe([{"rotate": {"down_hadamard": True}}]), torch.zeros(1, 8, dtype=torch.long),
                       transform_only=True)


def _transform_recipe(steps):
    return recipe_from_dict({
        "name": "transforms-only",
        "weights": {"bits": 4, "scheme": "progressive", "group_size": 32},
        "activations": {"bits": 8},
        "kv_cache": {"bits": 4},
        "steps": steps,
    })


ALL_STEPS = [
    {"rotate": {"value_hadamard": True, "key_hadamard": True, "down_hadamard": True}},
    {"smooth_attention": {"alpha": 0.5}},
    {"smooth_output": {"grid": 4}},
    {"reorder": {}},
    {"center_keys": {}},
]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("tie", [False, True])
def test_transforms_keep_logits(arch, tie):
    model = tiny_model(arch, seed=3, tie=tie)
    tokens = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(tokens, use_cache=False).logits.double()
    result = quantize_model(model, _transform_recipe(ALL_STEPS), tokens, transform_only=True)
    with torch.no_grad():
        out = model(tokens, use_cache=False).logits.double()
    rel = float((out - ref).norm() / ref.norm())
    assert rel < 1e-4, rel
    if tie:
        assert any("untied" in n for n in result.notes) and not model.config.tie_word_embeddings


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("step", ALL_STEPS, ids=lambda s: next(iter(s)))
def test_each_transform_alone_keeps_logits(step, arch):
    model = tiny_model(arch, seed=5)
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(tokens, use_cache=False).logits.double()
    quantize_model(model, _transform_recipe([step]), tokens, transform_only=True)
    with torch.no_grad():
        out = model(tokens, use_cache=False).logits.double()
    assert float((out - ref).norm() / ref.norm()) < 1e-4


def test_smooth_attention_scales_qwen3s_head_norms():
    """With per-head q/k norms (Qwen3) lambda goes into their weights, not into q/k_proj (the
    norm would undo it): k_norm / lambda and q_norm * lambda, one lambda for all heads."""
    model = tiny_model("qwen3", seed=5)
    attn = model.model.layers[0].self_attn
    before = {n: getattr(attn, n).weight.detach().clone() for n in ("q_proj", "k_proj", "q_norm", "k_norm")}
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    quantize_model(model, _transform_recipe([{"smooth_attention": {"alpha": 0.5}}]), tokens, transform_only=True)
    assert torch.equal(attn.q_proj.weight, before["q_proj"]) and torch.equal(attn.k_proj.weight, before["k_proj"])
    lam = before["k_norm"] / attn.k_norm.weight.detach()
    assert torch.allclose(attn.q_norm.weight / before["q_norm"], lam, rtol=1e-5)
    assert lam.min() < 0.9 * lam.max()  # it did scale the channels
    half = lam.numel() // 2
    assert torch.allclose(lam[:half], lam[half:], rtol=1e-6)  # tied across RoPE pairs


@pytest.mark.slow
def test_transforms_keep_logits_on_demo_model(shared_data):
    from qoqtool.data.calibration import build_calibration
    from qoqtool.models.loading import load_model

    model, tok, _ = load_model("smollm2-135m")  # its own copy: the transforms rewrite weights
    calib = build_calibration("wikitext2", tok, 4, 64, 0, str(shared_data))
    x = calib.tokens[:2]
    with torch.no_grad():
        ref = model(x, use_cache=False).logits.double()
    recipe = load_recipe("qoq-w4a8kv4-g128")
    quantize_model(model, recipe, calib.tokens, transform_only=True)
    with torch.no_grad():
        out = model(x, use_cache=False).logits.double()
    assert float((out - ref).norm() / ref.norm()) < 1e-4


def test_smooth_attention_scales_are_rope_tied():
    from qoqtool.transforms.smooth_attention import attention_scales

    amax = torch.rand(3, 64) * 10
    lam = attention_scales(amax, 0.5)
    assert torch.equal(lam[:, :32], lam[:, 32:])
    assert torch.all(lam >= amax.double().pow(0.5) - 1e-12)


@pytest.mark.parametrize("hidden, heads, named", [(172, 2, "hidden size 172"), (60, 2, "head_dim 30")])
def test_rotation_refuses_sizes_without_hadamard(hidden, heads, named):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=128, hidden_size=hidden, intermediate_size=128,
                                  num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=1)
    config.architectures = ["LlamaForCausalLM"]
    model = AutoModelForCausalLM.from_config(config).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UserError, match=named):
        quantize_model(model, load_recipe("qoq-w4a8kv4-g128"), torch.randint(0, 128, (2, 16)))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing touched


def test_key_rotation_runs_in_attention_and_changes_only_the_quantized_keys():
    """key_hadamard is exact in float and changes what the 4-bit cache stores."""
    from qoqtool.runtime.attention import enable_kv_quantization

    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    logits = {}
    for keys in (False, True):
        model = tiny_model("llama", seed=6)
        recipe = _transform_recipe([{"rotate": {"value_hadamard": False, "key_hadamard": keys}}])
        quantize_model(model, recipe, tokens, transform_only=True)
        for bits in (16, 4):
            enable_kv_quantization(model, bits)
            with torch.no_grad():
                logits[keys, bits] = model(tokens, use_cache=False).logits.double()
        assert all(hasattr(m, "qoq_key_rotation") == keys for m in model.modules() if hasattr(m, "k_proj"))
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    assert rel(logits[True, 16], logits[False, 16]) < 1e-5
    assert rel(logits[True, 4], logits[False, 4]) > 1e-4


def test_key_centering_stores_the_mean_cached_key_and_shrinks_kv4_error():
    """center_keys: c = the mean of the keys as cached (rotated), exact in float, and the 4-bit
    cache of k - c is closer to k - c than that of k is to k on keys with a common component."""
    from qoqtool.quantizers.activations import fake_quantize_kv
    from qoqtool.runtime.attention import KEY_SHIFT, cached_keys

    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(4))
    model = tiny_model("llama", seed=7)
    with torch.no_grad():  # a common key component, as real models have in low-frequency channels
        model.model.layers[0].self_attn.k_proj.bias = torch.nn.Parameter(torch.linspace(-8, 8, model.model.layers[0].self_attn.k_proj.out_features))
        ref = model(tokens, use_cache=False).logits.double()
    recipe = _transform_recipe([{"rotate": {"value_hadamard": False, "key_hadamard": True}}, {"center_keys": {}}])
    quantize_model(model, recipe, tokens, transform_only=True)
    with torch.no_grad():
        out = model(tokens, use_cache=False).logits.double()
    assert float((out - ref).norm() / ref.norm()) < 1e-5  # any shift leaves softmax unchanged

    attn = model.model.layers[0].self_attn
    shift = getattr(attn, KEY_SHIFT)
    assert f"model.layers.0.self_attn.{KEY_SHIFT}" in model.state_dict()  # saved with the model
    keys = []
    attn.qoq_observer = lambda k, v: keys.append(k)
    with torch.no_grad():
        model(tokens, use_cache=False)
    attn.qoq_observer = None
    delattr(attn, KEY_SHIFT)
    raw = cached_keys(attn, keys[0])  # rotated, not shifted
    torch.testing.assert_close(shift, raw.mean(dim=(0, 2)), rtol=1e-4, atol=1e-4)
    centered = raw - shift[:, None, :]
    err = lambda x: float((fake_quantize_kv(x, 4) - x).norm())  # noqa: E731
    assert err(centered) < 0.8 * err(raw)


def test_kronecker_rotation_fused_form_is_the_rotation():
    """fused_form() = (a, F) with R = (H_a / sqrt(a)) (x) F diag(signs), H_a Sylvester's matrix:
    the form the fused SiLU + rotation + quantization kernels apply (x R checked in float64);
    None where the rotation has a third factor (3808 = 2 x 28 x 68)."""
    from qoqtool.runtime.mlp import KroneckerRotation
    from qoqtool.transforms.hadamard import _sylvester, random_hadamard

    for n, a, m in [(1536, 128, 12), (4864, 64, 76), (512, 512, 1)]:
        rotation = KroneckerRotation(n, seed=3)
        got_a, factor = rotation.fused_form()
        assert (got_a, tuple(factor.shape)) == (a, (m, m))
        x = torch.randn(2, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
        y = (_sylvester(a).t() @ x.reshape(2, a, m) @ factor.double()).reshape(2, n) * rotation.signs.double() / a**0.5
        assert torch.allclose(y, x @ random_hadamard(n, 3), atol=1e-5)
    assert KroneckerRotation(3808, seed=0).fused_form() is None
    assert KroneckerRotation(11008, seed=0, version=1).fused_form() is None  # 2 x 5504: the Paley factor by FFT
    assert KroneckerRotation(11008, seed=0).fused_form()[0] == 32  # 32 x 344: the tensor-core kernel's


@pytest.mark.parametrize("q,kind", [(5, "paley2"), (13, "paley2"), (461, "paley2"), (3, "paley1"), (19, "paley1"),
                                    (139, "paley1")])
def test_paley_factor_by_fft_is_the_matrix(q, kind):
    """runtime.mlp._paley_times (x H by a circular convolution) against the Paley matrices that
    hadamard.py builds, small orders included (the rotation uses it only above FFT_ABOVE)."""
    from qoqtool.runtime.mlp import _fft_size, _paley_times
    from qoqtool.transforms.hadamard import _paley1, _paley2, paley_character

    h = (_paley1 if kind == "paley1" else _paley2)(q)
    x = torch.randn(3, 2, h.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(q))
    got = _paley_times(x, kind, q, torch.fft.rfft(paley_character(q).repeat(2), n=_fft_size(q)))
    assert torch.allclose(got, x @ h, atol=1e-9)


def test_a_saved_recipe_rebuilds_the_rotation_it_was_made_with():
    """The manifest records the rotate step's `hadamard` (Recipe.to_dict fills in defaults);
    a saved recipe from before the parameter existed has none and was made with version 1, so
    the online rotation is rebuilt as version 1 (5504 = 1 x 5504 by FFT, not 16 x 344)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from qoqtool.runtime.mlp import ROTATION, configure_mlp

    config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=64, intermediate_size=5504, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1)
    saved = load_recipe("qoq-w4a8kv4-g128").to_dict()
    assert saved["steps"][0]["rotate"]["hadamard"] == 2
    for version, shapes in ((None, [1, 5504]), (1, [1, 5504]), (2, [16, 344])):
        recipe = {"steps": [{"rotate": {"down_hadamard": True} | ({} if version is None else {"hadamard": version})}]}
        model = AutoModelForCausalLM.from_config(config)
        configure_mlp(model, recipe)
        assert getattr(model.model.layers[0].mlp, ROTATION).shapes == shapes
