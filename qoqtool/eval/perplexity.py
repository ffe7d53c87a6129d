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

        total_nll = 0.0
        starts = range(0, windows, decode_batch)
        for i, first in enumerate(starts):
            batch = torch.stack([ids[w * seqlen : (w + 1) * seqlen] for w in range(first, min(windows, first + decode_batch))])

            def steps_done(done: int, steps: int, before: int = i * (seqlen - 1)) -> None:
                if progress:
                    progress("decode steps", before + done, len(starts) * steps)

            try:
                total_nll += score_paged(model, batch, progress=steps_done)
            except ValueError as err:  # a model the paged cache cannot hold (head_dim, KV bits)
                raise UserError(f"{err}: evaluate this model without --decode-batch") from err
        return _result(total_nll, windows, seqlen) | {"decode_batch": decode_batch}
    device = next(model.parameters()).device
    total_nll = 0.0
    for w in range(windows):
        x = ids[w * seqlen : (w + 1) * seqlen].unsqueeze(0).to(device)
        logits = model(x, use_cache=False).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum")
        total_nll += float(nll)
        if progress:
            progress("windows", w + 1, windows)
    return _result(total_nll, windows, seqlen)


def _result(total_nll: float, windows: int, seqlen: int) -> dict:
    scored = windows * (seqlen - 1)
    return {
        "ppl": math.exp(total_nll / scored),
        "nll": total_nll / scored,
        "tokens": windows * seqlen,
        "windows": windows,
        "seqlen": seqlen,
    }
