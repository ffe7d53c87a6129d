"""The kernels between packed linears on CUDA: one launch where torch would take several.

A W4A8 linear quantizes its input per token before its GEMM. Where a norm or the MLP's
product feeds packed linears, the fused kernels (kernels/fused_ops.cu) compute that input
and its INT8 codes in one pass, so the fp16 tensor between them is never written:

    normed_linears(norm, h, (q, k, v))   RMSNorm + per-token quantization, once for all three,
                                         and one GEMM for all three (merged_linear)
    add_normed_linears(norm, h, delta, linears)
                                         the same after the residual add h + delta, in the
                                         norm's kernel (add_rmsnorm_quantize); for linears
                                         that take fp16 (an fp16 model's), the add and the norm
                                         in one kernel without the quantization (add_rmsnorm)
    mlp_output(mlp, gate, up)            silu(gate) * up + quantization, feeding down_proj; where
                                         the recipe rotates down_proj's input online, the
                                         rotation too (silu_mul_rotate_quantize)
    rotary_queries_and_keys(parts, q, k, cos, sin)
                                         queries and keys from the projections to attention:
                                         Qwen3's per-head norms, RoPE, the key rotation and
                                         shift in one kernel (qk_norm_rope), for any fp16 model

Each falls back to the modules' own forward (the same computation, unfused) wherever the
fused kernel does not apply: on the CPU, for linears that are not packed W4A8 linears running
kernels, for inputs that are not fp16, for a norm that is not a plain RMSNorm with an fp16
weight, and for an MLP whose online down_proj rotation has a form the kernel does not take (a
third Kronecker factor, a second one larger than 32 x 32 - Llama-2's 11008 = 2 x 5504 - or a
Sylvester factor outside 32..1024). The fused ops round as the unfused path does (fp16 norm output,
then the per-token scale) but sum in another order, so they agree with it up to rounding, not
bit for bit. QOQTOOL_FUSED_NORMS=0 turns them off (to measure what they save).

Linears that read one quantized input (q, k, v; gate, up) also run as one GEMM over their
stacked rows: merged_linear builds that packed linear once, and the linears' own buffers
become views into its buffers, so the weights are stored once (such a model is for running:
safetensors refuses to save tensors that share memory). The INT32 sums, and so the outputs,
are those of the separate GEMMs.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from qoqtool.packing.layout import PackedLayout
from qoqtool.runtime.cuda_ops import aligned_rows
from qoqtool.runtime.mlp import ROTATION
from qoqtool.runtime.packed_linear import PackedLinear, _kernels

ENABLED = os.environ.get("QOQTOOL_FUSED_NORMS", "1") != "0"
MERGE = True  # merged_linear where it applies (a switch for benchmarks/decode.py)
ROTATE = True  # the online down_proj rotation inside the quantization kernel where it applies (the same)
ROPE = True  # queries' and keys' norms, RoPE, rotation and shift in one kernel where it applies (the same)
ADD = True  # the residual add inside the next norm's quantization kernel where it applies (the same)
FP16_NORMS = True  # norms (and the residual add) of linears with fp16 inputs in one kernel (the same)
SILU = {"SiLU", "SiLUActivation"}  # torch's, and transformers' (ACT2FN["silu"])


def _kernel_w4a8(linears, x: torch.Tensor) -> bool:
    """Whether every linear is a packed linear whose INT8-activation kernel takes x (fp16 on
    CUDA): not, for example, UINT4 with float group scales (the rtn-w4a8 recipes), which run
    the reference path from their unquantized input."""
    ops = _kernels() if ENABLED and x.is_cuda and x.dtype == torch.float16 else None
    return (ops is not None
            and all(isinstance(m, PackedLinear) and m.use_kernels and ops.int8_kernel_declines(m) is None
                    and m.in_features == x.shape[-1] for m in linears)
            and len({m.k_padded for m in linears}) == 1)


def _fp16_norm_kernel(norm: nn.Module, h: torch.Tensor) -> bool:
    """Whether add_rmsnorm / rmsnorm compute norm(h) (fp16 on CUDA, a plain RMSNorm, a row the
    kernel holds, a library that has them)."""
    ops = _kernels() if ENABLED and FP16_NORMS and h.is_cuda and h.dtype == torch.float16 else None
    return (ops is not None and _plain_rmsnorm(norm) and h.shape[-1] <= ops.MAX_QUANTIZE_K
            and ops.has_fused_norms())


def _plain_rmsnorm(norm: nn.Module) -> bool:
    """Llama/Mistral/Qwen2/Qwen3's RMSNorm: weight * fp16(x * rsqrt(mean(x^2) + eps)), fp16 weight."""
    weight = getattr(norm, "weight", None)
    return (type(norm).__name__.endswith("RMSNorm") and hasattr(norm, "variance_epsilon")
            and weight is not None and weight.dtype == torch.float16)


