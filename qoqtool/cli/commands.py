"""The commands. Each validates everything it can before loading a model."""

from __future__ import annotations

import resource
import time
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from qoqtool.cli import app
from qoqtool.cli import ui
from qoqtool.errors import UserError

DEVICE_HELP = "cpu, or cuda (a GPU: calibration runs there layer by layer)."
RUN_DEVICE_HELP = "cpu (the exact reference path), or cuda (a GPU: packed models run the kernels)."


def _check_device(device: str) -> str:
    import torch

    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise UserError(f"unknown device {device!r}; use cpu or cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but no CUDA GPU is visible; use --device cpu")
    return device


def _peak_memory_mib() -> float:
    # ru_maxrss is in KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _default_output(model: str, recipe: str) -> str:
    stem = Path(model.rstrip("/")).name.removesuffix(".gguf")
    return f"{stem}-{Path(recipe).stem}"


OUTLIERS_HELP = (
    "Keep the most salient weights in fp16 beside the 4-bit codes: a share (1%, 0.5%), a count (5000) "
    "or a gain threshold (t=1e-6)."
)
BUDGET_HELP = "How --outliers is shared: layer (the same share in every linear, the default) or global (by saliency)."


def _outlier_budget(spec: str | None, scope: str | None):
    """The parsed --outliers / --outliers-budget (None without --outliers); bad input is one line."""
    if spec is None:
        if scope is not None:
            raise UserError("--outliers-budget needs --outliers (e.g. --outliers 1% --outliers-budget global)")
        return None
    from qoqtool.quantizers.outliers import parse_outliers

    return parse_outliers(spec, scope or "layer")


