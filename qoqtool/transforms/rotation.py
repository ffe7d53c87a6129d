"""Block-input rotation: rotate the residual stream by an orthogonal Hadamard matrix.

With every RMSNorm's weight folded into the linears it feeds, RMSNorm commutes with any
orthogonal Q (it only divides by the norm, which Q preserves). So the residual stream can
be rotated, r' = r Q, by rewriting weights alone - no rotation at run time:

    embeddings        E  <- E Q                 (rows are residual vectors)
    q/k/v, gate/up    W  <- W diag(gamma) Q     (read the rotated, normalised residual)
    o_proj, down_proj W  <- Q^T W, b <- b Q     (write into the rotated residual)
    lm_head           W  <- W diag(gamma_f) Q

A Hadamard Q spreads each outlier channel of the residual over all channels, which is
what lets per-token INT8 activations and per-group INT4 weights fit. Optionally, V is
rotated per head too (v' = v H_d, o_proj's per-head input columns rotated back): the
attention output is a convex combination of V rows, so this is exact, and it spreads V's
outliers before the 4-bit KV cache sees them.

Keys cannot be rotated offline: RoPE, applied between k_proj and the cache, does not commute
with a dense rotation. With key_hadamard the post-RoPE queries and keys of every head are
rotated at run time by one Hadamard H (q H (k H)^T = q k^T, so this is exact too), which
spreads K's outlier channels before the 4-bit cache, as QuaRot does; it is not part of
QServe's QoQ, whose answer to K's outliers is SmoothAttention alone.

With down_hadamard, down_proj's input is rotated at run time too (x' = x R, W <- W R;
qoqtool.runtime.mlp): the MLP's product silu(gate) * up carries a Llama layer's largest
activation outliers, and no weight can absorb a rotation of it. This is QuaRot's R4, not
part of QServe's QoQ (which smooths down_proj through up_proj instead); with it, the
smooth_output and reorder steps leave down_proj alone.

Tied embeddings cannot stay tied (E and lm_head change differently): they are untied and
the manifest says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qoqtool.calibration.steps import register_step
from qoqtool.models.adapter import ModelAdapter
from qoqtool.errors import UserError
from qoqtool.runtime.attention import enable_key_rotation, key_rotation_seed
from qoqtool.runtime.mlp import down_rotation_seed, enable_down_rotation
from qoqtool.transforms.hadamard import check_version, decompose, random_hadamard


@dataclass
class RotateParams:
    seed: int = 0  # signs of the random Hadamard matrix
    value_hadamard: bool = True  # also rotate V per head (o_proj inputs rotated back)
    key_hadamard: bool = False  # also rotate post-RoPE Q and K per head, online (not in QServe)
    down_hadamard: bool = False  # also rotate down_proj's input, online (not in QServe)
    hadamard: int = 2  # which Hadamard constructions (transforms/hadamard.py: 1 = prime fields only)

    def __post_init__(self):
        check_version(self.hadamard)


def _set(linear, weight: torch.Tensor) -> None:
    linear.weight.data = weight.to(linear.weight.dtype).contiguous()


@torch.no_grad()
def fold_norm(norm: torch.nn.Module, linears: list) -> None:
    """Fold an RMSNorm's weight into the linears reading its output; the norm weight becomes 1."""
    gamma = norm.weight.data.double()
    for linear in linears:
        _set(linear, linear.weight.data.double() * gamma[None, :])
    norm.weight.data.fill_(1.0)


@torch.no_grad()
def fold_all_norms(adapter: ModelAdapter) -> None:
    for i in range(adapter.num_layers):
        p = adapter.parts(i)
        fold_norm(p.input_norm, [p.q_proj, p.k_proj, p.v_proj])
        fold_norm(p.post_norm, [p.gate_proj, p.up_proj])
    fold_norm(adapter.final_norm, [adapter.lm_head])


def _rotate_input(linear, q: torch.Tensor) -> None:
    _set(linear, linear.weight.data.double() @ q)


def _rotate_output(linear, q: torch.Tensor) -> None:
    _set(linear, q.t() @ linear.weight.data.double())
    if linear.bias is not None:
        linear.bias.data = (linear.bias.data.double() @ q).to(linear.bias.dtype)


