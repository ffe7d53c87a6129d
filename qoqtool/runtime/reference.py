"""The exact reference path: quantized modules that compute what the kernels compute.

`QuantLinear` multiplies per-token INT8 activation codes by the weight's integer operand
with exact INT32 accumulation, then applies the scales (W4A8, W8A8), or dequantizes the
weight and multiplies in float (W4A16). KV-cache quantization is wired into transformers'
attention interface (`qoqtool.runtime.attention`), not by copying model code.
"""

from __future__ import annotations

import torch
from torch import nn

from qoqtool.quantizers.activations import quantize_per_token
from qoqtool.quantizers.formats import QuantizedWeight


class QuantLinear(nn.Module):
    """A linear layer with a quantized weight, run on the exact reference path."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, act_bits: int, outliers=None):
        super().__init__()
        if act_bits not in (8, 16):
            raise ValueError(f"activations are INT8 (8) or unquantized (16), not {act_bits}")
        self.qweight = weight
        self.act_bits = act_bits
        # fp16 outliers (qoqtool.quantizers.outliers.SparseOutliers): residuals over the
        # dense codes, W = dequantize(codes) + S
        self.outliers = outliers
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None
        self._operand: torch.Tensor | None = None  # cached INT8 / float weight for the matmul

    def extra_repr(self) -> str:
        extra = f", {self.outliers.nnz} outliers" if self.outliers is not None else ""
        return f"{self.in_features} -> {self.out_features}, {self.qweight.kind}, a{self.act_bits}{extra}"

    def _apply(self, fn, recurse=True):
        # Keep the (non-parameter) quantized weight on the module's device.
        super()._apply(fn, recurse)
        probe = fn(torch.empty(0))
        self.qweight.to(probe.device)
        if self.outliers is not None:
            self.outliers.to(probe.device)
        self._operand = None
        return self

    def operand(self) -> torch.Tensor:
        if self._operand is None:
            if self.act_bits == 8:
                self._operand = self.qweight.int8_operand()
            else:
                self._operand = self.qweight.dequantize()
                if self.outliers is not None:
                    self._operand += self.outliers.to_dense()  # W4A16: dense + sparse in float
        return self._operand

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.act_bits == 8:
            codes, scales = quantize_per_token(x2)
            y = self.qweight.linear_int8(codes, scales, self.operand())
            if self.outliers is not None:
                # The sparse term multiplies the same INT8 codes as the dense GEMM (a fused
                # kernel finds them in its activation tile) and takes the token scale last.
                y = y + self.outliers.matmul(codes) * scales[:, None]
        else:
            y = x2.float() @ self.operand().t()
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)


class ActQuantLinear(nn.Module):
    """A float linear whose input is per-token INT8 fake-quantized (used while calibrating)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        from qoqtool.quantizers.activations import fake_quantize_per_token

        return self.linear(fake_quantize_per_token(x))