# ----------------------------------------------------------------------------------------
@app.command()
def quantize(
    model: str = typer.Argument(..., metavar="MODEL", help="Hub id, local HF folder, .gguf file, or smollm2-135m; a Llama, Mistral, Qwen2 or Qwen3 causal LM."),
    recipe: str = typer.Option("qoq-w4a8kv4-g128", "--recipe", "-r", help="Recipe name (see `qoqtool recipes`) or a YAML file."),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="Output folder [default: MODEL-RECIPE]."),
    calib: str = typer.Option("pile", "--calib", help="wikitext2, pile, synthetic (data-free), or a .txt/.jsonl file."),
    calib_samples: int = typer.Option(64, "--calib-samples", help="Number of calibration sequences."),
    calib_seqlen: int = typer.Option(512, "--calib-seqlen", help="Tokens per calibration sequence."),
    seed: int = typer.Option(0, "--seed", help="Seed for sampling calibration windows (and synthetic text)."),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", envvar="QOQTOOL_DATA_DIR", help="Local copies of the data sets (see README)."),
    device: str = typer.Option("cpu", "--device", help=DEVICE_HELP),
    batch_size: int = typer.Option(8, "--batch-size", help="Calibration sequences per forward pass."),
    outliers: Optional[str] = typer.Option(None, "--outliers", help=OUTLIERS_HELP),
    outliers_budget: Optional[str] = typer.Option(None, "--outliers-budget", help=BUDGET_HELP),
    keep_float_weights: bool = typer.Option(
        False, "--keep-float-weights",
        help="Also keep each linear's fp16 weight before rounding, so that `qoqtool pack --outliers` can choose outliers "
             "later for recipes with transforms (adds 2 bytes per weight to the folder).",
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output folder."),
    json_out: Optional[str] = typer.Option(None, "--json", help="Also write a JSON summary to this file ('-' for stdout)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars."),
):
    """Quantize MODEL with a recipe and write a folder of integer codes, scales and statistics.

    Calibration is layer by layer: one decoder layer on the device at a time, each layer
    calibrated on the outputs of the already-quantized layers before it. With --outliers
    the most salient weights are kept in fp16 beside the codes (chosen inside RTN, clipping
    or GPTQ; `qoqtool pack` stores them in Tile-COO, docs/tile-coo.md).

    Examples:

      qoqtool quantize smollm2-135m -r rtn-w4a8kv4-g128 --calib synthetic -o smol-rtn

      qoqtool quantize smollm2-135m -r qoq-w4a8kv4-g64 --calib wikitext2 --data-dir ../shared/data -o smol-qoq

      qoqtool quantize smollm2-135m -r rtn-w4a16-g128 --calib wikitext2 --data-dir ../shared/data --outliers 1% -o smol-rtn-1pct
    """
    ui.reserve_stdout(json_out)
    from qoqtool.data.calibration import build_calibration, validate_args
    from qoqtool.packing import folder as fs
    from qoqtool.recipe import load_recipe

    t0 = time.perf_counter()
    rec = load_recipe(recipe)
    budget = _outlier_budget(outliers, outliers_budget)
    validate_args(calib, calib_samples, calib_seqlen)
    if batch_size < 1:
        raise UserError(f"--batch-size must be at least 1 (got {batch_size})")
    device = _check_device(device)
    output = _default_output(model, recipe) if output is None else output  # ("": refused by check_output_dir)
    fs.check_output_dir(output, overwrite, inputs=(model, calib, data_dir or ""))  # (data_dir: --data-dir or its env var)
    _check_model_argument(model)
    if calib in ("wikitext2", "pile"):
        from qoqtool.data import sources

        root = sources.data_dir(data_dir)
        if root is None:
            sources.require_hub({"wikitext2": "wikitext", "pile": "mit-han-lab/pile-val-backup"}[calib])
        elif calib == "wikitext2":
            sources.require_file(root, sources.WIKITEXT_FILES["validation"], "the WikiText-2 raw validation split")
        else:
            sources.require_file(root, sources.PILE_FILE, 'Pile validation as JSON lines with a "text" field')

    from qoqtool.calibration.pipeline import check_recipe_fits, quantize_model
    from qoqtool.models.loading import load_model
    from qoqtool.packing import quantized

    ui.err.print(f"loading {escape(model)} ...")
    net, tokenizer, source = load_model(model, dtype="float32", device="cpu")
    check_recipe_fits(net, rec)
    limit = getattr(net.config, "max_position_embeddings", None)
    if limit and calib_seqlen > limit:
        raise UserError(f"--calib-seqlen {calib_seqlen} is past the model's {limit} positions (max_position_embeddings); "
                        "use a shorter one")
    ui.err.print(f"calibration: {escape(calib)}, {calib_samples} x {calib_seqlen} tokens, seed {seed}")
    if calib == "synthetic" and device != "cpu":
        net.to(device)
    calibration = build_calibration(calib, tokenizer, calib_samples, calib_seqlen, seed, data_dir, model=net)
    with ui.progress_bar(f"quantize {rec.name}", enabled=not quiet) as bar:
        result = quantize_model(net, rec, calibration.tokens, device=device, batch_size=batch_size, progress=bar,
                                outliers=budget, keep_float_weights=keep_float_weights)
    path = quantized.save(result, tokenizer, output, model, {**calibration.describe(), "seed": seed}, overwrite)

    errors = [r["output_rel_error"] for r in result.layer_report.values()]
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    summary = {
        "output": str(path),
        "recipe": rec.name,
        "scheme": rec.summary(),
        "calibration": calibration.describe(),
        "linears": len(errors),
        "mean_output_rel_error": sum(errors) / len(errors),
        "quantize_seconds": round(result.seconds, 1),
        "total_seconds": round(time.perf_counter() - t0, 1),
        "peak_memory_mib": round(_peak_memory_mib(), 1),
        "folder_mib": round(size / 2**20, 1),
        "outliers": result.outliers,
        "float_weights_kept": keep_float_weights,
        "notes": result.notes,
    }
    kept = []
    if result.outliers:
        kept = [["fp16 outliers kept", f"{result.outliers['count']:,} ({100 * result.outliers['share']:.3f}%, {budget.describe()})"]]
    ui.table(
        f"quantized {model}",
        ["", "value"],
        [
            ["output", summary["output"]],
            ["recipe", f"{rec.name} ({rec.summary()})"],
            ["calibration", f"{calib} {calib_samples}x{calib_seqlen} sha256 {calibration.sha256[:12]}"],
            ["linears quantized", summary["linears"]],
            ["mean output rel. error", summary["mean_output_rel_error"]],
            *kept,
            ["quantize time (s)", summary["quantize_seconds"]],
            ["peak memory (MiB)", summary["peak_memory_mib"]],
            ["folder size (MiB)", summary["folder_mib"]],
        ],
    )
    for note in result.notes:
        ui.err.print(f"note: {escape(note)}")
    ui.write_json(json_out, summary)


