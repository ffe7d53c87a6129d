"""Greedy generation through the paged KV cache, and the reference it must agree with.

`generate_paged` runs a transformers Llama-family model layer by layer itself, so that every
attention layer writes and reads the paged cache (qoqtool.runtime.kv_cache): prefill of each
prompt writes its keys (after RoPE) and values through the append kernel, then attends with
fp16/fp32 SDPA over what the cache now holds (the same quantized K/V the reference sees);
each decode step appends one token per sequence and runs the decode attention kernel over
sequences of different lengths in one batch. The linears are whatever modules the model has
(nn.Linear, QuantLinear, PackedLinear): on a GPU a packed model runs the W4A8 GEMM kernels.
On the CPU the same loop runs the cache's torch reference.

`generate_reference` is greedy decoding through the model's own forward, whose attention
function (qoqtool.runtime.attention) fake-quantizes K and V per token: since quantization is
per token, recomputing the whole sequence each step sees exactly what a KV4 cache returns.

    python -m qoqtool.runtime.generate MODEL_OR_FOLDER [--steps 32] [--prompt TEXT ...]

compares the two (reference on the CPU, paged cache on CUDA when there is one) and explains
each divergence: it is rounding when, at the step where the tokens part, the reference's
top-two logits are closer than the largest logit difference the two paths showed up to there.
With int8 activations (W4A8) both paths are discontinuous: a last-bit difference (summation
order, fp16 on the GPU) can flip one activation code and move the logits by a visible step;
on smollm2 W4A8 even two fp32 CPU paths differed by 2.6 logits on one prompt (tokens equal).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from qoqtool.models.adapter import ModelAdapter
from qoqtool.runtime import packed_linear
from qoqtool.runtime.attention import attention_modules
from qoqtool.runtime.fusion import add_normed_linears, mlp_output, rotary_queries_and_keys
from qoqtool.runtime.kv_cache import KVCacheLayout, PagedKVCache, StepPlan, pages_needed

DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
)


@dataclass
class Generation:
    tokens: list[list[int]]  # the new tokens of each prompt
    logits: list[torch.Tensor] = field(default_factory=list)  # per prompt [steps, vocab] float32, CPU


def model_kv_bits(model) -> int:
    """The KV-cache bits the model's attention layers use (qoq_kv_bits; 16 when unset)."""
    bits = {getattr(m, "qoq_kv_bits", 16) for m in attention_modules(model)}
    if len(bits) != 1:
        raise ValueError(f"attention layers disagree on their KV-cache bits: {sorted(bits)}")
    return bits.pop()


