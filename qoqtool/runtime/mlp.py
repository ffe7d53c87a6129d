"""Online rotation of down_proj's input (the rotate step's `down_hadamard`).

The MLP's product x = silu(gate) * up is not linear in anything a weight could absorb on the
way in, so a rotation of down_proj's input has to run at inference time: x' = x R with
R = random_hadamard(intermediate_size), and down_proj's weight W R (offline), which keeps
x' (W R)^T = x W^T. It spreads the product's outlier channels (the largest activations of
a Llama layer) over all channels, for the INT8 tokens and the INT4 groups of down_proj
alike - QuaRot's and SpinQuant's "R4". QServe's QoQ has no such rotation (its answer is
block-output smoothing); it is qoqtool's option.

R is applied in its Kronecker form, H = H_a (x) H_b (x) ..., never as a dense n x n matrix:
for a row x viewed as the matrix X [a, b], x (A (x) B) = vec(A^T X B). That costs
n (a + b + ...) multiply-adds per token instead of n^2 (n = 14336: 540 instead of 14336).
A Paley factor (over a prime field) of order above FFT_ABOVE (1024) is applied by FFT instead:
it is a bordered circulant (hadamard.paley_character), so X times it is a circular convolution,
O(m log m) per column and no m x m buffer - folders made with version 1 of the Hadamard
constructions rotate Llama-2's 11008 as 2 x 5504, which would otherwise cost 5504 multiply-adds
per value and a 121 MB factor in every layer (version 2, the default since 2026-12-06, builds
it as 32 x 344). On CUDA a rotation of Sylvester's factor times one more (of order at most 32 as
an fp32 matrix, or even up to 512 as sign bits on the tensor cores: `factor_bits`) runs inside
the quantization kernel instead (runtime.fusion).
"""

from __future__ import annotations

import types

import torch
from torch import nn

from qoqtool.recipe import saved_step
from qoqtool.runtime.cuda_ops import hadamard_sign_bits
from qoqtool.transforms.hadamard import build_factor, constructions, is_prime, paley_character, random_signs

ROTATION = "qoq_down_rotation"  # the MLP's submodule
# Paley factors (over a prime) of a larger order are applied by FFT: Llama-2's 5504 in folders
# made with version 1 of the Hadamard constructions (a dense factor would be 116 MiB a layer);
# Qwen2.5-32B's 924 stays dense (3.4 MiB, and faster so on an H200:
# benchmarks/rotation.py, RESULTS.md "The down_proj rotation's large factors").
FFT_ABOVE = 1024


class KroneckerRotation(nn.Module):
    """x -> x H diag(s) / sqrt(n) for H = kron(factors): random_hadamard(n, seed), factored.
    Computed in float32 whatever x is (a half-precision sum over 512 channels could overflow),
    each factor scaled to be orthogonal on its own, so no intermediate grows."""

    def __init__(self, n: int, seed: int, version: int = 2):
        super().__init__()
        self.shapes, self.paley = [], {}  # paley: factor index -> (construction, q), applied by FFT
        for i, (m, kind, q) in enumerate(constructions(n, version)):
            self.shapes.append(m)
            # (Over a prime field the Jacobsthal matrix is a circulant; over GF(p^k) it is not.)
            if kind.startswith("paley") and m > FFT_ABOVE and is_prime(q):
                self.paley[i] = (kind, q)
                # x Q as a linear convolution with chi repeated twice, whose outputs q..2q-1 are
                # the circular ones, by power-of-two FFTs (a prime length q would take cuFFT's
                # several-kernel Bluestein path): the spectrum of [chi, chi] padded to 2^k >= 2q.
                self.register_buffer(f"spectrum{i}", torch.fft.rfft(paley_character(q).repeat(2), n=_fft_size(q))
                                     .to(torch.complex64), persistent=False)
            else:
                self.register_buffer(f"factor{i}", (build_factor(m, kind, q) / m**0.5).float(), persistent=False)
        self.register_buffer("signs", random_signs(n, seed).float(), persistent=False)
        if len(self.shapes) == 2 and not self.paley and self.shapes[1] > 1:  # the fused kernel's form of F
            self.register_buffer("factor_bits", hadamard_sign_bits(self.factor1), persistent=False)

    def _apply(self, fn, recurse=True):
        # A model cast to half keeps its rotation in float32 (see the class docstring): only
        # the device of a move is taken over.
        kept = dict(self._buffers)
        super()._apply(fn, recurse)
        for name, buf in kept.items():
            self._buffers[name] = buf.to(self._buffers[name].device)
        return self

    def fused_form(self) -> tuple[int, torch.Tensor] | None:
        """(a, F): the rotation as (H_a / sqrt(a)) (x) F diag(signs) with H_a Sylvester's matrix
        (hadamard.factors puts it first) and F the second factor (1 x 1 if there is none), the
        form qoqtool::silu_mul_rotate_quantize applies (F = H / sqrt(m) with H +-1: its sign bits
        are `factor_bits`, the form of qoqtool::silu_mul_rotate_quantize_bits); None for a third
        factor or one applied by FFT."""
        if len(self.shapes) > 2 or self.paley:
            return None
        second = self.factor1 if len(self.shapes) == 2 else self.signs.new_ones(1, 1)
        return self.shapes[0], second

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = x.float().reshape(-1, *self.shapes)
        for i, m in enumerate(self.shapes):
            # contract axis 1 with factor i; the new axis goes last, so after all factors the
            # axes are back in their order
            if i in self.paley:
                y = _paley_times(y.movedim(1, -1), *self.paley[i], getattr(self, f"spectrum{i}")) / m**0.5
            else:
                y = torch.tensordot(y, getattr(self, f"factor{i}"), dims=([1], [0]))
        return (y.reshape(shape) * self.signs).to(x.dtype)