# ----------------------------------------------------------------------------------------
@app.command(name="eval")
def evaluate(
    models: list[str] = typer.Argument(..., metavar="MODEL", help="One model or folder; two to compare (B against A)."),
    tasks: str = typer.Option("wikitext2", "--tasks", "-t", help="Comma-separated tasks (see above)."),
    seqlen: int = typer.Option(2048, "--seqlen", help="Perplexity window length."),
    max_windows: Optional[int] = typer.Option(None, "--max-windows", help="Score only the first N windows."),
    decode_batch: Optional[int] = typer.Option(
        None, "--decode-batch",
        help="Perplexity by decoding: N windows at a time, token by token through the paged KV cache, so every "
             "linear sees N tokens (on a GPU: the small-M and fused sparse-dense GEMM kernels and KV decode "
             "attention). Same windows and score; seqlen times as many steps."),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", envvar="QOQTOOL_DATA_DIR", help="Local copies of the data sets."),
    device: str = typer.Option("cpu", "--device", help=RUN_DEVICE_HELP),
    dtype: str = typer.Option(
        "float32", "--dtype",
        help="float32, float16 or bfloat16: the float tensors (embeddings, norms, residual stream) of an original "
             "model or a packed folder; a quantized folder computes in float32. float16 on a GPU is how "
             "`qoqtool generate` serves a packed model, with the norms, SiLU product and rotations fused into the "
             "kernels' quantization (those kernels take fp16 only)."),
    fidelity_samples: int = typer.Option(8, "--fidelity-samples", help="Held-out sequences for the fidelity task."),
    fidelity_seqlen: int = typer.Option(512, "--fidelity-seqlen", help="Tokens per fidelity sequence."),
    seed: int = typer.Option(0, "--seed", help="Seed of the fidelity text."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Zero-shot: at most N items per task."),
    batch_size: int = typer.Option(16, "--batch-size", help="Zero-shot: requests per forward pass."),
    num_fewshot: int = typer.Option(0, "--num-fewshot", help="Zero-shot: in-context examples (0 = zero-shot)."),
    json_out: Optional[str] = typer.Option(None, "--json", help="Write results as JSON to this file ('-' for stdout)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars."),
):
    """Evaluate an original model, a quantized folder or a packed folder.

    Tasks: **wikitext2** (perplexity: HF rows joined with blank lines, tokenized once,
    non-overlapping windows), **fidelity** (KL divergence and top-1 agreement against the
    original model on text it generates itself: needs no data), and the lm-eval zero-shot
    tasks **piqa**, **arc_easy**, **arc_challenge** (**arc** = both).

    For a packed folder, a line under the results counts its linears' calls by path (kernel,
    fused sparse-dense kernel, kernel + separate sparse product, reference path): on a GPU it
    shows which kernels ran.

    Examples:

      qoqtool eval smollm2-135m --tasks wikitext2 --data-dir ../shared/data

      qoqtool eval smol-qoq --tasks wikitext2,fidelity --max-windows 20 --json results.json

      qoqtool eval smollm2-135m smol-qoq --tasks wikitext2 --data-dir ../shared/data --max-windows 20

      qoqtool eval smol-qoq-packed --device cuda --decode-batch 16 --max-windows 32

      qoqtool eval smol-qoq-packed --device cuda --dtype float16 --decode-batch 16   # as served
    """
    ui.reserve_stdout(json_out)
    from qoqtool.eval.runner import run_eval
    from qoqtool.eval.tasks import EvalSettings, check_task_data, parse_tasks
    from qoqtool.models.loading import parse_dtype

    task_list = parse_tasks(tasks)
    if len(models) > 2:
        raise UserError(f"eval takes one model, or two to compare; got {len(models)}")
    settings = EvalSettings(
        seqlen=seqlen,
        max_windows=max_windows,
        data_dir=data_dir,
        fidelity_samples=fidelity_samples,
        fidelity_seqlen=fidelity_seqlen,
        seed=seed,
        limit=limit,
        batch_size=batch_size,
        num_fewshot=num_fewshot,
        decode_batch=decode_batch,
        dtype=dtype,
    )
    if max_windows is not None and max_windows < 1:
        raise UserError(f"--max-windows must be at least 1 (got {max_windows})")
    if decode_batch is not None and decode_batch < 1:
        raise UserError(f"--decode-batch must be at least 1 (got {decode_batch})")
    if fidelity_samples < 1 or fidelity_seqlen < 8:
        raise UserError("--fidelity-samples must be >= 1 and --fidelity-seqlen >= 8")
    check_task_data(task_list, settings)
    device = _check_device(device)
    parse_dtype(dtype)  # (an unknown name: its one-line error)
    if dtype != "float32" and not device.startswith("cuda"):
        raise UserError(f"--dtype {dtype} needs --device cuda (the CPU reference path computes in float32)")
    for m in models:
        _check_model_argument(m)

    payload = run_eval(models, task_list, settings, device, show_progress=not quiet)
    ui.write_json(json_out, payload)


@app.command()
def generate(
    model: str = typer.Argument(..., metavar="MODEL", help="A packed or quantized folder, or an original model (hub id, folder, .gguf, smollm2-135m)."),
    prompts: Optional[list[str]] = typer.Option(None, "--prompt", "-p", help="A prompt (repeatable; all run as one batch)."),
    max_new_tokens: int = typer.Option(48, "--max-new-tokens", "-n", help="At most this many new tokens per prompt."),
    chat: bool = typer.Option(False, "--chat", help="Wrap each prompt in the tokenizer's chat template (instruct models)."),
    device: str = typer.Option("cpu", "--device", help=RUN_DEVICE_HELP),
    page_size: int = typer.Option(64, "--page-size", help="Tokens per page of the paged KV cache."),
    cuda_graph: bool = typer.Option(True, "--cuda-graph/--no-cuda-graph",
                                    help="On a GPU, replay each decode step from a CUDA graph (the first step is captured)."),
    json_out: Optional[str] = typer.Option(None, "--json", help="Also write prompts, completions and timing as JSON."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
):
    """Complete prompts greedily, decoding through the paged KV cache as a server would.

    All prompts go in one batch: each is prefilled, then every step decodes one token for
    each prompt still running (a prompt ends at the tokenizer's end-of-sequence token or after
    --max-new-tokens). The KV cache holds the model's own KV bits (4 for the W4A8KV4
    recipes). On a GPU a packed model runs the W4A8 GEMM kernels and the KV4 decode-attention
    kernel, the float parts in fp16 and each decode step replayed from a CUDA graph; on the CPU
    the same loop runs the exact reference path. Greedy only: the output is what the model
    ranks first, so two runs (and the two devices, up to rounding) agree.

    Examples:

      qoqtool generate smol-qoq-packed -p "The capital of France is" -p "def fibonacci(n):"

      qoqtool generate smol-qoq-packed --chat -p "Name three primary colors." --device cuda -n 64
    """
    ui.reserve_stdout(json_out)
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1 (got {max_new_tokens})")
    if page_size < 16 or page_size > 1024 or page_size & (page_size - 1):
        raise UserError(f"--page-size must be a power of two from 16 to 1024 (got {page_size})")
    prompts = prompts or ["The capital of France is"]
    if any(not text.strip() for text in prompts):
        raise UserError("--prompt must not be empty")
    device = _check_device(device)
    _check_model_argument(model)


    from qoqtool.eval.runner import counting_linear_paths, print_paths
    from qoqtool.models.adapter import ModelAdapter
    from qoqtool.runtime.generate import generate_paged, model_kv_bits
    from qoqtool.runtime.kv_cache import SUPPORTED_HEAD_DIMS
    from qoqtool.runtime.loading import load_any

    with ui.err.status(f"loading {model} ..."):  # (transient: a refusal below stays one line)
        loaded = load_any(model, device=device, dtype="float16" if device == "cuda" else "float32")
    tokenizer = loaded.tokenizer
    adapter = ModelAdapter(loaded.model)
    head_dim = adapter.head_dim
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise UserError(f"{model} has head_dim {head_dim}; the paged KV cache holds head_dim "
                        f"{' and '.join(map(str, SUPPORTED_HEAD_DIMS))} only (use qoqtool.load(...).model.generate in Python)")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"{model}'s tokenizer has no chat template; drop --chat")
        ids = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
               for text in prompts]
        ids = [list(x["input_ids"]) if hasattr(x, "keys") else list(x) for x in ids]
    else:
        ids = [tokenizer(text)["input_ids"] for text in prompts]
    if any(len(x) == 0 for x in ids):
        raise UserError("a --prompt gave no tokens; give it some text")
    longest = max(len(x) for x in ids) + max_new_tokens - 1
    try:
        adapter.check_context(longest)
    except ValueError as err:
        raise UserError(f"{err}; use a smaller --max-new-tokens or a shorter prompt") from err
    limit = getattr(loaded.model.config, "max_position_embeddings", None)
    if limit and longest > limit:
        raise UserError(f"prompt plus new tokens reach {longest} positions, past the model's {limit} "
                        "(max_position_embeddings); use a smaller --max-new-tokens or a shorter prompt")
    stop = frozenset() if tokenizer.eos_token_id is None else frozenset({tokenizer.eos_token_id})
    t0 = time.perf_counter()
    with ui.progress_bar("generate", enabled=not quiet) as bar:
        result, paths = counting_linear_paths(lambda: generate_paged(
            loaded.model, ids, max_new_tokens, page_size=page_size, stop_tokens=stop,
            cuda_graph=None if cuda_graph else False, progress=lambda done, total: bar("tokens per prompt", done, total)))
    seconds = time.perf_counter() - t0  # (each step's argmax().tolist() has waited for the GPU)
    new_tokens = sum(len(t) for t in result.tokens)
    completions = [tokenizer.decode(t, skip_special_tokens=True) for t in result.tokens]
    kv_bits = model_kv_bits(loaded.model)
    ui.out.print(f"[bold]{escape(model)}[/] ({loaded.kind}), greedy, KV{kv_bits} paged cache on {device}")
    for text, completion in zip(prompts, completions):
        ui.out.print(f"\n[bold]{escape(text)}[/]" + ("\n" if chat else "") + escape(completion))  # (chat: an answer, not a continuation)
    ui.out.print()
    ui.out.print(f"{new_tokens} new tokens for {len(prompts)} prompt(s) in {seconds:.1f} s, prefill included "
                 f"({new_tokens / seconds:.1f} tokens/s)")
    print_paths(model, paths)
    ui.write_json(json_out, {
        "model": model, "kind": loaded.kind, "device": device, "kv_bits": kv_bits, "chat": chat,
        "results": [{"prompt": text, "completion": completion, "tokens": tokens}
                    for text, completion, tokens in zip(prompts, completions, result.tokens)],
        "new_tokens": new_tokens, "seconds": round(seconds, 3), "linear_paths": paths,
    })


