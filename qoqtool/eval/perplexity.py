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
) -> dict:
    if seqlen < 2:
        raise UserError(f"--seqlen must be at least 2 (got {seqlen})")
    windows = ids.numel() // seqlen
    if windows == 0:
        raise UserError(f"the evaluation text has {ids.numel()} tokens, fewer than one --seqlen {seqlen} window")
    if max_windows is not None:
        if max_windows < 1:
            raise UserError(f"--max-windows must be at least 1 (got {max_windows})")
        windows = min(windows, max_windows)
    device = next(model.parameters()).device
    total_nll = 0.0
    scored = 0
    for w in range(windows):
        x = ids[w * seqlen : (w + 1) * seqlen].unsqueeze(0).to(device)
        logits = model(x, use_cache=False).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum")
        total_nll += float(nll)
        scored += seqlen - 1
        if progress:
            progress("windows", w + 1, windows)
    return {
        "ppl": math.exp(total_nll / scored),
        "nll": total_nll / scored,
        "tokens": windows * seqlen,
        "windows": windows,
        "seqlen": seqlen,
    }
