"""`PackedLinear`: a linear layer that holds its weight in the kernels' packed layout.

Its buffers are exactly the tensors of a packed folder (`qoqtool.packing.layout`,
docs/format.md), so `load_state_dict` fills it straight from the file. The forward pass:

    x on CUDA, kernels built      qoqtool.runtime.cuda_ops.packed_linear_forward(self, x)
    otherwise (or no kernel for   unpack once into the quantized weight and run the exact
    this format)                  reference path, `QuantLinear`, on x's device

The reference path sees bit for bit the weight `qoqtool quantize` wrote, so a packed
model on the CPU computes exactly what its quantized folder computes.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from qoqtool.packing.layout import PackedLayout
from qoqtool.quantizers.formats import QuantizedWeight
from qoqtool.runtime.reference import QuantLinear

_kernel_ops = None  # qoqtool.runtime.cuda_ops once loaded; False when the kernels are unavailable


def _kernels():
    """The CUDA ops module, or None (with one warning) when it cannot be used."""
    global _kernel_ops
    if _kernel_ops is None:
        try:
            from qoqtool.runtime import cuda_ops, kernel_library

            kernel_library.library()
            _kernel_ops = cuda_ops
        except Exception as err:  # no cuda_ops module, no nvcc, a failed build: all mean "no kernels"
            warnings.warn(f"CUDA kernels unavailable ({err}); packed linears run the reference path", stacklevel=3)
            _kernel_ops = False
    return _kernel_ops or None


class PackedLinear(nn.Module):
    """A quantized linear stored packed; attributes and buffers per docs/format.md."""

    def __init__(self, layout: PackedLayout, tensors: dict[str, torch.Tensor], act_bits: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        if act_bits not in (8, 16):
            raise ValueError(f"activations are INT8 (8) or unquantized (16), not {act_bits}")
        layout.check(tensors)
        self.layout = layout
        self.kind = layout.kind
        self.in_features, self.out_features = layout.in_features, layout.out_features
        self.k_padded, self.n_padded = layout.k_padded, layout.n_padded
        self.group_size = layout.group_size
        self.act_bits = act_bits
        for name in layout.spec():
            self.register_buffer(name, tensors[name])
        self.register_buffer("bias", bias)
        self.use_kernels = True  # cleared when the kernels have no path for this format

    @classmethod
    def pack(cls, weight: QuantizedWeight, bias: torch.Tensor | None, act_bits: int) -> "PackedLinear":
        layout = PackedLayout.of(weight)
        return cls(layout, layout.pack(weight), act_bits, bias)

    @classmethod
    def empty(cls, layout: PackedLayout, act_bits: int, bias_dtype: torch.dtype | None,
              device: str | torch.device = "meta") -> "PackedLinear":
        """Uninitialised buffers of the right shapes (filled later by load_state_dict)."""
        tensors = {name: torch.empty(shape, dtype=dtype, device=device) for name, (shape, dtype) in layout.spec().items()}
        bias = None if bias_dtype is None else torch.empty(layout.out_features, dtype=bias_dtype, device=device)
        return cls(layout, tensors, act_bits, bias)

    def extra_repr(self) -> str:
        group = f"g{self.group_size}" if self.group_size else "per-channel"
        return f"{self.in_features} -> {self.out_features}, packed {self.kind} {group}, a{self.act_bits}"

    def packed_tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.layout.spec()}

    def unpacked(self) -> QuantizedWeight:
        return self.layout.unpack(self.packed_tensors())

    def reference(self) -> QuantLinear:
        """The exact reference module, unpacked once and cached on the buffers' device."""
        ref = self.__dict__.get("_reference")
        if ref is None:
            ref = QuantLinear(self.unpacked(), self.bias, self.act_bits)
            # A cache, not a child module: kept out of state_dict(), dropped by _apply below.
            self.__dict__["_reference"] = ref
        return ref

    def _apply(self, fn, recurse=True):
        # model.float() / .half() must not change the packed parameters' dtypes (the kernels
        # read fp16 scales); only the bias follows the model. Moving devices drops the cache.
        dtypes = {name: t.dtype for name, t in self._buffers.items() if t is not None and name != "bias"}
        super()._apply(fn, recurse)
        for name, dtype in dtypes.items():
            if self._buffers[name].dtype != dtype:
                self._buffers[name] = self._buffers[name].to(dtype)
        self.__dict__.pop("_reference", None)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.use_kernels:
            ops = _kernels()
            if ops is not None:
                try:
                    return ops.packed_linear_forward(self, x)
                except NotImplementedError:
                    self.use_kernels = False  # no kernel for this format: reference path from now on
        return self.reference()(x)
