"""Calibration batches: N token windows of length L from a named source.

    wikitext2   WikiText-2 validation split (never the test split used for evaluation)
    pile        Pile validation (mit-han-lab/pile-val-backup), the QoQ/AWQ default
    synthetic   data-free: text the model itself samples, deterministic for a seed
    PATH        a local .txt or .jsonl file

Windows are cut at seeded random offsets from the concatenated text, GPTQ-style.
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass
from pathlib import Path

import torch

from qoqtool.data import sources
from qoqtool.errors import UserError

NAMED_SOURCES = ("wikitext2", "pile", "synthetic")


@dataclass
class CalibrationSet:
    tokens: torch.Tensor  # [N, L] int64
    source: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.tokens.to(torch.int32).numpy().tobytes()).hexdigest()

    def describe(self) -> dict:
        n, length = self.tokens.shape
        return {"source": self.source, "samples": n, "seqlen": length, "tokens_sha256": self.sha256}


def validate_args(source: str, samples: int, seqlen: int) -> None:
    if samples < 1:
        raise UserError(f"--calib-samples must be at least 1 (got {samples})")
    if seqlen < 8:
        raise UserError(f"--calib-seqlen must be at least 8 (got {seqlen})")
    if source not in NAMED_SOURCES:
        path = Path(source).expanduser()
        if not path.is_file():
            raise UserError(
                f"--calib {source} is neither a known source ({', '.join(NAMED_SOURCES)}) nor an existing file"
            )
        sources.check_local_suffix(path)


def build_calibration(
    source: str,
    tokenizer,
    samples: int,
    seqlen: int,
    seed: int = 0,
    data_dir: str | None = None,
    model=None,
) -> CalibrationSet:
    validate_args(source, samples, seqlen)
    if source == "synthetic":
        if model is None:
            raise ValueError("synthetic calibration needs the model")
        return CalibrationSet(sample_synthetic(model, samples, seqlen, seed, token_count(tokenizer)), "synthetic")
    root = sources.data_dir(data_dir)
    need_chars = samples * seqlen * 8  # generous: English averages ~4 characters a token
    if source == "wikitext2":
        text = sources.wikitext2_text("validation", root)
    elif source == "pile":
        text = "\n\n".join(sources.pile_documents(root, need_chars * 4))
    else:
        text = "\n\n".join(sources.local_texts(Path(source).expanduser(), need_chars * 4))
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    return CalibrationSet(random_windows(ids, samples, seqlen, seed, source), source)


def random_windows(ids: torch.Tensor, samples: int, seqlen: int, seed: int, source: str) -> torch.Tensor:
    if ids.numel() <= seqlen:
        raise UserError(
            f"calibration source {source} has only {ids.numel()} tokens; need more than --calib-seqlen {seqlen}"
        )
    gen = torch.Generator().manual_seed(seed)
    # Starts in [0, n - seqlen), as GPTQ's reference sampler draws them (the last possible start
    # is never drawn): kept so, since every recorded result was calibrated on these windows.
    starts = torch.randint(0, ids.numel() - seqlen, (samples,), generator=gen)
    return torch.stack([ids[s : s + seqlen] for s in starts.tolist()])


def token_count(tokenizer) -> int | None:
    """How many token ids the tokenizer can produce (None if it cannot say)."""
    try:
        return len(tokenizer)
    except TypeError:
        return None


@torch.no_grad()
def sample_synthetic(
    model, samples: int, seqlen: int, seed: int, tokens: int | None = None, batch_size: int = 32
) -> torch.Tensor:
    """Data-free calibration text: sequences the model samples itself (LLM-QAT style).

    Each sequence starts from a token drawn uniformly from the vocabulary, then samples
    with temperature 1 and nucleus 0.95. Deterministic for a seed on a given device.
    `tokens`: the tokenizer's size. Models whose embedding is padded past it (Qwen2: 151936
    rows for 151665 tokens) have rows no text ever reaches; draws and samples stay below it.
    """
    device = next(model.parameters()).device
    vocab = model.config.vocab_size if tokens is None else min(tokens, model.config.vocab_size)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for start in range(0, samples, batch_size):
        n = min(batch_size, samples - start)
        first = torch.randint(0, vocab, (n, 1), generator=gen)
        out.append(_sample(model, first.to(device), seqlen, gen, vocab).cpu())
    return torch.cat(out)


def _sample(model, prefix: torch.Tensor, seqlen: int, gen: torch.Generator, vocab: int, top_p: float = 0.95) -> torch.Tensor:
    from transformers import DynamicCache

    tokens = prefix
    cache = DynamicCache()
    # newer transformers name the cache argument `cache` (and warn about the old name)
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    step_input = prefix
    while tokens.shape[1] < seqlen:
        logits = model(step_input, use_cache=True, **{cache_arg: cache}).logits[:, -1, :vocab].float()
        probs = torch.softmax(logits, dim=-1)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p  # smallest prefix reaching top_p
        sorted_p = sorted_p * keep
        choice = torch.multinomial(sorted_p.cpu(), 1, generator=gen).to(order.device)
        step_input = order.gather(-1, choice)
        tokens = torch.cat([tokens, step_input], dim=1)
    return tokens
