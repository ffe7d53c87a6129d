"""Decode steps end to end (one GPU): a W4A8KV4-packed model through qoqtool's kernels against
the same model in fp16, both through the same serving loop (qoqtool.runtime.generate's paged
KV cache and DecodeSteps), both replayed from CUDA graphs. The fp16 model's norms (with the
residual add before them) and its queries' and keys' RoPE run in qoqtool's fused kernels too
(rmsnorm / add_rmsnorm, qk_norm_rope), as a serving stack fuses them: only the linears differ.

    python benchmarks/decode.py [--shapes smollm2-135m,llama2-7b,llama3-8b] [--batches 1,16,64]
                                [--recipe R] [--context 1024] [--steps 64] [--eager] [--fused-pdl]
                                [--baseline-library PATH.so] [--profile] [--json PATH]

The models are the named architectures' shapes with random weights (no hub here; the speed of
a step does not depend on the values): transformers builds the fp16 model on the GPU, which is
the baseline - cuBLAS fp16 GEMMs, an fp16 paged KV cache, qoqtool's decode-attention kernel at
16 bits. Then every decoder linear is replaced by a packed W4A8 linear (QoQ progressive g128:
the codes of one quantized layer, copied into every layer's own buffers so that each layer
streams its own weights), and the recipe's run-time parts are switched on (for the default,
qoq-w4a8kv4-g128: the KV4 cache, the online key rotation and down_proj rotation; --recipe
chooses another); embeddings, norms and lm_head stay fp16, as in a packed folder.

Each (shape, batch): `batch` sequences of `context` tokens already in the cache (their pages
planned, their K/V left at zero: the work does not depend on the values), then `steps` decode
steps timed as `qoqtool generate` runs them - plan the step on the host, replay the graph,
argmax, read the tokens back - and the same number of bare graph replays (GPU time of a step,
timed by CUDA events). The packed model is also timed with the online down_proj rotation in its
own kernels instead of inside the SiLU-product quantization ("rotation apart"; where the recipe
rotates and the fused kernel takes the rotation's form), with q/k/v and gate/up as separate GEMMs
("not merged"), with the queries' and keys' norms (Qwen3), RoPE, rotation and shift as torch
ops instead of the qk_norm_rope kernel ("qk apart"), with the residual adds as their own kernels
("add apart"), then without any of the fused kernels ("unfused"; qoqtool.runtime.fusion); the
fp16 model with its norms and RoPE as torch ops ("fp16 torch ops": the baseline of the runs
before 2026-12-07), where the recipe rotates down_proj's input and the two versions of
the Hadamard constructions differ for the shape (Llama-2's 11008: 2 x 5504 by FFT in version
1, 32 x 344 in version 2, the default) with version 1's rotation ("hadamard 1"), and with
--eager without a graph (the launch overhead the graph removes), with --fused-pdl with the small
fused kernels as programmatic dependent launches ("fused PDL"), with --baseline-library PATH (once
or more) with the GEMMs and fused ops of another build of the kernel library (cuda_ops.use_library:
an A/B of a kernel change in one process; the column is named after the file, "library NAME");
those columns give the replay
time and its ratio to the default's (fp16 torch ops: to the fp16 model's). --profile lists the
kernels of one replayed step at the first batch size (torch.profiler): fp16, packed, packed
with qk apart.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import time

import torch

from qoqtool.runtime import cuda_ops, fusion
from qoqtool.runtime.mlp import configure_mlp
from qoqtool.runtime.generate import model_kv_bits

SHAPES = {  # transformers LlamaConfig fields (or another model_type's)
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True),
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, head_dim=128, vocab_size=32000),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=128256),
    # Qwen2.5-7B's sizes as a Llama model (Qwen2's q/k/v biases left out: the speed of a step
    # hardly depends on them); its MLP's 18944 = 128 x 148 rotation takes the tensor-core kernel
    "qwen2.5-7b-shape": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                             num_key_value_heads=4, head_dim=128, vocab_size=152064),
    # Qwen3-8B: a Qwen3 model, so its per-head q/k norms run too (in torch, between the merged
    # q/k/v GEMM and RoPE); 12288 = 1024 x 12 on the CUDA-core rotation kernel
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936),
}
RECIPE = "qoq-w4a8kv4-g128"
PAGE_SIZE = 64


def fp16_model(shape: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(SHAPES[shape])
    config = AutoConfig.for_model(fields.pop("model_type", "llama"), **fields, max_position_embeddings=16384,
                                  rms_norm_eps=1e-5)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    return model.eval()


def pack_in_place(model, recipe_name: str = RECIPE) -> dict:
    """Every decoder linear -> a packed W4A8 linear of the recipe's weights (one layer's codes,
    each layer its own copy), and the recipe's run-time configuration; returns the recipe as a
    manifest saves it."""
    from qoqtool.models.adapter import LINEAR_NAMES, ModelAdapter
    from qoqtool.quantizers.schemes import WeightScheme
    from qoqtool.recipe import load_recipe
    from qoqtool.runtime.attention import configure_attention
    from qoqtool.runtime.packed_linear import PackedLinear

    recipe = load_recipe(recipe_name)
    scheme = WeightScheme(recipe.weights)
    adapter = ModelAdapter(model)
    packed = {}
    for i in range(adapter.num_layers):
        layer = adapter.decoder.layers[i]
        for parent in (layer.self_attn, layer.mlp):
            for name in LINEAR_NAMES:
                linear = getattr(parent, name, None)
                if linear is None:
                    continue
                if name not in packed:
                    weight = scheme.quantize(linear.weight.detach().float().cpu())
                    packed[name] = PackedLinear.pack(weight, None, recipe.act_bits).cuda()
                setattr(parent, name, copy.deepcopy(packed[name]))
    torch.cuda.empty_cache()
    saved = recipe.to_dict()
    configure_attention(model, saved)
    configure_mlp(model, saved)
    return saved


def legacy_rotation(saved: dict, intermediate_size: int) -> dict | None:
    """The saved recipe with version 1 of the Hadamard constructions, where the recipe rotates
    down_proj's input and version 1 builds this size otherwise; else None."""
    from qoqtool.recipe import saved_step
    from qoqtool.transforms.hadamard import decompose

    rotate = saved_step(saved, "rotate")
    if not rotate or not rotate.get("down_hadamard") or decompose(intermediate_size, 1) == decompose(intermediate_size, 2):
        return None
    legacy = copy.deepcopy(saved)
    saved_step(legacy, "rotate")["hadamard"] = 1
    return legacy