def _forward(adapter: ModelAdapter, ids: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
    """The decoder on ids [B, T] at positions [B, T], attention(layer, module, q, k, v) -> o,
    all [B, heads, T, head_dim] with q and k after RoPE. Returns the final hidden states.
    (Each layer as transformers' Llama layer computes it, with the residual adds, the norms and
    the MLP's product fused into the packed linears' input quantization where the kernels allow,
    and queries and keys taken through their norms, RoPE, rotation and shift by one kernel:
    runtime.fusion.)"""
    h = adapter.embed_tokens(ids)
    cos, sin = adapter.decoder.rotary_emb(h, positions)
    batch, steps = ids.shape
    delta = None  # the last sublayer's output: the next norm's kernel adds it to the residual stream h
    for i in range(adapter.num_layers):
        parts = adapter.parts(i)
        h, qkv = add_normed_linears(parts.input_norm, h, delta, (parts.q_proj, parts.k_proj, parts.v_proj))
        q, k, v = (y.view(batch, steps, -1, adapter.head_dim) for y in qkv)
        # As qoq_attention: (Qwen3: each head normalized,) RoPE, rotated, keys shifted.
        q, k = rotary_queries_and_keys(parts, q, k, cos, sin)
        o = attention(i, parts.attn, q, k, v.transpose(1, 2))
        delta = parts.o_proj(o.transpose(1, 2).reshape(batch, steps, -1))
        h, (gate, up) = add_normed_linears(parts.post_norm, h, delta, (parts.gate_proj, parts.up_proj))
        delta = mlp_output(parts.mlp, gate, up)
    return adapter.final_norm(h + delta)


def _prefill(adapter: ModelAdapter, cache: PagedKVCache, seq: int, ids: list[int]) -> torch.Tensor:
    """Run one prompt, filling its cache; returns the last position's logits [1, vocab]."""
    device = cache.device
    plan = cache.plan([seq], [len(ids)])

    def attention(layer, module, q, k, v):
        cache.append(layer, k[0].transpose(0, 1), v[0].transpose(0, 1), plan)
        keys, values = cache.keys_values(layer, seq)  # the cached (quantized) K, V, as decode will read them
        return F.scaled_dot_product_attention(q, keys[None].to(q.dtype), values[None].to(q.dtype), is_causal=True,
                                              scale=module.scaling, enable_gqa=True)

    positions = torch.arange(len(ids), device=device)[None]
    h = _forward(adapter, torch.tensor([ids], device=device), positions, attention)
    return adapter.lm_head(h[:, -1]).float()


def _decode(adapter: ModelAdapter, cache: PagedKVCache, plan: StepPlan, tokens: torch.Tensor) -> torch.Tensor:
    """One token for each planned sequence (tokens [B]); returns logits [B, vocab]."""

    def attention(layer, module, q, k, v):
        cache.append(layer, k[:, :, 0], v[:, :, 0], plan)
        return cache.attend(layer, q[:, :, 0], plan, module.scaling)[:, :, None]

    positions = (plan.context_lens.long() - 1)[:, None]
    h = _forward(adapter, tokens[:, None], positions, attention)
    return adapter.lm_head(h[:, -1]).float()


class DecodeSteps:
    """The decode steps of one batch of sequences, up to `capacity` tokens each: every call
    plans one new token per sequence on the host (cache pages, slots), then runs the model on
    it - eagerly, or, with cuda_graph, by replaying a CUDA graph of the whole step.

    A graph fixes every launch, so the step's inputs live in static buffers that each call
    overwrites: the new tokens, their cache slots, the context lengths, and the page table
    padded to the pages of `capacity` tokens. Decode attention is planned for `capacity`
    tokens (its splits past a sequence's end exit at once, kernels/kv_attention.cu). The first
    call runs eagerly on those buffers - it loads the kernels and allocates their workspaces -
    and the graph is captured after it. Why: a decode step is hundreds of small launches (the
    demo model: 30 layers of ~15), which Python issues far slower than the GPU runs them."""

    def __init__(self, adapter: ModelAdapter, cache: PagedKVCache, seqs: list[int], capacity: int,
                 cuda_graph: bool | None = None):
        self.adapter, self.cache, self.seqs = adapter, cache, list(seqs)
        self.cuda_graph = graphs_by_default(cache) if cuda_graph is None else cuda_graph
        if self.cuda_graph and not cache.use_kernels:
            raise ValueError("CUDA graphs need the KV cache's kernels (a cache on a GPU with use_kernels)")
        self.graph = None
        if self.cuda_graph:
            self.tokens = torch.zeros(len(self.seqs), dtype=torch.long, device=cache.device)
            self.plan = static_plan(cache, self.seqs, capacity)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [B, vocab] after tokens [B], one per sequence. Replayed from a graph, they
        are the graph's output buffer, which the next call overwrites: clone them to keep them."""
        if not self.cuda_graph:
            return _decode(self.adapter, self.cache, self.cache.plan(self.seqs, [1] * len(self.seqs)), tokens)
        step = self.cache.plan(self.seqs, [1] * len(self.seqs), table=self.graph is None)  # (then only new pages)
        self.tokens.copy_(tokens)
        load_step(self.plan, step)
        if self.graph is None:
            logits = _decode(self.adapter, self.cache, self.plan, self.tokens)
            try:
                self._capture()
            except RuntimeError as err:  # (a model whose modules sync with the host, say)
                warnings.warn(f"decoding without a CUDA graph: capturing the decode step failed ({err})")
                self.cuda_graph = False
            return logits
        self.graph.replay()
        packed_linear.path_calls.update(self.graph_paths)
        return self.logits

    def _capture(self) -> None:
        # Capturing runs the Python but no kernel: the linears' calls it counts are the graph's,
        # taken back here (also when the capture fails) and counted again at every replay.
        before = packed_linear.path_calls.copy()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.logits = _decode(self.adapter, self.cache, self.plan, self.tokens)
            self.graph_paths = packed_linear.path_calls - before
        finally:
            packed_linear.path_calls.clear()
            packed_linear.path_calls.update(before)
        self.graph = graph


def static_plan(cache: PagedKVCache, seqs: list[int], capacity: int) -> StepPlan:
    """A StepPlan of one new token per sequence whose tensors can serve every step up to
    `capacity` tokens a sequence (load_step fills them): the page table as wide as `capacity`
    needs, attention split for `capacity` tokens."""
    batch, device, size = len(seqs), cache.device, cache.layout.page_size
    width = cache.pages_for(capacity, size)
    plan = StepPlan(list(seqs), slots=torch.zeros(batch, dtype=torch.int32, device=device),
                    page_table=torch.zeros(batch, width, dtype=torch.int32, device=device),
                    context_lens=torch.ones(batch, dtype=torch.int32, device=device), max_len=width * size)
    if cache.use_kernels:
        from qoqtool.runtime.attention_ops import plan_splits

        plan.num_splits, plan.blocks_per_split = plan_splits(batch, cache.layout.num_kv_heads, plan.max_len, device)
    return plan


def load_step(static: StepPlan, step: StepPlan) -> None:
    """Copy one step's plan (PagedKVCache.plan) into static_plan's tensors; a step without a
    page table (plan(..., table=False): no page was taken) keeps the one loaded before."""
    if step.max_len > static.max_len or step.seqs != static.seqs:
        raise ValueError(f"this step does not fit its static plan (sequences {step.seqs} vs {static.seqs}, "
                         f"{step.max_len} tokens vs {static.max_len})")
    static.slots.copy_(step.slots)
    static.context_lens.copy_(step.context_lens)
    if step.page_table is not None:
        pages = step.page_table.shape[1]
        static.page_table[:, :pages].copy_(step.page_table)  # (the columns past it: no sequence reaches them)


def graphs_by_default(cache: PagedKVCache) -> bool:
    """CUDA graphs for decode steps where the cache runs its kernels (on a GPU), unless
    QOQTOOL_CUDA_GRAPHS=0. (The cache's torch reference reads lengths on the host.)"""
    return cache.use_kernels and os.environ.get("QOQTOOL_CUDA_GRAPHS", "1") != "0"


@torch.no_grad()
def generate_paged(model, prompts: list[list[int]], max_new_tokens: int, kv_bits: int | None = None,
                   page_size: int = 64, keep_logits: bool = False, use_kernels: bool | None = None,
                   stop_tokens: frozenset[int] = frozenset(), progress=None,
                   cuda_graph: bool | None = None) -> Generation:
    """Greedy decoding of all prompts in one batch through a paged KV cache of kv_bits
    (default: the model's own qoq_kv_bits) on the model's device. A sequence that emits one of
    `stop_tokens` ends there (that token is its last); decoding stops when all have ended.
    progress(done_steps, max_new_tokens) after each step. cuda_graph: decode steps replayed
    from a CUDA graph (DecodeSteps; default: on a GPU)."""
    adapter = ModelAdapter(model)
    adapter.check_context(max(len(p) for p in prompts) + max_new_tokens - 1)  # (the last new token is not fed back)
    device = adapter.embed_tokens.weight.device
    bits = model_kv_bits(model) if kv_bits is None else kv_bits
    layout = KVCacheLayout(bits, adapter.head_dim, adapter.num_kv_heads, page_size)
    pages = pages_needed([len(p) + max_new_tokens for p in prompts], page_size)
    cache = PagedKVCache(layout, adapter.num_layers, pages, device, use_kernels)
    seqs = [cache.add_sequence() for _ in prompts]
    decode = DecodeSteps(adapter, cache, seqs, max(len(p) for p in prompts) + max_new_tokens, cuda_graph)
    logits = torch.cat([_prefill(adapter, cache, seq, ids) for seq, ids in zip(seqs, prompts)])
    result = Generation([[] for _ in prompts], [[] for _ in prompts] if keep_logits else [])
    running = [True] * len(prompts)  # (an ended sequence still decodes with the batch; its tokens are dropped)
    for step in range(max_new_tokens):
        tokens = logits.argmax(dim=-1)
        for i, token in enumerate(tokens.tolist()):
            if running[i]:
                result.tokens[i].append(token)
                running[i] = token not in stop_tokens
                if keep_logits:
                    result.logits[i].append(logits[i].cpu())
        if progress:
            progress(step + 1, max_new_tokens)
        if step + 1 < max_new_tokens and any(running):
            logits = decode(tokens)
        else:
            break
    if keep_logits:
        result.logits = [torch.stack(rows) for rows in result.logits]
    return result


@torch.no_grad()
def score_paged(model, windows: torch.Tensor, page_size: int = 64, use_kernels: bool | None = None,
                progress=None, cuda_graph: bool | None = None) -> torch.Tensor:
    """The summed negative log-likelihood of each of windows [B, T] (token t + 1 given tokens
    0..t, the first token context only; float64 [B] on the CPU), scored by teacher-forced
    decoding: all B windows advance one token per step through a paged KV cache of the model's
    own KV bits, so every linear sees B tokens and attention runs the decode path - the serving
    regime, where a packed model on a GPU runs the small-M stream and fused sparse-dense GEMM
    kernels and the KV decode kernel.
    Per-token KV quantization makes this the same model as the full-window forward pass; the
    two differ by rounding only. progress(done_steps, steps) after each step; cuda_graph as in
    generate_paged."""
    adapter = ModelAdapter(model)
    device = adapter.embed_tokens.weight.device
    batch, steps = windows.shape
    adapter.check_context(steps - 1)  # (the last token is only predicted)
    layout = KVCacheLayout(model_kv_bits(model), adapter.head_dim, adapter.num_kv_heads, page_size)
    cache = PagedKVCache(layout, adapter.num_layers, pages_needed([steps] * batch, page_size), device, use_kernels)
    seqs = [cache.add_sequence() for _ in range(batch)]
    decode = DecodeSteps(adapter, cache, seqs, steps, cuda_graph)
    windows = windows.to(device)
    total = torch.zeros(batch, dtype=torch.float64, device=device)
    for t in range(steps - 1):
        logits = decode(windows[:, t])
        total += F.cross_entropy(logits.float(), windows[:, t + 1], reduction="none").double()
        if progress:
            progress(t + 1, steps - 1)
    return total.cpu()


@torch.no_grad()
def generate_reference(model, prompts: list[list[int]], max_new_tokens: int, keep_logits: bool = False) -> Generation:
    """Greedy decoding through model(...) on the whole sequence at every step, one prompt at a time."""
    device = next(model.parameters()).device
    result = Generation([], [])
    for ids in prompts:
        seq, rows = list(ids), []
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([seq], device=device)).logits[0, -1].float()
            seq.append(int(logits.argmax()))
            rows.append(logits.cpu())
        result.tokens.append(seq[len(ids):])
        if keep_logits:
            result.logits.append(torch.stack(rows))
    return result


