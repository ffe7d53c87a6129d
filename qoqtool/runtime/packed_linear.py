"""`PackedLinear`: a linear layer that holds its weight in the kernels' packed layout.

Its buffers are exactly the tensors of a packed folder (`qoqtool.packing.layout`,
docs/format.md), so `load_state_dict` fills it straight from the file. The forward pass:

    x on CUDA, kernels built      qoqtool.runtime.cuda_ops.packed_linear_forward(self, x)
    otherwise (or no kernel for   unpack once into the quantized weight and run the exact
    this format)                  reference path, `QuantLinear`, on x's device

A linear with fp16 outliers also holds their Tile-COO section (docs/tile-coo.md) as the
buffers tc_entries, tc_start, tc_count; the reference path decodes it once and applies
exactly what `QuantLinear` applies. On CUDA, W4A8 linears (progressive, per-channel UINT4)
of at most `cuda_ops.FUSED_MAX_M` tokens run the fused sparse-dense kernel (the outliers inside
the dense stream kernel), W4A16 linears (UINT4, fp16 group scales) of at most
`cuda_ops.W4A16_MAX_M` tokens the fused W4A16 kernel, larger W4A16 inputs the reference path
(outliers included); larger W4A8 inputs (the wgmma kernel) and W8A8 still add them after the
dense kernel (`_sparse_term`, a stopgap). The reference path sees bit for bit the weight (and
outliers) `qoqtool quantize` wrote, so a packed model on the CPU computes exactly what its
quantized folder computes.
"""

from __future__ import annotations

import warnings
from collections import Counter

import torch
from torch import nn

from qoqtool.packing import tile_coo
from qoqtool.packing.layout import PackedLayout
from qoqtool.quantizers.formats import QuantizedWeight
from qoqtool.quantizers.outliers import SparseOutliers
from qoqtool.runtime.reference import QuantLinear