@torch.no_grad()
def rotate_values(adapter: ModelAdapter, seed: int, version: int) -> None:
    """v' = v H_d per KV head; o_proj's input columns of every query head rotated back."""
    d, kv_heads, heads = adapter.head_dim, adapter.num_kv_heads, adapter.num_heads
    h = random_hadamard(d, seed + 1, version=version)
    for i in range(adapter.num_layers):
        p = adapter.parts(i)
        wv = p.v_proj.weight.data.double().reshape(kv_heads, d, -1)
        _set(p.v_proj, torch.einsum("de,hdk->hek", h, wv).reshape(kv_heads * d, -1))
        if p.v_proj.bias is not None:
            bv = p.v_proj.bias.data.double().reshape(kv_heads, d)
            p.v_proj.bias.data = (bv @ h).reshape(-1).to(p.v_proj.bias.dtype)
        wo = p.o_proj.weight.data.double().reshape(-1, heads, d)
        _set(p.o_proj, torch.einsum("nhd,de->nhe", wo, h).reshape(-1, heads * d))


def check_sizes(adapter: ModelAdapter, params: RotateParams) -> None:
    """Refuse, before touching any weight, a size that has no Hadamard matrix."""
    hint = "(Hadamard orders are 2^a times a Paley order such as 12, 20, 28, 36, 44, 60)"
    version = params.hadamard
    if decompose(adapter.hidden_size, version) is None:
        raise UserError(
            f"this model's hidden size {adapter.hidden_size} has no Hadamard rotation {hint}; "
            "use a recipe without the rotate step (e.g. rtn-w4a8kv4-g128) or remove it from your recipe"
        )
    if (params.value_hadamard or params.key_hadamard) and decompose(adapter.head_dim, version) is None:
        raise UserError(
            f"this model's head_dim {adapter.head_dim} has no Hadamard rotation {hint}; "
            "set `rotate: {value_hadamard: false, key_hadamard: false}` in the recipe"
        )
    if params.down_hadamard and decompose(adapter.intermediate_size, version) is None:
        raise UserError(
            f"this model's intermediate size {adapter.intermediate_size} has no Hadamard rotation {hint}; "
            "set `rotate: {down_hadamard: false}` in the recipe"
        )


@torch.no_grad()
def rotate_model(adapter: ModelAdapter, params: RotateParams, notes: list[str]) -> None:
    check_sizes(adapter, params)
    if adapter.untie_embeddings():
        notes.append("rotate: untied the input embeddings from lm_head (they now differ)")
    fold_all_norms(adapter)
    version = params.hadamard
    q = random_hadamard(adapter.hidden_size, params.seed, version=version)
    emb = adapter.embed_tokens
    emb.weight.data = (emb.weight.data.double() @ q).to(emb.weight.dtype)
    for i in range(adapter.num_layers):
        p = adapter.parts(i)
        for linear in (p.q_proj, p.k_proj, p.v_proj, p.gate_proj, p.up_proj):
            _rotate_input(linear, q)
        for linear in (p.o_proj, p.down_proj):
            _rotate_output(linear, q)
    _rotate_input(adapter.lm_head, q)
    if params.value_hadamard:
        rotate_values(adapter, params.seed, version)
    if params.key_hadamard:
        enable_key_rotation(adapter.model, adapter.head_dim, key_rotation_seed(params.seed), version)
        notes.append(f"rotate: post-RoPE queries and keys rotated online by a Hadamard of order {adapter.head_dim}")
    if params.down_hadamard:
        seed = down_rotation_seed(params.seed)
        r = random_hadamard(adapter.intermediate_size, seed, version=version)
        for i in range(adapter.num_layers):
            _rotate_input(adapter.parts(i).down_proj, r)
        enable_down_rotation(adapter.model, adapter.intermediate_size, seed, version)
        notes.append(f"rotate: down_proj inputs rotated online by a Hadamard of order {adapter.intermediate_size}")
    notes.append(f"rotate: residual stream rotated by a random Hadamard of order {adapter.hidden_size} (seed {params.seed})")


def _run(adapter, params, notes):
    rotate_model(adapter, params, notes)


register_step("rotate", "model", RotateParams, _run, check_sizes)
