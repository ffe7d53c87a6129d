"""One small adapter that names the pieces of a Llama-family causal LM.

Everything else in qoqtool (calibration, transforms, quantizers, packing) reaches into a
model only through this adapter, so supporting another architecture whose decoder layer
has the same shape (pre-norm attention + gated MLP) is a matter of listing it here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from qoqtool.errors import UserError

# Architectures whose decoder layers are, for quantization purposes, the same module tree:
# RMSNorm -> q/k/v (RoPE) -> attention -> o, RMSNorm -> gate/up -> SiLU -> down.
# Qwen2 adds biases on q/k/v, which every transform below carries along; Qwen3 an RMSNorm
# over each head's queries and keys between q/k_proj and RoPE (q_norm, k_norm: one weight
# [head_dim] shared by all heads), which SmoothAttention folds its scales into.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# The seven quantized linears of a decoder layer, in execution order.
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def check_supported(config) -> None:
    """Raise a one-line UserError for architectures qoqtool cannot quantize."""
    archs = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    if any(a in SUPPORTED_ARCHITECTURES for a in archs) or model_type in SUPPORTED_MODEL_TYPES:
        return
    found = archs[0] if archs else f"model_type={model_type!r}"
    raise UserError(
        f"unsupported architecture {found}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def attention_window(config) -> int | None:
    """The sliding attention window that transformers applies to this model, or None: Mistral
    whenever its config sets one (Mistral-7B-v0.1: 4096), Qwen2/Qwen3 only for layers marked
    "sliding_attention" (use_sliding_window in older configs), Llama never."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    if getattr(config, "model_type", None) in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        return None
    return int(window)


@dataclass
class LayerParts:
    """The named modules of one decoder layer."""

    layer: nn.Module
    input_norm: nn.Module
    attn: nn.Module
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    o_proj: nn.Linear
    post_norm: nn.Module
    mlp: nn.Module
    gate_proj: nn.Linear
    up_proj: nn.Linear
    down_proj: nn.Linear
    q_norm: nn.Module | None = None  # Qwen3: RMSNorm of each query head, before RoPE
    k_norm: nn.Module | None = None  # ... and of each key head

    def linears(self) -> dict[str, nn.Module]:
        return {name: getattr(self, name) for name in LINEAR_NAMES}


class ModelAdapter:
    """Names the pieces of a Llama/Mistral/Qwen2/Qwen3 causal LM (transformers' module tree)."""

    def __init__(self, model: nn.Module):
        check_supported(model.config)
        self.model = model
        self.config = model.config
        cfg = model.config
        self.hidden_size: int = cfg.hidden_size
        self.num_heads: int = cfg.num_attention_heads
        self.num_kv_heads: int = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim: int = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_layers: int = cfg.num_hidden_layers
        self.intermediate_size: int = cfg.intermediate_size
        self.attention_window: int | None = attention_window(cfg)

    def check_context(self, tokens: int) -> None:
        """ValueError if a sequence of `tokens` would reach past the model's sliding attention
        window: the paged KV cache (runtime.generate) attends to the whole context, so past the
        window it would compute another model than transformers' forward does."""
        if self.attention_window is not None and tokens > self.attention_window:
            raise ValueError(f"a sequence of {tokens} tokens reaches past this model's sliding attention window "
                             f"({self.attention_window} tokens), which the paged KV cache does not implement")

    # -- whole-model pieces -------------------------------------------------------------
    @property
    def decoder(self) -> nn.Module:
        return self.model.model

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.model.embed_tokens

    @property
    def final_norm(self) -> nn.Module:
        return self.model.model.norm

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.lm_head

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.model.layers

    def parts(self, index_or_layer) -> LayerParts:
        layer = self.layers[index_or_layer] if isinstance(index_or_layer, int) else index_or_layer
        attn, mlp = layer.self_attn, layer.mlp
        return LayerParts(
            layer=layer,
            input_norm=layer.input_layernorm,
            attn=attn,
            q_proj=attn.q_proj,
            k_proj=attn.k_proj,
            v_proj=attn.v_proj,
            o_proj=attn.o_proj,
            post_norm=layer.post_attention_layernorm,
            mlp=mlp,
            gate_proj=mlp.gate_proj,
            up_proj=mlp.up_proj,
            down_proj=mlp.down_proj,
            q_norm=getattr(attn, "q_norm", None),
            k_norm=getattr(attn, "k_norm", None),
        )

    # -- tied embeddings ----------------------------------------------------------------
    def embeddings_tied(self) -> bool:
        return self.lm_head.weight.data_ptr() == self.embed_tokens.weight.data_ptr()

    def untie_embeddings(self) -> bool:
        """Give lm_head its own weight (transforms that change one side need this).

        Returns True when the model was tied before. The config is updated so that a
        saved and reloaded model stays untied.
        """
        if not self.embeddings_tied():
            return False
        self.lm_head.weight = nn.Parameter(self.embed_tokens.weight.detach().clone())
        self.config.tie_word_embeddings = False
        if hasattr(self.config, "text_config"):
            self.config.text_config.tie_word_embeddings = False
        return True

    def linear_names(self) -> list[str]:
        """Qualified names of every quantized linear, in execution order."""
        names = []
        for i in range(self.num_layers):
            for name in LINEAR_NAMES:
                sub = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                names.append(f"model.layers.{i}.{sub}.{name}")
        return names

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype
