"""tpu-llm: train GPT-style language models with TensorFlow on Cloud TPU, GPUs and CPUs."""

__version__ = "0.1.0"