def _check_model_argument(spec: str) -> None:
    """Resolve a model argument without loading it (fails fast on bad paths)."""
    from qoqtool.packing import folder as fs

    path = Path(spec).expanduser()
    if path.is_dir() and fs.read_manifest(path) is not None:
        return
    from qoqtool.models.loading import validate_model

    validate_model(spec)


# ----------------------------------------------------------------------------------------
@app.command()
def pack(
    quantized_dir: str = typer.Argument(..., metavar="QUANTIZED_DIR", help="A folder written by `qoqtool quantize`."),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="Output folder [default: QUANTIZED_DIR-packed]."),
    outliers: Optional[str] = typer.Option(
        None, "--outliers",
        help="Choose fp16 outliers now, for a folder quantized without them: " + OUTLIERS_HELP.removeprefix("Keep "),
    ),
    outliers_budget: Optional[str] = typer.Option(None, "--outliers-budget", help=BUDGET_HELP),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output folder."),
    json_out: Optional[str] = typer.Option(None, "--json", help="Also write the size report as JSON."),
):
    """Pack a quantized folder into the kernels' byte layout (see docs/format.md).

    Every linear is checked to unpack bit for bit to the quantized folder's codes, scales
    and zeros before anything is written. Embeddings and norms are stored in fp16. fp16
    outliers (from `quantize --outliers`, or chosen here with --outliers) are stored in
    Tile-COO (docs/tile-coo.md), each section checked to decode to what was encoded.

    --outliers on a folder quantized without them uses its calibration statistics. RTN
    folders are re-fitted without the outliers (what `quantize --outliers` writes); GPTQ or
    clipped folders keep their codes and gain the weights with the largest error. The float
    weights come from the folder (`quantize --keep-float-weights`), or, for recipes without
    transforms, from the original model named in its manifest.

    Examples:

      qoqtool pack smol-qoq -o smol-qoq-packed

      qoqtool pack smol-rtn-w4a16 -o smol-rtn-w4a16-1pct --outliers 1%
    """
    ui.reserve_stdout(json_out)
    from qoqtool.cli.info import print_size_report
    from qoqtool.packing.packed import pack_folder

    budget = _outlier_budget(outliers, outliers_budget)
    report = pack_folder(quantized_dir, f"{quantized_dir.rstrip('/')}-packed" if output is None else output, budget, overwrite)
    print_size_report(report)
    ui.err.print(f"packed in {report['seconds']['total']:.1f} s")
    ui.write_json(json_out, report)