def _fft_size(q: int) -> int:
    return 1 << (2 * q - 1).bit_length()  # the power of two >= 2q


def _paley_times(x: torch.Tensor, kind: str, q: int, spectrum: torch.Tensor) -> torch.Tensor:
    """x H along the last axis for H = hadamard._paley1(q) or _paley2(q), by FFT (float32).
    Both are built on the bordered circulant [[0, 1], [+-1, Q]], Q[i, j] = chi[(j - i) mod q]:
    for x = [x0, x'], x' Q is the circular convolution of x' with chi, i.e. outputs q..2q-1 of
    the linear convolution of x' with [chi, chi] (`spectrum`: its FFT of size 2^k >= 2q, which
    no index of those outputs wraps around)."""
    n = _fft_size(q)

    def conv(v, dim):  # v Q along `dim` (length q)
        full = torch.fft.irfft(torch.fft.rfft(v, n=n, dim=dim) * spectrum.reshape(-1, *[1] * (-1 - dim)), n=n, dim=dim)
        return full.narrow(dim, q, q)

    if kind == "paley1":  # H = I + S, S[0, 1:] = 1, S[1:, 0] = -1, S[1:, 1:] = Q
        x0, rest = x[..., :1], x[..., 1:]
        return torch.cat([x0 - rest.sum(-1, keepdim=True), rest + x0 + conv(rest, -1)], dim=-1)
    # paley2: H = C (x) A + I (x) B, C the symmetric [[0, 1], [1, Q]], A = [[1, 1], [1, -1]],
    # B = [[1, -1], [-1, -1]]; x as X [q + 1, 2] (index 2 i + k), x H = vec(C^T X A + X B).
    xs = x.unflatten(-1, (q + 1, 2))
    x0, rest = xs[..., :1, :], xs[..., 1:, :]
    cx = torch.cat([rest.sum(-2, keepdim=True), x0 + conv(rest, -2)], dim=-2)  # (C: no identity)
    (c0, c1), (a, b) = cx.unbind(-1), xs.unbind(-1)
    return torch.stack([c0 + c1 + a - b, c0 - c1 - a - b], dim=-1).flatten(-2)


def _rotated_forward(self, x):
    return self.down_proj(getattr(self, ROTATION)(self.act_fn(self.gate_proj(x)) * self.up_proj(x)))


def mlp_modules(model):
    """The MLP modules of a Llama-family model (gate_proj, up_proj, down_proj, act_fn)."""
    return [m for m in model.modules() if all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn"))]


def enable_down_rotation(model, intermediate_size: int, seed: int, version: int = 2) -> None:
    """Every MLP computes down_proj(R-rotated silu(gate) * up): attaches the rotation (not
    saved: the recipe recreates it; `version`: its Hadamard constructions) and overrides the
    module's forward."""
    device = model.get_input_embeddings().weight.device  # (down_proj may be a QuantLinear by now)
    for mlp in mlp_modules(model):
        rotation = KroneckerRotation(intermediate_size, seed, version).to(device)
        mlp.add_module(ROTATION, rotation)
        mlp.forward = types.MethodType(_rotated_forward, mlp)


def has_down_rotation(mlp) -> bool:
    return hasattr(mlp, ROTATION)


def down_rotation_seed(seed: int) -> int:
    """The rotation's seed from the rotate step's (residual seed, V seed + 1, keys seed + 2)."""
    return seed + 3


def configure_mlp(model, recipe: dict) -> None:
    """The MLP as a saved recipe (manifest form) runs it: the online down_proj rotation."""
    from qoqtool.models.adapter import ModelAdapter
    from qoqtool.runtime.attention import saved_hadamard_version

    rotate = saved_step(recipe, "rotate")
    if rotate and rotate.get("down_hadamard"):
        enable_down_rotation(model, ModelAdapter(model).intermediate_size, down_rotation_seed(rotate.get("seed", 0)),
                             saved_hadamard_version(rotate))
