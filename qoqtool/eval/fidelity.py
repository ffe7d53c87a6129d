"""Data-free fidelity: how closely a quantized model follows its original.

On held-out text the *original* model samples (a seed apart from calibration's), we compare
the two models' next-token distributions token by token, as llama.cpp's perplexity tool
does with --kl-divergence:

    kl          mean KL(P_original || P_quantized) in nats
    top1        fraction of positions where both models' most likely token agree
    ppl_original / ppl_quantized   perplexity of each model on that text

This judges quantization where no evaluation data set can be downloaded.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from qoqtool.data.calibration import sample_synthetic

HELD_OUT_SEED_OFFSET = 1_000_003  # keeps fidelity text apart from any calibration seed


def held_out_text(original, samples: int, seqlen: int, seed: int, tokens: int | None = None) -> torch.Tensor:
    """`tokens`: the tokenizer's size (sample_synthetic)."""
    return sample_synthetic(original, samples, seqlen, seed + HELD_OUT_SEED_OFFSET, tokens)


@torch.no_grad()
def fidelity(
    original,
    quantized,
    tokens: torch.Tensor,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict:
    kl_sum, agree, count = 0.0, 0, 0
    nll_o, nll_q = 0.0, 0.0
    dev_o = next(original.parameters()).device
    dev_q = next(quantized.parameters()).device
    for i in range(tokens.shape[0]):
        x = tokens[i : i + 1]
        lo = original(x.to(dev_o), use_cache=False).logits[0, :-1].float().cpu()
        lq = quantized(x.to(dev_q), use_cache=False).logits[0, :-1].float().cpu()
        logp_o = torch.log_softmax(lo, -1)
        logp_q = torch.log_softmax(lq, -1)
        kl_sum += float((logp_o.exp() * (logp_o - logp_q)).sum())
        agree += int((lo.argmax(-1) == lq.argmax(-1)).sum())
        target = x[0, 1:]
        nll_o -= float(logp_o.gather(-1, target[:, None]).sum())
        nll_q -= float(logp_q.gather(-1, target[:, None]).sum())
        count += target.numel()
        if progress:
            progress("samples", i + 1, tokens.shape[0])
    return {
        "kl": kl_sum / count,
        "top1": agree / count,
        "ppl_original": math.exp(nll_o / count),
        "ppl_quantized": math.exp(nll_q / count),
        "tokens": count,
        "samples": tokens.shape[0],
    }
