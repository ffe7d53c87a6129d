"""qoqtool: offline W4A8KV4 quantization (QoQ) of Llama-family causal LMs.

The pieces, by folder:
  models/       resolve a model argument and name the pieces of a Llama-family model
  data/         calibration and evaluation text (WikiText-2, Pile, local files, synthetic)
  calibration/  the layer-by-layer runner and activation statistics
  transforms/   exact, full-precision rewrites (rotation, smoothing, reordering)
  quantizers/   the math: RTN, progressive, GPTQ, clipping, activation and KV quantizers
  runtime/      the modules that run a quantized model (exact CPU reference, CUDA kernels)
  packing/      the kernel-ordered checkpoint format
  eval/         perplexity, fidelity and zero-shot evaluation
"""

__version__ = "0.1.0"


def load(spec: str, device: str = "cpu", dtype: str = "float32"):
    """Open what qoqtool can run: a packed or quantized folder, or an original model (hub id,
    local folder, .gguf file, smollm2-135m). Returns a LoadedModel whose `.model` is a
    transformers causal LM (`.generate()` works; its linears and attention compute the
    quantized model: on CUDA a packed folder's linears run the W4A8 kernels, on the CPU the
    exact reference path) and whose `.tokenizer` is the folder's tokenizer. dtype: the float
    parts' ("float16" on a GPU runs as a server would; a quantized folder stays float32)."""
    from qoqtool.runtime.loading import load_any

    return load_any(spec, device=device, dtype=dtype)

