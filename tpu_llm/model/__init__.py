"""The model: the decoder in Keras 3 layers (transformer.py over the shared layers of layers.py and
attention.py), one module per family (families/), what a model holds and costs from its config alone
(spec.py), adapters (adapters.py), the loss (dense and chunked) and sampling with a KV cache. No device
logic and no file I/O: where a layer runs is the parallel package's business, reading and writing runs
the training package's.

The layers load TensorFlow; `families` and `spec` do not, and importing this package does not either:
the names below are imported on first use (PEP 562), so the CLI and config/ read the spec and the
families before TensorFlow starts.
"""

import importlib

_LAZY = {"GPT": "transformer", "MLP": "transformer", "Block": "transformer", "CausalSelfAttention": "transformer",
         "decay_mask": "transformer", "loss_fn": "transformer", "RMSNorm": "layers", "heads": "layers",
         "norm": "layers", "rope": "layers", "attend": "attention"}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"tpu_llm.model.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'tpu_llm.model' has no attribute {name!r}")
