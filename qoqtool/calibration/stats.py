"""Activation statistics gathered while calibrating.

For every linear input: per-channel mean square (the diagonal of the GPTQ/SpQR Hessian
up to a factor 2) and per-channel absolute maximum (what smoothing and reordering use).
The full Hessian X^T X is gathered only where a step needs it (GPTQ), since it is K x K.
Linears that share an input (q/k/v, gate/up) share one accumulator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from qoqtool.calibration.runner import LayerInputs, forward_hooks, run_layer
from qoqtool.models.adapter import LayerParts

# Which linear's input each accumulator watches, and which linears read that input.
SHARED_INPUTS = {
    "q_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


@dataclass
class InputStats:
    tokens: int
    sum_sq: torch.Tensor  # [K] float64
    absmax: torch.Tensor  # [K] float32
    xtx: torch.Tensor | None = None  # [K, K] float64 (sum over tokens of x x^T)

    @property
    def mean_sq(self) -> torch.Tensor:
        return (self.sum_sq / max(self.tokens, 1)).float()

    def hessian(self) -> torch.Tensor:
        """GPTQ's H = 2/n X^T X, float32."""
        return (2.0 / max(self.tokens, 1) * self.xtx).float()

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1])
        self.tokens += x.shape[0]
        xd = x.double()
        self.sum_sq += (xd * xd).sum(0).to(self.sum_sq.device)
        self.absmax = torch.maximum(self.absmax, x.abs().amax(0).float().to(self.absmax.device))
        if self.xtx is not None:
            # one batch in float32 (fast), accumulated across batches in float64
            xf = x.float()
            self.xtx += (xf.t() @ xf).double().to(self.xtx.device)

    @classmethod
    def empty(cls, k: int, device, with_hessian: bool) -> "InputStats":
        xtx = torch.zeros(k, k, dtype=torch.float64, device=device) if with_hessian else None
        return cls(0, torch.zeros(k, dtype=torch.float64, device=device), torch.zeros(k, device=device), xtx)


@torch.no_grad()
def collect_input_stats(
    parts: LayerParts, inputs: LayerInputs, device, with_hessian: bool = False, batch_size: int = 8,
    sources: tuple[str, ...] = tuple(SHARED_INPUTS),
) -> tuple[dict[str, InputStats], torch.Tensor]:
    """Run the layer over `inputs`; return stats keyed by linear name, and the layer output.
    sources: which of SHARED_INPUTS to watch (their readers are the keys returned)."""
    watched: dict[str, nn.Module] = {name: getattr(parts, name) for name in sources}
    acc = {
        name: InputStats.empty(module.in_features, device, with_hessian) for name, module in watched.items()
    }
    with forward_hooks(watched, lambda name, x: acc[name].add(x)):
        out = run_layer(parts.layer, inputs, device, batch_size)
    return {reader: acc[src] for src in sources for reader in SHARED_INPUTS[src]}, out
