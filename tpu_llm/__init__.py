"""tpu-llm: train GPT-style language models with TensorFlow on Cloud TPU, GPUs and CPUs.

From Python: `tpu_llm.train(config, **overrides)` and `tpu_llm.load(run_dir)` (tpu_llm/api.py,
docs/python-api.md). They load TensorFlow when first used, so `import tpu_llm` stays cheap.
"""

__version__ = "0.1.0"
__all__ = ["__version__", "load", "train"]


def __getattr__(name: str):
    if name in ("load", "train", "LoadedRun"):  # PEP 562: TensorFlow loads on first use, not on import
        import importlib

        from tpu_llm.platform import native_log

        native_log.quiet_library()  # as quiet as the command line: TensorFlow's C++ log lines kept off stderr
        return getattr(importlib.import_module("tpu_llm.api"), name)
    raise AttributeError(f"module 'tpu_llm' has no attribute {name!r}")
