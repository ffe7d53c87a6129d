"""KV-cache quantization through transformers' attention interface.

We register one attention function, "qoqtool", that quantizes K (after RoPE, as the model
hands it over) and V per token and per KV head, then calls the ordinary SDPA attention.
Each attention module says how many KV bits it uses in its `qoq_kv_bits` attribute
(16: no quantization); calibration may set `qoq_observer(key, value)` to watch K and V.

Why re-quantizing the whole K/V on every call is exact: the quantization is per token, so
quantizing [cache; new] equals [quantized cache; quantized new]. The transformers cache
holds the unquantized values, and each step sees exactly what a 4-bit cache would return.
"""

from __future__ import annotations

import torch

from qoqtool.quantizers.activations import fake_quantize_kv

ATTENTION_NAME = "qoqtool"
_registered = False


def qoq_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    observer = getattr(module, "qoq_observer", None)
    if observer is not None:  # calibration statistics of post-RoPE K and V
        observer(key, value)
    bits = getattr(module, "qoq_kv_bits", 16)
    if bits < 16:
        key = fake_quantize_kv(key, bits)
        value = fake_quantize_kv(value, bits)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register() -> str:
    """Register the attention function (and SDPA's mask builder) under ATTENTION_NAME."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION_NAME, qoq_attention)
        try:
            from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

            AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
        except ImportError:  # older transformers build masks without the interface
            pass
        _registered = True
    return ATTENTION_NAME


def enable_kv_quantization(model, bits: int) -> None:
    """Route every attention layer of `model` through qoq_attention with `bits`-bit K/V."""
    name = register()
    for module in model.modules():
        if hasattr(module, "k_proj") and hasattr(module, "o_proj"):
            module.qoq_kv_bits = bits
    model.set_attn_implementation(name)