TILE_COO_BUFFERS = ("tc_entries", "tc_start", "tc_count")  # a linear's outliers, if it has any
_kernel_ops = None  # qoqtool.runtime.cuda_ops once loaded; False when the kernels are unavailable
# Calls of PackedLinear.forward by the path they took (cuda_ops.kernel_path, or REFERENCE_PATH):
# `qoqtool eval` reports them, so a run on a GPU shows that the kernels - and which ones - ran.
# (Counted in Python: a call captured into a CUDA graph counts once, not once per replay.)
path_calls: Counter[str] = Counter()
REFERENCE_PATH = "reference path"


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
                 bias: torch.Tensor | None = None, outliers: tile_coo.TileCOO | None = None):
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
        self.has_outliers = outliers is not None
        if outliers is not None:
            if outliers.shape != (layout.out_features, layout.in_features) or outliers.k_padded != layout.k_padded:
                raise ValueError(f"a Tile-COO section of {outliers.shape} (K padded {outliers.k_padded}) does not fit {layout}")
            for name, t in outliers.tensors().items():
                self.register_buffer(name, t)
        self.use_kernels = True  # cleared when the kernels have no path for this format

    @classmethod
    def pack(cls, weight: QuantizedWeight, bias: torch.Tensor | None, act_bits: int,
             outliers: SparseOutliers | None = None) -> "PackedLinear":
        """Pack a quantized weight, and its outliers (natural coordinates) into Tile-COO
        with the packed K (dense columns are not permuted: perm is the identity)."""
        layout = PackedLayout.of(weight)
        section = None if outliers is None else tile_coo.encode(outliers, layout.k_padded)
        return cls(layout, layout.pack(weight), act_bits, bias, section)

    @classmethod
    def empty(cls, layout: PackedLayout, act_bits: int, bias_dtype: torch.dtype | None,
              outlier_entries: int | None = None, device: str | torch.device = "meta") -> "PackedLinear":
        """Uninitialised buffers of the right shapes (filled later by load_state_dict);
        outlier_entries: the Tile-COO entries of a linear with outliers (None: none)."""
        spec = cls.spec_of(layout, outlier_entries)
        tensors = {name: torch.empty(shape, dtype=dtype, device=device) for name, (shape, dtype) in spec.items()}
        bias = None if bias_dtype is None else torch.empty(layout.out_features, dtype=bias_dtype, device=device)
        section = None
        if outlier_entries is not None:
            entries, start, count = (tensors.pop(name) for name in TILE_COO_BUFFERS)
            section = tile_coo.TileCOO(entries, start, count, (layout.out_features, layout.in_features), layout.k_padded)
        return cls(layout, tensors, act_bits, bias, section)

    @staticmethod
    def spec_of(layout: PackedLayout, outlier_entries: int | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of every buffer but the bias: the layout's, then Tile-COO's."""
        spec = dict(layout.spec())
        if outlier_entries is not None:
            nb = tile_coo.buckets_of(layout.out_features, layout.k_padded)
            spec["tc_entries"] = ((outlier_entries, tile_coo.ENTRY_BYTES), torch.uint8)
            spec["tc_start"] = (nb, torch.int32)
            spec["tc_count"] = (nb, torch.int32)
        return spec

    def extra_repr(self) -> str:
        group = f"g{self.group_size}" if self.group_size else "per-channel"
        extra = f", outliers in {self.tc_entries.shape[0]} Tile-COO entries" if self.has_outliers else ""
        return f"{self.in_features} -> {self.out_features}, packed {self.kind} {group}, a{self.act_bits}{extra}"

    def packed_tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.layout.spec()}

    def unpacked(self) -> QuantizedWeight:
        return self.layout.unpack(self.packed_tensors())

    def outlier_section(self) -> tile_coo.TileCOO | None:
        """The outliers' Tile-COO section (on the CPU), or None for a linear without outliers."""
        if not self.has_outliers:
            return None
        entries, start, count = (getattr(self, name).cpu() for name in TILE_COO_BUFFERS)
        return tile_coo.TileCOO(entries, start, count, (self.out_features, self.in_features), self.k_padded)

    def sparse(self) -> SparseOutliers | None:
        """The outliers in natural coordinates (validated and decoded once, cached on the
        buffers' device), or None."""
        if not self.has_outliers:
            return None
        found = self.__dict__.get("_sparse")
        if found is None:
            found = tile_coo.decode(self.outlier_section()).to(self.tc_entries.device)
            self.__dict__["_sparse"] = found  # a cache: dropped by _apply below
        return found

    def reference(self) -> QuantLinear:
        """The exact reference module, unpacked once and cached on the buffers' device."""
        ref = self.__dict__.get("_reference")
        if ref is None:
            ref = QuantLinear(self.unpacked(), self.bias, self.act_bits, outliers=self.sparse())
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
        for cache in ("_reference", "_sparse", "_merged"):  # (_merged: qoqtool.runtime.fusion)
            self.__dict__.pop(cache, None)
        return self

    def forward(self, x: torch.Tensor, quantized: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """y = x W^T (+ bias). `quantized`: x's per-token INT8 codes, scales and row sums,
        already computed by a fused kernel (qoqtool.runtime.fusion; CUDA, W4A8 only) - then x
        itself is never read, and gives only the output's dtype and leading shape."""
        if x.is_cuda and self.use_kernels:
            ops = _kernels()
            if ops is not None:
                path = ops.kernel_path(self, x.numel() // x.shape[-1])
                try:
                    y = ops.packed_linear_forward(self, x, quantized)  # outliers included unless PATH_SEPARATE
                    if path == ops.PATH_SEPARATE:
                        y = y + self._sparse_term(ops, x, quantized).to(y.dtype)
                    path_calls[path] += 1
                    return y
                except NotImplementedError:
                    self.use_kernels = False  # no kernel for this format: reference path from now on
        if quantized is not None:
            raise ValueError("a pre-quantized input needs the CUDA kernels")
        path_calls[REFERENCE_PATH] += 1
        return self.reference()(x)

    def _sparse_term(self, ops, x: torch.Tensor, quantized=None) -> torch.Tensor:
        """The outliers' product on CUDA, in torch, after the dense kernel.

        STOPGAP where the fused sparse-dense kernel does not apply (more than
        cuda_ops.FUSED_MAX_M tokens, i.e. the wgmma kernel; W8A8): a separate sparse
        matmul that reloads the activations - the cost Tile-COO is designed to avoid. It
        multiplies the INT8 codes of the dense kernel's own quantizer (cached, so usually
        not computed twice) and applies the token scale last, as `QuantLinear` does.
        Tested only on a GPU (tests/test_packing_outliers.py, `gpu` mark).
        """
        x_q, x_scale, _ = quantized or ops._quantized_input(x, self.k_padded)
        y = self.sparse().matmul(x_q[:, : self.in_features].float()) * x_scale.float()[:, None]
        return y.reshape(*x.shape[:-1], self.out_features)
