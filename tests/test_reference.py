"""The exact reference path against an independent integer re-computation."""

import pytest
import torch

from qoqtool.quantizers.activations import quantize_per_token
from qoqtool.quantizers.schemes import WeightQuantConfig, WeightScheme
from qoqtool.runtime.intmath import int8_matmul
from qoqtool.runtime.reference import QuantLinear

CONFIGS = [
    WeightQuantConfig(8, None, "symmetric"),
    WeightQuantConfig(4, 128, "asymmetric"),
    WeightQuantConfig(4, 64, "asymmetric"),
    WeightQuantConfig(4, None, "asymmetric"),
    WeightQuantConfig(4, 128, "progressive"),
    WeightQuantConfig(4, 32, "progressive"),
]


def test_int8_matmul_exact_at_extremes():
    a = torch.full((3, 4096), -127, dtype=torch.int8)
    b = torch.full((5, 4096), -128, dtype=torch.int8)
    out = int8_matmul(a, b)
    assert out.dtype == torch.int32 and int(out[0, 0]) == 127 * 128 * 4096
    a = torch.randint(-127, 128, (9, 333), dtype=torch.int8)
    b = torch.randint(-128, 128, (11, 333), dtype=torch.int8)
    assert torch.equal(int8_matmul(a, b).long(), a.long() @ b.long().t())


def _independent(qw, x):
    """Recompute y from the stored integers with int64 numpy-free arithmetic."""
    xq, sx = quantize_per_token(x)
    kp = qw.codes.shape[1]
    xq = torch.nn.functional.pad(xq, (0, kp - xq.shape[1])).long()
    if qw.kind == "int8_channel":
        acc = xq @ qw.codes.long().t()
        return acc, acc.to(torch.int32).float() * sx[:, None] * qw.scale.float()[None, :]
    g = qw.group_size
    if qw.kind == "progressive":
        w8 = (qw.codes.long() - qw.zero.long().repeat_interleave(g, 1)) * qw.scale1.long().repeat_interleave(g, 1)
        acc = xq @ w8.t()
        return acc, acc.to(torch.int32).float() * sx[:, None] * qw.scale0.float()[None, :]
    out, accs = None, []
    for i in range(qw.scale.shape[1]):
        qz = qw.codes[:, i * g : (i + 1) * g].long() - qw.zero[:, i : i + 1].long()
        acc = xq[:, i * g : (i + 1) * g] @ qz.t()
        accs.append(acc)
        term = acc.to(torch.int32).float() * qw.scale[:, i].float()[None, :]
        out = term if out is None else out + term
    return torch.stack(accs), out * sx[:, None]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.describe())
def test_quant_linear_is_bit_exact(cfg):
    torch.manual_seed(0)
    n, k = 96, 576  # K not a multiple of 128, like SmolLM2
    w = torch.randn(n, k) * 0.05
    x = torch.randn(4, 13, k) * 3
    qw = WeightScheme(cfg).quantize(w)
    layer = QuantLinear(qw, None, 8)
    y = layer(x).reshape(-1, n)
    acc, expect = _independent(qw, x.reshape(-1, k))
    assert acc.abs().max() < 2**31  # INT32 accumulation cannot overflow
    assert torch.equal(y, expect), "reference path differs from the integer re-computation"


def test_w4a16_dequantizes_and_multiplies_in_float():
    torch.manual_seed(1)
    w = torch.randn(64, 200)
    qw = WeightScheme(WeightQuantConfig(4, 64, "asymmetric")).quantize(w)
    layer = QuantLinear(qw, torch.randn(64), 16)
    x = torch.randn(5, 200)
    assert torch.allclose(layer(x), x @ qw.dequantize().t() + layer.bias, rtol=1e-6, atol=1e-6)
