"""WikiText-2 perplexity by the GPTQ/AWQ/QoQ protocol.

The test split's Hugging Face rows joined with "\\n\\n", tokenized once (no special tokens
added), cut into non-overlapping `seqlen`-token windows with the remainder dropped; each
window is scored on its own (the first token of a window is context only). The result is
exp(mean negative log-likelihood) over all scored tokens. Every window scores seqlen - 1
tokens, so this equals GPTQ's exp(mean of per-window losses).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from qoqtool.data import sources
from qoqtool.errors import UserError


def wikitext2_test_ids(tokenizer, data_dir: str | None) -> torch.Tensor:
    text = sources.wikitext2_text("test", sources.data_dir(data_dir))
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]


@torch.no_grad()
def perplexity(
    model,
    ids: torch.Tensor,
    seqlen: int = 2048,
    max_windows: int | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    decode_batch: int | None = None,
) -> dict:
    """decode_batch: score the windows that many at a time by teacher-forced decoding through
    the paged KV cache (qoqtool.runtime.generate.score_paged) instead of one forward pass per
    window: the same windows and score, computed the way a server runs the model (every linear
    sees decode_batch tokens), and seqlen times as many steps."""
    if seqlen < 2:
        raise UserError(f"--seqlen must be at least 2 (got {seqlen})")
    windows = ids.numel() // seqlen
    if windows == 0:
        raise UserError(f"the evaluation text has {ids.numel()} tokens, fewer than one --seqlen {seqlen} window")
    if max_windows is not None:
        if max_windows < 1:
            raise UserError(f"--max-windows must be at least 1 (got {max_windows})")
        windows = min(windows, max_windows)
    if decode_batch is not None:
        if decode_batch < 1:
            raise UserError(f"--decode-batch must be at least 1 (got {decode_batch})")
        from qoqtool.runtime.generate import score_paged

        window_nll: list[float] = []
        starts = range(0, windows, decode_batch)
        for i, first in enumerate(starts):
            batch = torch.stack([ids[w * seqlen : (w + 1) * seqlen] for w in range(first, min(windows, first + decode_batch))])

            def steps_done(done: int, steps: int, before: int = i * (seqlen - 1)) -> None:
                if progress:
                    progress("decode steps", before + done, len(starts) * steps)

            try:
                window_nll += score_paged(model, batch, progress=steps_done).tolist()
            except ValueError as err:  # a model the paged cache cannot hold (head_dim, KV bits)
                raise UserError(f"{err}: evaluate this model without --decode-batch") from err
        return _result(window_nll, seqlen) | {"decode_batch": decode_batch}
    device = next(model.parameters()).device
    window_nll = []
    for w in range(windows):
        x = ids[w * seqlen : (w + 1) * seqlen].unsqueeze(0).to(device)
        logits = model(x, use_cache=False).logits[0, :-1].float()
        window_nll.append(float(torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum")))
        if progress:
            progress("windows", w + 1, windows)
    return _result(window_nll, seqlen)


def _result(window_nll: list[float], seqlen: int) -> dict:
    """window_nll: each window's summed NLL (seqlen - 1 scored tokens each), kept in the result so
    that two evaluations of the same windows can be compared window by window (paired_ratio)."""
    scored = len(window_nll) * (seqlen - 1)
    nll = math.fsum(window_nll) / scored
    return {
        "ppl": math.exp(nll),
        "nll": nll,
        "tokens": len(window_nll) * seqlen,
        "windows": len(window_nll),
        "seqlen": seqlen,
        "window_nll": window_nll,
    }


def paired_ratio(a: dict, b: dict) -> tuple[float, float | None]:
    """B's perplexity over A's, and its standard error over the windows, for two wikitext2
    results (perplexity()'s) of the same windows. Paired: the error is that of the mean
    per-window difference of the two models' NLL, which is what separates two close models (or
    two paths through one model) on a sample of windows - far smaller than either perplexity's
    own sampling error, which is mostly how hard the windows' text is. None with one window."""
    if a.get("seqlen") != b.get("seqlen") or len(a.get("window_nll", ())) != len(b.get("window_nll", ())) or not a.get("window_nll"):
        raise ValueError("paired_ratio compares two wikitext2 results of the same windows (seqlen and count)")
    scored = a["seqlen"] - 1
    diffs = [(nb - na) / scored for na, nb in zip(a["window_nll"], b["window_nll"])]
    mean = math.fsum(diffs) / len(diffs)
    ratio = math.exp(mean)
    if len(diffs) < 2:
        return ratio, None
    var = math.fsum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return ratio, ratio * math.sqrt(var / len(diffs))  # (delta method: d exp(x) = exp(x) dx)
