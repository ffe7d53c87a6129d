"""Open any model qoqtool can evaluate: an original model, a quantized or a packed folder.

Quantized folders are rebuilt as transformers models whose linears are `QuantLinear`
(exact reference path) and whose attention quantizes the KV cache as the recipe says.
Packed folders are handled by `qoqtool.packing.packed` (reference path on CPU, kernels on
CUDA) through the same entry point.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from qoqtool.errors import UserError
from qoqtool.packing import folder as fs


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    kind: str  # "original" | "quantized" | "packed"
    spec: str
    manifest: dict = field(default_factory=dict)

    @property
    def source_model(self) -> str:
        """The original model a quantized folder came from (itself for originals)."""
        return self.manifest.get("source_model", self.spec)


def build_empty_model(config, dtype=torch.float32):
    """A transformers model from `config` without initialising weights (they are loaded next)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model


def finish_loading(model, tensors: dict[str, torch.Tensor], device: str, recipe: dict):
    """Load the float tensors into a meta-built model, rebuild the rotary tables, and set up
    what the saved recipe runs at inference time (KV-cache bits, online rotations)."""
    from qoqtool.runtime.attention import configure_attention
    from qoqtool.runtime.mlp import configure_mlp

    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
        missing = [m for m in missing if m != "lm_head.weight"]
    if unexpected:
        raise UserError(f"the folder holds tensors the model does not know: {unexpected[0]} ...; re-create it")
    if missing:
        raise UserError(f"the folder is missing tensor {missing[0]} (and {len(missing) - 1} more); re-create it")
    # Rotary inverse frequencies are computed, not stored: rebuild them off the meta device.
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=model.config)
    model.eval().to(device)
    configure_attention(model, recipe)
    configure_mlp(model, recipe)
    return model


def load_quantized_folder(path: Path, manifest: dict, device: str = "cpu") -> torch.nn.Module:
    from qoqtool.models.loading import ModelSource, load_config
    from qoqtool.packing import quantized
    from qoqtool.packing.packed import fp16_rounded
    from qoqtool.runtime.attention import prepare_attention
    from qoqtool.runtime.reference import QuantLinear

    quantized.check_manifest(manifest, str(path))
    config = load_config(ModelSource.local(path))
    weights, tensors = quantized.load_weights(path, manifest)
    outliers = quantized.load_outliers(path, manifest)
    # Deployed float tensors (embeddings, norms, biases) are fp16 (docs/format.md): evaluate
    # them as deployed, so that the packed folder scores exactly what this folder scores.
    tensors = {name: fp16_rounded(t) for name, t in tensors.items()}
    model = build_empty_model(config)
    prepare_attention(model, manifest["recipe"])
    for name, qweight in weights.items():
        parent_name, attr = name.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        bias = tensors.get(f"{name}.bias")  # stays in `tensors`: load_state_dict assigns it
        act_bits = manifest["linears"][name]["act_bits"]
        setattr(parent, attr, QuantLinear(qweight, bias, act_bits, outliers=outliers.get(name)))
    return finish_loading(model, tensors, device, manifest["recipe"])


def load_any(spec: str, device: str = "cpu", dtype: str = "float32") -> LoadedModel:
    """Open `spec`: a qoqtool folder (quantized or packed) or an original model, the float
    tensors of an original model or a packed folder in `dtype` (a quantized folder, run on
    the reference path, computes in float32)."""
    path = Path(spec).expanduser()
    manifest = fs.read_manifest(path) if path.is_dir() else None
    if manifest is None:
        from qoqtool.models.loading import load_model

        model, tokenizer, _ = load_model(spec, dtype=dtype, device=device)
        return LoadedModel(model, tokenizer, "original", spec)
    from qoqtool.models.loading import ModelSource, load_tokenizer

    fmt = manifest.get("format")
    if fmt == "qoqtool-quantized":
        model = load_quantized_folder(path, manifest, device)
        kind = "quantized"
    elif fmt == "qoqtool-packed":
        from qoqtool.models.loading import parse_dtype
        from qoqtool.packing.packed import load_packed_folder

        model = load_packed_folder(path, manifest, device, parse_dtype(dtype))
        kind = "packed"
    else:
        raise UserError(f"{spec} has a qoqtool.json of unknown format {fmt!r}; it was written by another tool")
    tokenizer = load_tokenizer(ModelSource.local(path))
    return LoadedModel(model, tokenizer, kind, spec, manifest)
