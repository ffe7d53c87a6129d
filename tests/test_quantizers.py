"""Quantizer math: grids, RTN schemes, progressive quantization, activations, KV."""

import pytest
import torch

from qoqtool.quantizers.activations import dequantize_kv, quantize_kv, quantize_per_token
from qoqtool.quantizers.formats import ProgressiveWeight, UInt4Weight
from qoqtool.quantizers.schemes import PROTECTIVE_RANGE, WeightQuantConfig, WeightScheme


def _heavy_tailed(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w[torch.rand(n, k, generator=g) < 0.01] *= 20  # outliers stress the ranges
    return w


@pytest.mark.parametrize("group", [32, 64, 128])
def test_progressive_level0_stays_in_int8(group):
    """(q - z) * s1 lies in [-128, 127] for every stored code: the kernel needs no saturation."""
    for seed in range(5):
        w = _heavy_tailed(96, 576, seed)
        qw = WeightScheme(WeightQuantConfig(4, group, "progressive")).quantize(w)
        assert isinstance(qw, ProgressiveWeight)
        q = qw.codes.to(torch.int32)
        z = qw.zero.to(torch.int32).repeat_interleave(group, 1)
        s1 = qw.scale1.to(torch.int32).repeat_interleave(group, 1)
        level0 = (q - z) * s1
        assert level0.min() >= -128 and level0.max() <= 127
        assert int(qw.codes.max()) <= 15 and int(qw.zero.max()) <= 15
        assert 1 <= int(qw.scale1.min()) and int(qw.scale1.max()) <= 16  # q * s1 <= 240 fits a byte
        assert int((qw.zero.to(torch.int32) * qw.scale1.to(torch.int32)).max()) <= 128


def test_progressive_level0_on_real_weights(demo_model):
    model, _ = demo_model
    scheme = WeightScheme(WeightQuantConfig(4, 128, "progressive"))
    for layer in (0, 15, 29):
        for linear in (model.model.layers[layer].self_attn.q_proj, model.model.layers[layer].mlp.down_proj):
            qw = scheme.quantize(linear.weight.data)
            w8 = qw.int8_operand().to(torch.int32)  # raises if any value left INT8
            assert w8.abs().max() <= 128


def test_progressive_error_is_small():
    w = _heavy_tailed(64, 256)
    qw = WeightScheme(WeightQuantConfig(4, 64, "progressive")).quantize(w)
    rel = (qw.dequantize() - w).norm() / w.norm()
    assert rel < 0.25
    # level 0 alone keeps the protective range
    assert (w.abs().amax(1) / qw.scale0.float()).max() <= PROTECTIVE_RANGE * 1.001


def test_rtn_group_padding_is_neutral():
    """K = 576 with g = 128 pads to 640; padded codes dequantize to exactly zero."""
    w = _heavy_tailed(32, 576)
    qw = WeightScheme(WeightQuantConfig(4, 128, "asymmetric")).quantize(w)
    assert isinstance(qw, UInt4Weight) and qw.codes.shape == (32, 640)
    assert torch.equal(qw.codes[:, 576:], qw.zero[:, -1:].expand(32, 64))
    assert qw.dequantize().shape == (32, 576)


def test_rtn_matches_minmax_definition():
    w = _heavy_tailed(16, 128)
    qw = WeightScheme(WeightQuantConfig(4, 64, "asymmetric")).quantize(w)
    for g in range(2):
        blk = w[:, g * 64 : (g + 1) * 64]
        mn, mx = blk.amin(1).clamp(max=0), blk.amax(1).clamp(min=0)
        s = ((mx - mn) / 15).half().float()
        z = torch.round(-mn / s).clamp(0, 15)
        q = (torch.round(blk / s[:, None]) + z[:, None]).clamp(0, 15)
        assert torch.equal(qw.scale[:, g].float(), s)
        assert torch.equal(qw.zero[:, g].float(), z)
        assert torch.equal(qw.codes[:, g * 64 : (g + 1) * 64].float(), q)


def test_per_token_int8_definition():
    x = torch.randn(7, 50) * torch.logspace(-2, 2, 7)[:, None]
    codes, scale = quantize_per_token(x)
    expect_scale = (x.abs().amax(1) / 127).half().float()
    assert torch.equal(scale, expect_scale)
    assert torch.equal(codes, torch.round(x / expect_scale[:, None]).clamp(-127, 127).to(torch.int8))
    assert codes.abs().max() == 127


def test_kv_quantization_is_per_token():
    """Quantizing [cache; new] equals [quantized cache; quantized new] (what makes the
    attention-interface KV quantizer exact under a growing cache)."""
    x = torch.randn(2, 3, 10, 16)
    whole = dequantize_kv(*quantize_kv(x))
    parts = torch.cat([dequantize_kv(*quantize_kv(x[:, :, :6])), dequantize_kv(*quantize_kv(x[:, :, 6:]))], 2)
    assert torch.equal(whole, parts)
    codes, scale, zero = quantize_kv(x)
    assert codes.max() <= 15 and codes.dtype == torch.uint8
    err = (whole - x).abs() / scale.float()[..., None]
    assert err.max() <= 0.5 + 1e-3  # round to nearest on the grid (x - zero) / scale


def test_scheme_config_rejects_nonsense():
    with pytest.raises(ValueError):
        WeightQuantConfig(8, 128, "progressive")
    with pytest.raises(ValueError):
        WeightQuantConfig(4, None, "symmetric")


# -- GPTQ ---------------------------------------------------------------------------------------
def _correlated_inputs(k, n_samples=1024, seed=0):
    """Inputs with correlated channels of different loudness (what makes GPTQ beat RTN)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5 + torch.eye(k)
    return (torch.randn(n_samples, k, generator=g) @ mix) * torch.logspace(-1, 0.5, k)[torch.randperm(k, generator=g)]


def _output_error(w, x, qw):
    return float((x @ (qw.dequantize() - w).t()).pow(2).sum() / (x @ w.t()).pow(2).sum())


@pytest.mark.parametrize("config", [WeightQuantConfig(4, 64, "progressive"), WeightQuantConfig(4, None, "asymmetric")],
                         ids=lambda c: c.describe())
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_round_to_nearest_on_the_output(config, act_order):
    from qoqtool.quantizers.gptq import GPTQParams, gptq_quantize

    w, x = _heavy_tailed(48, 192, seed=1) * 0.02, _correlated_inputs(192)
    hessian = 2 * x.t() @ x / x.shape[0]
    gptq = _output_error(w, x, gptq_quantize(w, hessian, WeightScheme(config), GPTQParams(act_order=act_order)))
    rtn = _output_error(w, x, WeightScheme(config).quantize(w))
    assert gptq < 0.8 * rtn


def test_gptq_pins_dead_channels_before_fitting_any_grid():
    """A channel never active in calibration is quantized as zero, and its weights - however
    large - widen no grid, progressive level 0 included: the result is that of the same weight
    with the channel zeroed."""
    from qoqtool.quantizers.gptq import GPTQParams, gptq_quantize

    w, x = _heavy_tailed(32, 256, seed=2) * 0.02, _correlated_inputs(256)
    x[:, 7] = 0
    w[:, 7] = 1.0  # ~50x the other weights of every row
    hessian = 2 * x.t() @ x / x.shape[0]
    scheme = WeightScheme(WeightQuantConfig(4, 128, "progressive"))
    qw = gptq_quantize(w, hessian, scheme, GPTQParams())
    zeroed = w.clone()
    zeroed[:, 7] = 0
    expected = gptq_quantize(zeroed, hessian, WeightScheme(scheme.config), GPTQParams())
    for name, t in expected.tensors().items():
        assert torch.equal(qw.tensors()[name], t), name
    assert torch.equal(qw.dequantize()[:, 7], torch.zeros(32))