def normed_linears(norm: nn.Module, h: torch.Tensor, linears: tuple[nn.Module, ...]) -> list[torch.Tensor]:
    """[linear(norm(h)) for linear in linears], the norm and the quantization fused, and the
    linears merged into one GEMM, when they can be."""
    return add_normed_linears(norm, h, None, linears)[1]


def add_normed_linears(norm: nn.Module, h: torch.Tensor, delta: torch.Tensor | None,
                       linears: tuple[nn.Module, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(r, [linear(norm(r)) for linear in linears]) for the residual stream r = h + delta (h where
    delta is None): normed_linears with the decoder's residual add in the same kernel
    (add_rmsnorm_quantize, bit for bit the add then the norm) where it applies."""
    if _plain_rmsnorm(norm) and _kernel_w4a8(linears, h):
        args = (norm.weight, float(norm.variance_epsilon), linears[0].k_padded)
        h, quantized = _residual_norm(h, delta, lambda x: torch.ops.qoqtool.rmsnorm_quantize(x, *args),
                                      lambda x, d: torch.ops.qoqtool.add_rmsnorm_quantize(x, d, *args),
                                      fuse_add=ADD and _kernels().has_fused_norms())
        merged = merged_linear(linears) if MERGE else None
        if merged is not None:
            return h, list(merged(h, quantized=quantized).split([m.out_features for m in linears], dim=-1))
        return h, [linear(h, quantized=quantized) for linear in linears]
    if _fp16_norm_kernel(norm, h):  # linears that take the fp16 norm (an fp16 model's)
        args = (norm.weight, float(norm.variance_epsilon))
        h, (x,) = _residual_norm(h, delta, lambda x: (torch.ops.qoqtool.rmsnorm(x, *args),),
                                 lambda x, d: torch.ops.qoqtool.add_rmsnorm(x, d, *args), fuse_add=True)
        x = x.view(h.shape)
        return h, [linear(x) for linear in linears]
    if delta is not None:
        h = h + delta
    x = norm(h)
    return h, [linear(x) for linear in linears]


def _residual_norm(h: torch.Tensor, delta: torch.Tensor | None, norm_op, add_norm_op, fuse_add: bool):
    """(r, norm_op's outputs for r) for r = h + delta (h where delta is None), through a fused
    kernel: add_norm_op(h, delta) -> (r, *the same outputs) takes the add too where fuse_add and
    delta matches h; otherwise torch adds and norm_op(r) normalizes (rows 16-byte aligned)."""
    if delta is not None and fuse_add and delta.shape == h.shape and delta.dtype == h.dtype:
        total, *outputs = add_norm_op(aligned_rows(h), aligned_rows(delta))
        return total.view(delta.shape), tuple(outputs)
    if delta is not None:
        h = h + delta
    return h, tuple(norm_op(aligned_rows(h)))


def rotary_queries_and_keys(parts, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Post-RoPE queries and cached keys [B, heads, T, D] (rotated and shifted as
    attention.rotary_queries_and_cached_keys makes them) from the projections' q [B, T, Hq, D] and
    k [B, T, Hkv, D], normalized per head first where the layer has q/k norms (Qwen3): in one
    kernel where it applies - fp16 on CUDA, plain RMSNorms, a head size the kernel takes - as
    separate torch ops elsewhere. The kernel rounds as those ops do (bit for bit without norms
    and rotation, up to the order of sums with them)."""
    from qoqtool.runtime.attention import KEY_SHIFT, rotary_queries_and_cached_keys

    attn, q_norm, k_norm = parts.attn, parts.q_norm, parts.k_norm
    rotation, shift = getattr(attn, "qoq_key_rotation", None), getattr(attn, KEY_SHIFT, None)
    norms = q_norm is not None
    ops = _kernels() if (ENABLED and ROPE and q.is_cuda and q.dtype == k.dtype == cos.dtype == torch.float16
                         and (not norms or (_plain_rmsnorm(q_norm) and _plain_rmsnorm(k_norm)
                                            and q_norm.variance_epsilon == k_norm.variance_epsilon))
                         and (shift is None or shift.dtype == torch.float32)) else None
    if ops is not None and ops.qk_rope_fits(q.shape[-1], rotation is not None) and ops.has_qk_norm_rope():
        q, k = torch.ops.qoqtool.qk_norm_rope(
            q, k, cos.contiguous(), sin.contiguous(), q_norm.weight if norms else None, k_norm.weight if norms else None,
            float(q_norm.variance_epsilon) if norms else 0.0, None if rotation is None else rotation.to(q.dtype), shift)
        return q.transpose(1, 2), k.transpose(1, 2)
    if norms:
        q, k = q_norm(q), k_norm(k)
    return rotary_queries_and_cached_keys(attn, q.transpose(1, 2), k.transpose(1, 2), cos, sin)


def merged_linear(linears: tuple[PackedLinear, ...]) -> PackedLinear | None:
    """One packed linear whose rows are the linears' rows, stacked (cached on the first linear),
    or None where they cannot be stacked: other formats, K or devices, outliers (Tile-COO
    buckets would need re-basing), or rows that are not whole row tiles (padding between them)."""
    first = linears[0]
    cached = first.__dict__.get("_merged")  # (dropped by PackedLinear._apply, with the other caches)
    if cached is not None and cached[0] == tuple(map(id, linears)):
        return cached[1]
    layouts = [m.layout for m in linears]
    stackable = (len({(l.kind, l.in_features, l.group_size) for l in layouts}) == 1
                 and all(l.out_features == l.n_padded for l in layouts)
                 and not any(m.has_outliers for m in linears)
                 and len({m.act_bits for m in linears}) == 1
                 and len({m.qweight.device for m in linears}) == 1
                 and len({m.bias is None for m in linears}) == 1)
    merged = None
    if stackable:
        layout = PackedLayout(first.kind, sum(l.out_features for l in layouts), first.in_features, first.group_size)
        tensors = {name: torch.cat([getattr(m, name) for m in linears]) for name in layout.spec()}
        bias = None if first.bias is None else torch.cat([m.bias for m in linears])
        merged = PackedLinear(layout, tensors, first.act_bits, bias)
        for name in [*layout.spec(), *(["bias"] if bias is not None else [])]:  # store the weights once
            parts = getattr(merged, name).split([getattr(m, name).shape[0] for m in linears])
            for m, part in zip(linears, parts):
                m._buffers[name] = part
    first.__dict__["_merged"] = (tuple(map(id, linears)), merged)
    return merged


def mlp_output(mlp: nn.Module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """down_proj(act_fn(gate) * up) - rotated first where the recipe rotates it online
    (qoqtool.runtime.mlp) - the product, the rotation and the quantization fused when they can be."""
    down, rotation = mlp.down_proj, getattr(mlp, ROTATION, None)
    if type(mlp.act_fn).__name__ in SILU and gate.dtype == up.dtype and _kernel_w4a8((down,), gate):
        form = None if rotation is None else _fused_rotation(rotation)
        if rotation is None or form is not None:
            g, u = aligned_rows(gate), aligned_rows(up)  # (halves of a merged GEMM: copied)
            if form is None:
                quantized = torch.ops.qoqtool.silu_mul_quantize(g, u, down.k_padded)
            else:
                op, sylvester, factor = form
                quantized = op(g, u, factor, rotation.signs, sylvester, down.k_padded)
            return down(gate, quantized=quantized)
    x = mlp.act_fn(gate) * up
    if rotation is not None:
        x = rotation(x)
    return down(x)


# Second factors of an order up to this go to the CUDA-core kernel (the fp32 factor), larger ones
# to the tensor-core kernel (its sign bits). Measured on an H100 (benchmarks/rotation_forms.py):
# with the tensor cores for Llama-3's 28 too, a decode step was 3-6% slower.
BITS_ABOVE = 32


def _fused_rotation(rotation):
    """(op, a, factor) when a fused kernel takes rotation.fused_form() (cuda_ops.rotation_form_fits)
    in a library that has it: second factors of order up to BITS_ABOVE as the fp32 factor (CUDA
    cores), larger ones as their sign bits (tensor cores) - else None."""
    from qoqtool.runtime import cuda_ops

    form = rotation.fused_form() if ROTATE else None
    if form is None:
        return None
    sylvester, order = form[0], form[1].shape[0]
    cuda_cores = cuda_ops.rotation_form_fits(sylvester, order, bits=False) and cuda_ops.has_fused_rotation()
    tensor_cores = cuda_ops.rotation_form_fits(sylvester, order, bits=True) and cuda_ops.has_fused_rotation(bits=True)
    if tensor_cores and (order > BITS_ABOVE or not cuda_cores):
        return torch.ops.qoqtool.silu_mul_rotate_quantize_bits, sylvester, rotation.factor_bits
    return (torch.ops.qoqtool.silu_mul_rotate_quantize, *form) if cuda_cores else None