# ----------------------------------------------------------------------------------------
@app.command()
def info(
    path: str = typer.Argument(..., metavar="FOLDER", help="A quantized or packed folder."),
    json_out: Optional[str] = typer.Option(None, "--json", help="Also write the report as JSON."),
    verify: bool = typer.Option(False, "--verify", help="Also read every tensor file and check it against the "
                                "manifest's sha256 checksums (the loaders do this for the files they read)."),
):
    """Show what a qoqtool folder holds: recipe, calibration, formats, bits and sizes.

    Examples:

      qoqtool info smol-qoq

      qoqtool info smol-qoq-packed --verify   # also check every file's checksums
    """
    ui.reserve_stdout(json_out)
    from qoqtool.cli.info import folder_report, print_size_report, verify_files

    report = folder_report(path)
    if verify:
        report["verified"] = verify_files(path)
    print_size_report(report)
    ui.write_json(json_out, report)


@app.command()
def recipes():
    """List the bundled recipes (pass a name to --recipe, or a path to your own YAML)."""
    from qoqtool.recipe import known_recipes, load_recipe

    rows = []
    for name in known_recipes():
        r = load_recipe(name)
        rows.append([name, r.summary(), ", ".join(s.name for s in r.steps) or "round to nearest"])
    ui.table("recipes", ["name", "quantization", "steps"], rows)
