"""The model: GPT-2 and Llama blocks in Keras 3 layers (transformer.py), attention (dense and blockwise),
the loss (dense and chunked) and sampling with a KV cache. No device logic and no file I/O: where a
layer runs is the parallel package's business, reading and writing runs the training package's."""

from tpu_llm.model.attention import attend
from tpu_llm.model.transformer import (GPT, MLP, Block, CausalSelfAttention, RMSNorm, decay_mask, heads, loss_fn, norm,
                                       rope)

__all__ = ["GPT", "MLP", "Block", "CausalSelfAttention", "RMSNorm", "attend", "decay_mask", "heads", "loss_fn",
           "norm", "rope"]
