"""The layer-by-layer calibration runner.

Only one decoder layer is on the device at a time. The runner captures the inputs of
layer 0 (and the keyword arguments the model passes its layers: rotary embeddings, mask),
then, for each layer in turn, lets the caller transform and quantize it, and runs the
*quantized* layer to produce the next layer's inputs - so every layer is calibrated on the
activations it will really see. Hidden states live on the CPU between layers and move to
the device one batch at a time, so device memory does not grow with depth or data.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from qoqtool.models.adapter import ModelAdapter


class _StopForward(Exception):
    pass


class _Catcher(nn.Module):
    """Stands in for layer 0: records its inputs, then stops the forward pass."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer
        self.inputs: list[torch.Tensor] = []
        self.kwargs: dict | None = None
        # transformers reads these off layers while it builds masks
        self.attention_type = getattr(layer, "attention_type", "full_attention")

    def forward(self, hidden_states, *args, **kwargs):
        self.inputs.append(hidden_states.detach().cpu())
        if self.kwargs is None:
            self.kwargs = kwargs
        raise _StopForward


@dataclass
class LayerInputs:
    """Hidden states entering one layer ([N, L, H] on the CPU) and the layer kwargs.

    layer_masks: where layers attend differently (Qwen2/Qwen3 with sliding-window layers, or
    any config whose `layer_types` mix kinds), each layer's attention_mask, which replaces the
    one in kwargs for `layer`, the layer these hidden states enter; None: kwargs' own for all."""

    hidden: torch.Tensor
    kwargs: dict = field(default_factory=dict)
    layer_masks: list | None = None
    layer: int = 0


@torch.no_grad()
def capture_first_layer_inputs(adapter: ModelAdapter, tokens: torch.Tensor, device) -> LayerInputs:
    """Embed all calibration samples and capture what layer 0 receives."""
    catcher = _Catcher(adapter.layers[0])
    with _standing_in(adapter, catcher, device):
        for i in range(tokens.shape[0]):
            _run_to_layer0(adapter, tokens[i : i + 1], device)
    kwargs = {k: _to_device(v, "cpu") for k, v in (catcher.kwargs or {}).items()}
    hidden = torch.cat(catcher.inputs)
    return LayerInputs(hidden.to(device) if fits_on_device(hidden, device) else hidden, kwargs,
                       _layer_masks(adapter, tokens[:1], device))


@contextmanager
def _standing_in(adapter: ModelAdapter, catcher: _Catcher, device):
    """The catcher in layer 0's place, and everything before layer 0 (embeddings, rotary
    tables) on the device, for as long as the block runs."""
    layers, first = adapter.layers, adapter.layers[0]
    pre = [adapter.embed_tokens, adapter.decoder.rotary_emb] if hasattr(adapter.decoder, "rotary_emb") else [adapter.embed_tokens]
    layers[0] = catcher
    for module in pre:
        module.to(device)
    try:
        yield
    finally:
        layers[0] = first
        if str(device) != "cpu":
            for module in pre:
                module.to("cpu")


def _run_to_layer0(adapter: ModelAdapter, window: torch.Tensor, device) -> None:
    try:
        adapter.model(window.to(device), use_cache=False)
    except _StopForward:
        pass


def _layer_masks(adapter: ModelAdapter, window: torch.Tensor, device) -> list | None:
    """Each layer's attention_mask when the config's layer_types mix kinds, else None. The model
    builds one mask per kind and hands layer i the one of layer_types[i]: captured by running
    one window with layer 0 standing in for each kind in turn (a mask depends on the window's
    length, not on its tokens)."""
    types = getattr(adapter.config, "layer_types", None)
    if not types or len(set(types)) == 1:
        return None
    first_type, masks = types[0], {}
    try:
        for kind in dict.fromkeys(types):
            types[0] = kind
            catcher = _Catcher(adapter.layers[0])
            catcher.attention_type = kind
            with _standing_in(adapter, catcher, device):
                _run_to_layer0(adapter, window, device)
            masks[kind] = _to_device(catcher.kwargs.get("attention_mask"), "cpu")
    finally:
        types[0] = first_type
    return [masks[kind] for kind in types]


def fits_on_device(hidden: torch.Tensor, device) -> bool:
    """Keep the hidden states on a GPU when inputs and outputs take under a quarter of its free memory."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    free, _ = torch.cuda.mem_get_info(device)
    return 2 * hidden.numel() * hidden.element_size() < free // 4


def _to_device(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_to_device(v, device) for v in value)
    return value


def layer_kwargs(inputs: LayerInputs, device) -> dict:
    kwargs = dict(inputs.kwargs)
    if inputs.layer_masks is not None:
        kwargs["attention_mask"] = inputs.layer_masks[inputs.layer]
    kwargs = {k: _to_device(v, device) for k, v in kwargs.items()}
    for key in ("past_key_values", "past_key_value", "cache"):
        kwargs.pop(key, None)
    kwargs["use_cache"] = False
    return kwargs


@torch.no_grad()
def run_layer(layer: nn.Module, inputs: LayerInputs, device, batch_size: int = 8) -> torch.Tensor:
    """Run `layer` over all hidden states in batches; returns [N, L, H] where the inputs live."""
    kwargs = layer_kwargs(inputs, device)
    outs = []
    for start in range(0, inputs.hidden.shape[0], batch_size):
        x = inputs.hidden[start : start + batch_size].to(device)
        y = layer(x, **kwargs)
        y = y[0] if isinstance(y, tuple) else y
        outs.append(y.detach().to(inputs.hidden.device, inputs.hidden.dtype))
    return torch.cat(outs)


@contextmanager
def forward_hooks(modules: dict[str, nn.Module], fn):
    """Call fn(name, module_input) on every forward of each named module."""
    handles = [
        module.register_forward_hook(lambda mod, args, out, name=name: fn(name, args[0]))
        for name, module in modules.items()
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
