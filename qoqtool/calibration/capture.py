"""Capture what layer steps need from one pass of a layer over its calibration inputs:
per-channel absolute maxima of linear inputs, a seeded subsample of those inputs (for grid
searches), the absolute maxima of post-RoPE keys per KV head and channel, and the sum of
the keys as the cache stores them (after the optional key rotation).

The pipeline captures once per layer, before the layer steps; each step that rescales or
permutes a watched input updates the capture exactly (`scale_input`, `permute_input`,
`scale_keys`), so the steps after it see the statistics of the transformed layer without
another pass over the data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from qoqtool.calibration.runner import forward_hooks, layer_kwargs
from qoqtool.runtime.attention import cached_keys


@dataclass
class LayerCapture:
    absmax: dict[str, torch.Tensor] = field(default_factory=dict)  # linear name -> [K]
    samples: dict[str, torch.Tensor] = field(default_factory=dict)  # linear name -> [T, K] float32
    key_absmax: torch.Tensor | None = None  # [kv_heads, head_dim]
    # The cached keys (rotated if the layer rotates them), as observed, if asked (key_sums):
    # not kept up to date by the steps (center_keys, their only reader, captures afresh).
    key_sum: torch.Tensor | None = None  # [kv_heads, head_dim], float64
    key_count: int = 0  # tokens observed (per KV head)

    def scale_input(self, name: str, factor: torch.Tensor) -> None:
        """The input of `name` became x * factor (per channel, factor > 0)."""
        factor = factor.float().cpu()
        self.absmax[name] = self.absmax[name] * factor
        if name in self.samples:
            self.samples[name] = self.samples[name] * factor

    def permute_input(self, name: str, perm: torch.Tensor) -> None:
        """The input of `name` became x[:, perm]."""
        perm = perm.cpu()
        self.absmax[name] = self.absmax[name][perm]
        if name in self.samples:
            self.samples[name] = self.samples[name][:, perm]

    def scale_keys(self, factor: torch.Tensor) -> None:
        """Keys became k * factor ([kv_heads, head_dim], factor > 0)."""
        self.key_absmax = self.key_absmax * factor.float().cpu()


@torch.no_grad()
def capture_layer(ctx, names: tuple[str, ...], max_tokens: int = 2048, keys: bool = False, seed: int = 0,
                  key_sums: bool = False) -> LayerCapture:
    """Run ctx.parts.layer over ctx.inputs; watch the inputs of the named linears."""
    parts, inputs = ctx.parts, ctx.inputs
    n, length = inputs.hidden.shape[:2]
    total = n * length
    gen = torch.Generator().manual_seed(seed * 7919 + ctx.index)
    cap = LayerCapture()
    chunks: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    keep_per_batch: list[torch.Tensor] = []  # indices chosen for the current batch

    def watch(name, x):
        x2 = x.reshape(-1, x.shape[-1]).float()
        amax = x2.abs().amax(0).cpu()
        cap.absmax[name] = amax if name not in cap.absmax else torch.maximum(cap.absmax[name], amax)
        if max_tokens:
            chunks[name].append(x2[keep_per_batch[-1].to(x2.device)].cpu())

    def observe(key, value):
        amax = key.float().abs().amax(dim=(0, 2)).cpu()  # key [B, kv_heads, T, d]
        cap.key_absmax = amax if cap.key_absmax is None else torch.maximum(cap.key_absmax, amax)
        if key_sums:
            total = cached_keys(parts.attn, key).double().sum(dim=(0, 2)).cpu()
            cap.key_sum = total if cap.key_sum is None else cap.key_sum + total
            cap.key_count += key.shape[0] * key.shape[2]

    modules = {name: getattr(parts, name) for name in names}
    if keys:
        parts.attn.qoq_observer = observe
    kwargs = layer_kwargs(inputs, ctx.device)
    try:
        with forward_hooks(modules, watch):
            for start in range(0, n, ctx.batch_size):
                x = inputs.hidden[start : start + ctx.batch_size].to(ctx.device)
                rows = x.shape[0] * length
                take = min(rows, -(-max_tokens * rows // total)) if max_tokens else 0
                keep_per_batch.append(torch.randperm(rows, generator=gen)[:take])
                parts.layer(x, **kwargs)
    finally:
        parts.attn.qoq_observer = None
    cap.samples = {name: torch.cat(c) for name, c in chunks.items() if c}
    return cap
