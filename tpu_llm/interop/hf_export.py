"""`tpu-llm export --format hf`: a run's newest checkpoint in the Hugging Face layout.

Export reads the run's newest checkpoint (as `generate` does) and writes config.json (the family's
translation, interop/hf_config.py), model.safetensors (the family's tensor names, interop/hf.py's
`weights`), generation_config.json and the tokenizer files, in the dtype the run was imported from (or
--dtype). A run with adapters writes its merged weights (interop/export.py's load_float32). Import then
export gives back the same tensors bit for bit.
"""

from __future__ import annotations

import json
import os

import numpy as np
import tensorflow as tf

from tpu_llm.errors import UserError
from tpu_llm.interop import safetensors_io
from tpu_llm.interop.export import EXPORT_FIX, META_FILE, export_target, load_float32, staged_directory
from tpu_llm.interop.hf import weights
from tpu_llm.interop.hf_config import MAX_CONFIG_JSON, hf_config, shown
from tpu_llm.model import families
from tpu_llm.platform import files
from tpu_llm.platform.run_layout import HF_EXPORT_DIR, IMPORT_FILE, checkpoint_step
from tpu_llm.tokenizers.hf import write_hf_tokenizer

EXPORT_DTYPES = ("auto", "float32", "bfloat16", "float16")
NP_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": safetensors_io.DTYPES["BF16"], "float16": np.dtype(np.float16)}


def export(run_dir: str, output: str = "", overwrite: bool = False, dtype: str = "auto") -> dict:
    """Write `run_dir`'s newest checkpoint in the Hugging Face layout to `output` (default <run_dir>/hf)."""
    if dtype not in EXPORT_DTYPES:
        raise UserError(f"--dtype={dtype!r}; valid choices: {', '.join(EXPORT_DTYPES)}")
    run_dir, output = export_target(run_dir, output, HF_EXPORT_DIR, overwrite)
    model, tokenizer, cfg, checkpoint, notes = load_float32(run_dir)
    if dtype == "auto":  # an imported run goes back in the dtype it came in
        dtype = imported_dtype(run_dir)
    m = cfg.model
    step = checkpoint_step(checkpoint)
    variables = model.by_path()
    np_dtype = NP_DTYPES[dtype]

    def produce(name):
        path, transposed = table[name]
        if path not in variables:  # gpt2 without biases (model.bias=false): zeros are the same function
            return np.zeros(shapes[name], np_dtype)
        value = variables[path].numpy()
        return value.T if transposed else value  # float32: safetensors_io.write converts it to np_dtype

    table = {name: (path, transposed) for name, path, transposed in weights(m)}
    shapes = {}
    for name, (path, transposed) in table.items():
        if path in variables:
            shape = tuple(variables[path].shape)
            shapes[name] = shape[::-1] if transposed else shape
        else:  # a bias or LayerNorm beta of a bias-free gpt2: the size of its layer's output
            kernel = path.rsplit("/", 1)[0] + ("/kernel" if path.endswith("bias") else "/gamma")
            shapes[name] = (variables[kernel].shape[-1],)
    eos = tokenizer.eos_id
    bos = eos if getattr(tokenizer, "bos_id", None) is None else tokenizer.bos_id
    with staged_directory(output, f"the export to {output!r}", EXPORT_FIX) as tmp:
        tf.io.gfile.makedirs(tmp)
        safetensors_io.write(os.path.join(tmp, safetensors_io.SINGLE_FILE),
                             [(n, shapes[n], np_dtype) for n in table], produce)
        write_json(os.path.join(tmp, "config.json"), hf_config(m, bos, eos, dtype))
        write_json(os.path.join(tmp, "generation_config.json"),
                    {"bos_token_id": bos, "eos_token_id": eos, "max_length": m.max_len})
        written = _write_tokenizer(tokenizer, tmp, m.max_len)
        meta = {"run_dir": run_dir, "checkpoint": checkpoint, "step": step, "format": "hf", "dtype": dtype,
                "family": families.of(m).name, "vocab_size": m.vocab_size, "eos_id": eos, "tokenizer_files": written}
        write_json(os.path.join(tmp, META_FILE), meta)
    return {**meta, "output": output, "notes": notes}


def imported_dtype(run_dir: str) -> str:
    """The dtype an imported run came in (its hf_import.json), float32 for a run trained here. The file is
    the run directory's own, read as one from elsewhere: a regular file, not a link, of a bounded size,
    a JSON object naming a dtype export can write; else one UserError."""
    path = os.path.join(run_dir, IMPORT_FILE)
    fix = "restore it from a copy of the run directory, or pass --dtype float32, bfloat16 or float16"
    try:
        raw = files.read_regular(path, MAX_CONFIG_JSON, "the run's import record", fix)
    except (FileNotFoundError, tf.errors.NotFoundError):
        return "float32"
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError):
        raise UserError(f"{path} is not valid JSON; {fix}") from None
    dtype = meta.get("dtype", "float32") if isinstance(meta, dict) else None
    if not isinstance(dtype, str) or dtype not in NP_DTYPES:
        raise UserError(f"{path}: dtype {shown(dtype)} is none export writes ({', '.join(NP_DTYPES)}); {fix}")
    return dtype


def write_json(path: str, data: dict) -> None:
    with tf.io.gfile.GFile(path, "w") as f:
        f.write(json.dumps(data, indent=2) + "\n")


def _write_tokenizer(tokenizer, output: str, max_len: int) -> list[str]:
    """Hugging Face tokenizer files for `tokenizer` in `output` (an hf tokenizer only); the names written."""
    if getattr(tokenizer, "kind", "") != "hf":
        return []  # byte, char, sentencepiece: transformers has no files for them

    return write_hf_tokenizer(tokenizer, output, model_max_length=max_len)