@contextlib.contextmanager
def fusion_switches(**switches):
    """runtime.fusion's module switches (ENABLED, MERGE, ROTATE, ROPE, ADD, FP16_NORMS) set for a block."""
    saved = {name: getattr(fusion, name) for name in switches}
    try:
        for name, value in switches.items():
            setattr(fusion, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(fusion, name, value)


def decode_steps(model, batch: int, context: int, steps: int, cuda_graph: bool):
    """(DecodeSteps, the last tokens) for `batch` sequences of `context` tokens with room for
    2 * steps more, after its first calls (eager, capture; one replay)."""
    from qoqtool.models.adapter import ModelAdapter
    from qoqtool.runtime.generate import DecodeSteps
    from qoqtool.runtime.kv_cache import KVCacheLayout, PagedKVCache, pages_needed

    adapter = ModelAdapter(model)
    capacity = context + 2 * steps + 4
    layout = KVCacheLayout(model_kv_bits(model), adapter.head_dim, adapter.num_kv_heads, PAGE_SIZE)
    cache = PagedKVCache(layout, adapter.num_layers, pages_needed([capacity] * batch, PAGE_SIZE), "cuda")
    seqs = [cache.add_sequence() for _ in range(batch)]
    cache.plan(seqs, [context - 1] * batch)  # the context's pages (K/V zeros: the work is the same)
    decode = DecodeSteps(adapter, cache, seqs, capacity, cuda_graph)
    tokens = torch.randint(0, model.config.vocab_size, (batch,), device="cuda")
    tokens = decode(decode(tokens).argmax(dim=-1)).argmax(dim=-1)
    torch.cuda.synchronize()
    return decode, tokens


def profile_step(model, batch: int, context: int, replays: int = 8, top: int = 12) -> dict:
    """The kernels of one graph-replayed decode step (torch.profiler over `replays` replays):
    launches and GPU microseconds per step in all, and the `top` kernels by GPU time."""
    from torch.profiler import ProfilerActivity, profile

    decode, _ = decode_steps(model, batch, context, replays, True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            decode.graph.replay()
        torch.cuda.synchronize()
    kernels = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            count, us = kernels.get(event.name, (0, 0.0))
            kernels[event.name] = (count + 1, us + event.time_range.elapsed_us())
    rows = sorted(((name, n / replays, us / replays) for name, (n, us) in kernels.items()), key=lambda r: -r[2])
    del decode
    torch.cuda.empty_cache()
    return {"batch": batch, "launches": sum(r[1] for r in rows), "gpu_us": sum(r[2] for r in rows),
            "top": [{"kernel": name[:90], "launches": n, "us": us} for name, n, us in rows[:top]]}


def time_batches(model, batches: list[int], context: int, steps: int, **switches) -> dict:
    """{batch: time_steps(...)} with a CUDA graph, runtime.fusion's switches set as given."""
    with fusion_switches(**switches):
        return {b: time_steps(model, b, context, steps, True) for b in batches}


def time_steps(model, batch: int, context: int, steps: int, cuda_graph: bool) -> dict:
    """Milliseconds per decode step: the serving loop's, and (with a graph) the bare replay's."""
    decode, tokens = decode_steps(model, batch, context, steps, cuda_graph)
    t0 = time.perf_counter()
    for _ in range(steps):  # as generate_paged: plan, replay, argmax, tokens to the host
        tokens = decode(tokens).argmax(dim=-1)
        tokens.tolist()
    loop_ms = (time.perf_counter() - t0) / steps * 1e3
    row = {"batch": batch, "context": context, "kv_bits": model_kv_bits(model), "loop_ms": loop_ms,
           "tokens_per_s": batch / loop_ms * 1e3, "cuda_graph": decode.graph is not None}
    if decode.graph is not None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            decode.graph.replay()
        end.record()
        torch.cuda.synchronize()
        row["replay_ms"] = start.elapsed_time(end) / steps
    del decode
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="smollm2-135m,llama2-7b,llama3-8b")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--recipe", default=RECIPE, help="a W4A8 recipe (its weights format and run-time parts)")
    ap.add_argument("--eager", action="store_true", help="also the packed model's loop without a CUDA graph")
    ap.add_argument("--fused-pdl", action="store_true",
                    help="also the packed model with the fused kernels as dependent launches (cuda_ops.set_fused_dependent_launch)")
    ap.add_argument("--baseline-library", action="append", default=[], metavar="PATH.so",
                    help="also the packed model on another build of the kernel library (its GEMMs and fused ops); repeatable")
    ap.add_argument("--profile", action="store_true",
                    help="also the kernels of a replayed step of each model at the first batch size (torch.profiler)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.steps} steps after "
          f"{args.context} tokens of context; ms per step (loop: plan + replay + argmax + tokens to the host; "
          f"replay: the graph alone)")
    results = []
    for shape in args.shapes.split(","):
        model = fp16_model(shape)
        timed = functools.partial(time_batches, model, batches, args.context, args.steps)
        fp16 = timed()
        profiles = {"fp16": profile_step(model, batches[0], args.context)} if args.profile else {}
        fp16_torch = timed(ROPE=False, FP16_NORMS=False)  # the baseline until 2026-12-07: norms and RoPE as torch ops
        saved = pack_in_place(model, args.recipe)
        ours = timed()
        if args.profile:
            profiles["W4A8KV4"] = profile_step(model, batches[0], args.context)
            with fusion_switches(ROPE=False):
                profiles["W4A8KV4, qk apart"] = profile_step(model, batches[0], args.context)
        legacy, hadamard1 = legacy_rotation(saved, SHAPES[shape]["intermediate_size"]), {}
        if legacy:
            configure_mlp(model, legacy)
            hadamard1 = timed()
            configure_mlp(model, saved)
        apart = {  # column -> the packed model's times with one fusion switched off
            "rotation apart": timed(ROTATE=False),  # the down_proj rotation as its own kernels (where the recipe has one)
            "qk apart": timed(ROPE=False),  # the queries' and keys' norms, RoPE, rotation and shift as torch ops
            "add apart": timed(ADD=False),  # the residual adds as their own kernels
            "not merged": timed(MERGE=False),  # q/k/v and gate/up as separate GEMMs
            "unfused": timed(MERGE=False, ENABLED=False),  # nor any fused kernel
        }
        if args.fused_pdl:
            cuda_ops.set_fused_dependent_launch(True)
            apart["fused PDL"] = timed()
            cuda_ops.set_fused_dependent_launch(False)
        for path in args.baseline_library:
            cuda_ops.use_library(path)
            apart["library " + path.rsplit("/", 1)[-1].removesuffix(".so")] = timed()
            cuda_ops.use_library(None)
        eager = {b: time_steps(model, b, args.context, max(4, args.steps // 8), False) for b in batches} if args.eager else {}
        print(f"\n{shape}: fp16 (cuBLAS, KV16) vs packed {args.recipe} (qoqtool kernels, KV{model_kv_bits(model)})")
        print(f"{'batch':>5} | {'fp16 loop':>9} | {'W4A8KV4 loop':>12} | {'speedup':>7} | {'fp16 replay':>11} | "
              f"{'W4A8KV4 replay':>14} | {'speedup':>7} | {'tokens/s':>9} | "
              + "".join(f"{name:>15} | " for name in apart) + f"{'fp16 torch ops':>15}"
              + (f" | {'hadamard 1':>15}" if hadamard1 else "") + (" | eager loop" if eager else ""))
        for b in batches:
            f, o = fp16[b], ours[b]
            line = (f"{b:>5} | {f['loop_ms']:>9.3f} | {o['loop_ms']:>12.3f} | {f['loop_ms'] / o['loop_ms']:>6.2f}x | "
                    f"{f['replay_ms']:>11.3f} | {o['replay_ms']:>14.3f} | {f['replay_ms'] / o['replay_ms']:>6.2f}x | "
                    f"{o['tokens_per_s']:>9.0f} | " + " | ".join(
                        f"{v[b]['replay_ms']:>8.3f} ({v[b]['replay_ms'] / base[b]['replay_ms']:.2f}x)"
                        for v, base in [*((v, ours) for v in apart.values()), (fp16_torch, fp16)]
                        + ([(hadamard1, ours)] if hadamard1 else [])))
            if eager:
                line += f" | {eager[b]['loop_ms']:.3f} ({eager[b]['loop_ms'] / o['loop_ms']:.1f}x the graph's)"
            print(line)
            results.append({"shape": shape, "batch": b, "fp16": f, "w4a8kv4": o, "fp16_torch_ops": fp16_torch[b],
                            **{"w4a8kv4_" + name.replace(" ", "_"): v[b] for name, v in apart.items()},
                            **({"w4a8kv4_hadamard1": hadamard1[b]} if hadamard1 else {}),
                            **({"eager": eager[b]} if eager else {})})
        for name, prof in profiles.items():
            print(f"\n{shape}, {name}, batch {prof['batch']}: {prof['launches']:.0f} kernels and {prof['gpu_us']:.0f} us "
                  f"of kernel time per replayed step; the {len(prof['top'])} longest:")
            for r in prof["top"]:
                print(f"  {r['us']:9.1f} us {r['launches']:6.1f} x  {r['kernel']}")
        if profiles:
            results.append({"shape": shape, "profiles": profiles})
        del model, timed
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "steps": args.steps,
                       "recipe": args.recipe,
                       "context": args.context, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
