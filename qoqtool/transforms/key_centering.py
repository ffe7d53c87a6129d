"""Key centering: subtract a fixed per-channel vector from every cached key.

Softmax does not change when the same constant is added to all scores of a query, and a
fixed key shift c does exactly that: q.(k - c) = q.k - q.c, where q.c is one number per
query. So the cache may store k - c instead of k, for any c, with no correction anywhere:
attention over the shifted keys is attention over the keys. (The shift is applied after
RoPE and after the optional key rotation, in the space the cache stores, where it is a
constant; before RoPE it would turn into a position-dependent term.)

What it buys: per-token asymmetric 4-bit quantization fits one offset per token, not per
channel. Keys share a large common component (the low-frequency RoPE channels hardly
rotate over a context), which then takes up most of every token's range and leaves few
levels for what tells tokens apart. Centering removes it first. On smollm2-135m's float
model with a KV4 cache (6 WikiText-2 windows; benchmarks/kv_diagnosis.py) it lowers the
perplexity from 23.36 to 22.66 with the key rotation (KV16: 22.06) and from 24.21 to 23.79
with SmoothAttention (benchmarks/RESULTS.md, "QoQ"; the midrange (max + min) / 2 instead of
the mean did worse with the key rotation).

c is measured per layer, KV head and channel on the calibration data, on the keys the
layer computes after every earlier step of the recipe; it is stored with the model as the
attention module's `qoq_key_shift` buffer ([kv_heads, head_dim]).
"""

from __future__ import annotations

from dataclasses import dataclass

from qoqtool.calibration.steps import register_step


@dataclass
class KeyCenteringParams:
    pass  # c is the mean cached key: nothing to choose


def run(ctx, params: KeyCenteringParams) -> None:
    from qoqtool.calibration.capture import capture_layer
    from qoqtool.runtime.attention import KEY_SHIFT, set_key_shift

    # A fresh pass: the steps before this one (SmoothAttention) may have changed the keys.
    cap = capture_layer(ctx, (), max_tokens=0, keys=True, key_sums=True)
    shift = (cap.key_sum / cap.key_count).float().to(ctx.parts.k_proj.weight.device)
    earlier = getattr(ctx.parts.attn, KEY_SHIFT, None)  # the capture saw keys minus it
    set_key_shift(ctx.parts.attn, shift if earlier is None else earlier + shift)
    ctx.log.append(f"layer {ctx.index}: center_keys |c| = {shift.norm(dim=1).max():.3g} (largest over KV heads)")


register_step("center_keys", "layer", KeyCenteringParams, run)