def explain(reference: Generation, candidate: Generation) -> list[dict]:
    """Per prompt: where the greedy tokens first part (None: never), the reference's top-two
    logit gap there, the largest logit difference of the two paths up to there, and whether
    the divergence is rounding (gap < that difference). Both need keep_logits=True."""
    rows = []
    for ref_tokens, cand_tokens, ref_logits, cand_logits in zip(reference.tokens, candidate.tokens,
                                                                reference.logits, candidate.logits):
        step = next((i for i, (a, b) in enumerate(zip(ref_tokens, cand_tokens)) if a != b), None)
        upto = len(ref_tokens) if step is None else step + 1  # inputs are identical through `step`
        noise = float((ref_logits[:upto] - cand_logits[:upto]).abs().max())
        row = {"diverges_at": step, "max_logit_diff": noise, "steps": len(ref_tokens)}
        if step is not None:
            top2 = ref_logits[step].topk(2).values
            row["reference_gap"] = float(top2[0] - top2[1])
            row["rounding"] = row["reference_gap"] < noise
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Compare greedy generation through the paged KV cache "
                                                 "with the CPU reference path.")
    parser.add_argument("model", help="a packed or quantized folder, or an original model")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable); default: 5 built-in prompts")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--page-size", type=int, default=64)
    args = parser.parse_args(argv)

    from qoqtool.runtime.loading import load_any

    reference_model = load_any(args.model, device="cpu")
    tokenizer = reference_model.tokenizer
    prompts = [tokenizer(text)["input_ids"] for text in (args.prompt or DEFAULT_PROMPTS)]
    reference = generate_reference(reference_model.model, prompts, args.steps, keep_logits=True)
    bits = model_kv_bits(reference_model.model)
    del reference_model
    model = load_any(args.model, device=args.device).model
    paged = generate_paged(model, prompts, args.steps, kv_bits=bits, page_size=args.page_size, keep_logits=True)
    unexplained = 0
    print(f"KV{bits} paged cache on {args.device} vs the CPU reference, {args.steps} greedy steps")
    for text, row, ref_tokens, tokens in zip(args.prompt or DEFAULT_PROMPTS, explain(reference, paged),
                                             reference.tokens, paged.tokens):
        if row["diverges_at"] is None:
            verdict = "identical"
        else:
            verdict = (f"diverges at step {row['diverges_at']}: reference top-2 gap {row['reference_gap']:.4f}, "
                       f"{'rounding' if row['rounding'] else 'NOT explained by rounding'}")
            unexplained += not row["rounding"]
        print(f"- {text!r}: {verdict} (max logit difference {row['max_logit_diff']:.4f})")
        print(f"    reference: {tokenizer.decode(ref_tokens)!r}")
        print(f"    paged:     {tokenizer.decode(tokens)!r}")
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
