"""KV-cache quantization through transformers' attention interface.

We register one attention function, "qoqtool", that quantizes K (after RoPE, as the model
hands it over) and V per token and per KV head, then calls the ordinary SDPA attention.
Each attention module says how many KV bits it uses in its `qoq_kv_bits` attribute
(16: no quantization); calibration may set `qoq_observer(key, value)` to watch K and V.
A recipe may also rotate the post-RoPE queries and keys of every head by a Hadamard matrix
(`qoq_key_rotation`) and shift the keys by a calibrated per-channel vector (`qoq_key_shift`,
the center_keys step; softmax does not see it) before they are quantized; `prepare_attention`
and `configure_attention` (run by runtime.loading.finish_loading) set these up from a saved
recipe.

Why re-quantizing the whole K/V on every call is exact: the quantization is per token, so
quantizing [cache; new] equals [quantized cache; quantized new]. The transformers cache
holds the unquantized values, and each step sees exactly what a 4-bit cache would return.
"""

from __future__ import annotations

import torch

from qoqtool.quantizers.activations import fake_quantize_kv
from qoqtool.recipe import saved_step

ATTENTION_NAME = "qoqtool"
KEY_SHIFT = "qoq_key_shift"  # the attention module's buffer of center_keys' shift
_registered = False


def qoq_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    observer = getattr(module, "qoq_observer", None)
    if observer is not None:  # calibration statistics of post-RoPE K and V
        observer(key, value)
    query, key = queries_and_cached_keys(module, query, key)
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


def attention_modules(model):
    """The attention modules of a Llama-family model (those with k_proj and o_proj)."""
    return [m for m in model.modules() if hasattr(m, "k_proj") and hasattr(m, "o_proj")]


def queries_and_cached_keys(module, query: torch.Tensor, key: torch.Tensor):
    """Post-RoPE queries and keys [B, heads, T, d] as attention over the cache sees them: both
    rotated by the module's key rotation (if any; orthogonal, so every q.k is kept), the keys
    then shifted by its key shift (if any)."""
    rotation = getattr(module, "qoq_key_rotation", None)
    if rotation is not None:  # online Hadamard: K's outlier channels spread over the head
        query = query @ rotation.to(query.dtype)
    return query, cached_keys(module, key)


def cached_keys(module, key: torch.Tensor) -> torch.Tensor:
    """The keys as the cache stores them, from post-RoPE keys [B, kv_heads, T, d]: rotated
    by the module's key rotation, then shifted by its key shift (each if it has one)."""
    rotation = getattr(module, "qoq_key_rotation", None)
    if rotation is not None:
        key = key @ rotation.to(key.dtype)
    return _shifted(module, key)


def _shifted(module, key: torch.Tensor) -> torch.Tensor:
    shift = getattr(module, KEY_SHIFT, None)
    if shift is not None:  # q.(k - c) = q.k - q.c: the same for every key of a query
        key = key - shift.to(key.dtype)[:, None, :]
    return key


def rotary_queries_and_cached_keys(module, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                                   sin: torch.Tensor):
    """queries_and_cached_keys(module, *apply_rotary_pos_emb(query, key, cos, sin)) for the
    paged-cache loop (qoqtool.runtime.generate): queries and keys [B, heads, T, d] stacked
    along the heads, so that RoPE (the same expression as transformers') and the key rotation
    launch their kernels once for both instead of twice."""
    from transformers.models.llama.modeling_llama import rotate_half

    heads = query.shape[1]
    both = torch.cat((query, key), dim=1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    both = (both * cos) + (rotate_half(both) * sin)
    rotation = getattr(module, "qoq_key_rotation", None)
    if rotation is not None:
        both = both @ rotation.to(both.dtype)
    query, key = both.split([heads, both.shape[1] - heads], dim=1)
    return query, _shifted(module, key)


def set_key_shift(module, shift: torch.Tensor) -> None:
    """Store the key shift c [kv_heads, head_dim] on an attention module, as a buffer that is
    saved with the model (`self_attn.qoq_key_shift`)."""
    module.register_buffer(KEY_SHIFT, shift.float(), persistent=True)


def prepare_attention(model, recipe: dict) -> None:
    """Before a saved model's tensors are loaded: the buffers its recipe adds (key shifts)."""
    from qoqtool.models.adapter import ModelAdapter

    if saved_step(recipe, "center_keys") is not None:
        adapter = ModelAdapter(model)
        device = model.get_input_embeddings().weight.device  # meta while a saved model loads
        for module in attention_modules(model):
            set_key_shift(module, torch.zeros(adapter.num_kv_heads, adapter.head_dim, device=device))


def enable_key_rotation(model, head_dim: int, seed: int, version: int = 2) -> None:
    """Rotate every layer's post-RoPE queries and keys by one seeded random Hadamard matrix
    of order head_dim (the `key_hadamard` option of the rotate step), so that the KV cache
    stores rotated keys. RoPE does not commute with a dense rotation, so this one runs
    online, after RoPE: a head_dim x head_dim product per head and token. `version`: the
    rotate step's Hadamard constructions (qoqtool.transforms.hadamard)."""
    from qoqtool.transforms.hadamard import random_hadamard

    embeddings = model.get_input_embeddings().weight  # (its dtype: the queries' and keys', no cast per call)
    rotation = random_hadamard(head_dim, seed, version=version).to(device=embeddings.device, dtype=embeddings.dtype)
    for module in attention_modules(model):
        # A non-persistent buffer: it follows the module between devices (calibration moves
        # one layer at a time) and stays out of the state dict; the recipe recreates it.
        module.register_buffer("qoq_key_rotation", rotation, persistent=False)


def configure_attention(model, recipe: dict) -> None:
    """Attention as a saved recipe (manifest form) runs it: KV-cache bits, key rotation."""
    from qoqtool.models.adapter import ModelAdapter

    enable_kv_quantization(model, int(recipe["kv_cache"]["bits"]))
    rotate = saved_step(recipe, "rotate")
    if rotate and rotate.get("key_hadamard"):
        enable_key_rotation(model, ModelAdapter(model).head_dim, key_rotation_seed(rotate.get("seed", 0)),
                            saved_hadamard_version(rotate))


def saved_hadamard_version(rotate: dict) -> int:
    """The Hadamard constructions a saved rotate step used: its `hadamard`, or for a recipe
    saved before the parameter existed, version 1 (qoqtool.transforms.hadamard)."""
    from qoqtool.transforms.hadamard import SAVED_DEFAULT

    return int(rotate.get("hadamard", SAVED_DEFAULT))


def key_rotation_seed(seed: int) -> int:
    """The key rotation's seed from the rotate step's (the residual uses seed, V seed + 1)."""
    return seed + 2


def enable_kv_quantization(model, bits: int) -> None:
    """Route every attention layer of `model` through qoq_attention with `bits`-bit K/V."""
    name = register()
    for module in attention_modules(model):
        module.qoq_kv_bits = bits
    model.set_attn_implementation(name)
