"""Hugging Face checkpoints in: `tpu-llm import --from DIR`, and the tensor names both ways.

A Hugging Face model directory holds config.json, the weights (model.safetensors, or shards named by
model.safetensors.index.json; float32, bfloat16 or float16) and the tokenizer files. The architectures
read and written are the families' (tpu_llm/model/families/: GPT2LMHeadModel, LlamaForCausalLM with
Llama 3.1's `rope_type: llama3`, Qwen2ForCausalLM, MistralForCausalLM); Gemma's are refused in one line
naming what they would need (interop/hf_config.py).

Import makes a new run directory, as `tpu-llm train` would: the marker, config.yaml (the mapped model
section, fine-tuning defaults for the rest), the tokenizer, and a checkpoint at step 0 holding the
model only (the first `train` in it starts a fresh optimizer). Every tensor is read on its own and
assigned to its variable (safetensors_io), so the host holds the model plus one tensor. Everything is
written into a temporary directory beside the target, renamed into place once complete.

The model directory comes from outside (a download), so it is checked before anything is built, the
cheapest first: config.json (hf_config.py: at most MAX_CONFIG_JSON bytes, a JSON object, every field
used of its type, sizes under tpu_llm/config/schema.py's CAPS and MAX_PARAMS), every safetensors header
(safetensors_io), the tensors' names, dtypes and shapes against config.json (`check_tensors`, from the
model's spec), then the tokenizer. Whatever it holds ends in success or one UserError line, in
milliseconds, not after building a model of the size config.json claims.

`export --format hf` (hf_export.py) writes the same names back. Import then export gives back the same
tensors bit for bit: the mapping moves and transposes values, and float32 holds every bfloat16 and
float16 value exactly. How the tensors map is each family's `weights` (Keras Dense kernels are (in, out),
the transpose of a torch Linear's weight; GPT-2's Conv1D already stores (in, out)).
"""

from __future__ import annotations

import json
import os

import numpy as np
import tensorflow as tf

from tpu_llm.config.checks import trained_state
from tpu_llm.errors import UserError
from tpu_llm.interop import safetensors_io
from tpu_llm.interop.export import staged_directory
from tpu_llm.interop.hf_config import read_config, run_config
from tpu_llm.model import GPT, families, spec
from tpu_llm.platform.files import write_atomically
from tpu_llm.platform.run_layout import CONFIG_FILE, IMPORT_FILE, MARKER_FILE
from tpu_llm.tokenizers import save_tokenizer
from tpu_llm.tokenizers.hf import load_hf_tokenizer
from tpu_llm.training.checkpoint import Checkpointer
from tpu_llm.training.run_directory import (check_run_dir_owner, check_run_dir_reachable, check_run_dir_usable,
                                            is_run_dir)

CODE_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}  # safetensors' dtypes of the weights


# --------------------------------------------------------------------------------------------------
# Tensors <-> variables


def weights(m) -> list[tuple[str, str, bool]]:
    """(Hugging Face tensor name, Keras variable path without the model's prefix, transposed?) for the
    model section `m`, in the order export writes them: the family's names (model/families/)."""
    return families.of(m).weights(m)


def tensor_shapes(m) -> dict[str, tuple[int, ...]]:
    """{Hugging Face tensor name: its shape in a checkpoint} for the model section `m`, in `weights` order,
    from the model's spec alone (model/spec.py, as the layers build them): the checkpoint is compared with
    them before a model is built, so a mismatch costs milliseconds, not the building of a huge model."""
    shapes = spec.shapes(m, m.vocab_size)
    return {hf_name: shapes[path][::-1] if transposed else shapes[path] for hf_name, path, transposed in weights(m)
            if path in shapes}  # (a bias-free gpt2's biases: export writes zeros, import never meets one)


WEIGHT_DTYPES = ("F32", "BF16", "F16")  # what import reads into float32 variables, exactly


def check_tensors(reader: safetensors_io.Reader, m) -> dict[str, str]:
    """Compare the checkpoint's names, dtypes and shapes (its headers) with what the model section `m`
    needs, before anything is built; {Hugging Face name: the name stored in the checkpoint}."""
    family = families.of(m)
    names_of = family.hf_names(reader.names())
    wanted = weights(m)
    known = {hf_name for hf_name, _, _ in wanted}
    unknown = [n for n in names_of if n not in known and not family.ignored(n, m)]
    if unknown:
        raise UserError(f"the checkpoint has tensor {names_of[unknown[0]]}, which a {family.name} model of this "
                        f"config.json does not have ({len(unknown)} such); is config.json the one of these weights?")
    missing = [n for n in known if n not in names_of]
    if missing:
        first = next(n for n, _, _ in wanted if n not in names_of)
        raise UserError(f"the checkpoint lacks tensor {first} ({len(missing)} missing); download every shard")
    for hf_name, shape in tensor_shapes(m).items():
        stored = names_of[hf_name]
        dtype = reader.dtype(stored)
        if dtype not in WEIGHT_DTYPES:
            raise UserError(f"{reader.file(stored)}: tensor {stored} has dtype {dtype}; a weight is "
                            f"{', '.join(WEIGHT_DTYPES)}: is this a checkpoint of a language model?")
        if reader.shape(stored) != shape:
            raise UserError(f"{reader.file(stored)}: tensor {stored} has shape {list(reader.shape(stored))}, "
                            f"config.json implies {list(shape)}; is config.json the one of these weights?")
    return names_of


def load_weights(model, reader: safetensors_io.Reader, m, allow_non_finite: bool = False, warn=print) -> str:
    """Assign every tensor of `reader` to its variable of `model`; returns the checkpoint's dtype name. A
    tensor holding NaN or infinity is refused naming it (with `allow_non_finite`: said, and assigned)."""
    names_of = check_tensors(reader, m)
    variables, dtypes = model.by_path(), set()
    for hf_name, path, transposed in weights(m):
        stored = names_of[hf_name]
        dtypes.add(reader.dtype(stored))
        value = reader.get(stored).astype(np.float32)  # exact for bfloat16 and float16
        bad = value.size - int(np.count_nonzero(np.isfinite(value)))
        if bad:  # NaN or infinity: every token's logits would be NaN (generate printed the prompt only)
            if not allow_non_finite:
                raise UserError(f"{reader.file(stored)}: tensor {stored} holds {bad:,} non-finite values (NaN or "
                                f"infinity) of its {value.size:,}; the checkpoint is damaged: download it again (pass "
                                "--allow_non_finite to import it anyway)")
            warn(f"warning: {reader.file(stored)}: tensor {stored} holds {bad:,} non-finite values (NaN or "
                 "infinity); imported as they are (--allow_non_finite)")
        if transposed:
            value = value.T
        variable = variables[path]
        if tuple(value.shape) != tuple(variable.shape):  # check_tensors' shapes and the model's disagree: a bug
            raise AssertionError(f"{stored}: {list(value.shape)} read, the variable is {list(variable.shape)}")
        variable.assign(value)
    check_tied_head(reader, m, names_of)
    dtypes = sorted(CODE_NAMES.get(d, d) for d in dtypes)
    return dtypes[0] if len(dtypes) == 1 else "float32"


TIED_HEAD = "lm_head.weight"  # a tied head saved beside its table (family.ignored)


def check_tied_head(reader: safetensors_io.Reader, m, names_of: dict[str, str]) -> None:
    """config.json ties the head to the embedding table, yet the file holds lm_head.weight too: equal to the
    table (save_pretrained may write both), it is the same model; different, transformers 5 unties them
    ("both are present in the checkpoints with different values, so we will NOT tie them") and uses the
    file's head, where tpu-llm would use the table and generate other text. Refused, never silently
    different (transformers' own fix: tie_word_embeddings false)."""
    if not getattr(m, "tie_embeddings", True) or TIED_HEAD not in reader.where:
        return
    table = names_of[next(hf_name for hf_name, path, _ in weights(m) if path == "wte/embeddings")]
    head, embeddings = reader.get(TIED_HEAD), reader.get(table)
    if head.shape == embeddings.shape and np.array_equal(head.astype(np.float32), embeddings.astype(np.float32)):
        return
    differ = (f"{int(np.count_nonzero(head.astype(np.float32) != embeddings.astype(np.float32))):,} of its "
              f"{head.size:,} values" if head.shape == embeddings.shape else f"shape {list(head.shape)}")
    raise UserError(f"{reader.file(TIED_HEAD)}: {TIED_HEAD} differs from the embedding table {table} ({differ}), "
                    "but config.json says tie_word_embeddings: true; transformers then unties them and uses "
                    f"{TIED_HEAD}, tpu-llm would use the table: set tie_word_embeddings to false in config.json (a "
                    f"family with an untied head) to import the head as it is, or remove {TIED_HEAD} from the file "
                    "to import the table as the head")


# --------------------------------------------------------------------------------------------------
# Import


def import_checkpoint(source: str, run_dir: str, max_len: int = 0, allow_non_finite: bool = False,
                      warn=print, adapt=None) -> dict:
    """Make the new run directory `run_dir` from the Hugging Face model directory `source`; `max_len`
    (llama only) shortens the context, which sizes generation's KV cache (config.json's is often 128k);
    `adapt(cfg)`, called once `source` is checked, checks more and returns `put_on(model) -> model`
    (interop/peft.py's adapters).

    Everything from `source` is checked before anything is built or written, cheapest first: config.json
    (types, caps), every safetensors header, the tensors' names, dtypes and shapes against config.json,
    then the tokenizer."""
    import keras

    source, run_dir = str(source).rstrip("/"), str(run_dir).rstrip("/")
    hf = read_config(source)
    cfg = run_config(hf, source, run_dir, max_len)
    check_run_dir_reachable(run_dir)
    check_run_dir_owner(run_dir)  # not another tool's directory ...
    if is_run_dir(run_dir):  # ... and never an existing run: import makes a new one
        raise UserError(f"run_dir {run_dir!r} already holds a tpu-llm run; import into a new --run_dir")
    reader = safetensors_io.Reader(source)  # the weights' headers: fail before anything is written
    check_tensors(reader, cfg.model)
    put_on = adapt(cfg) if adapt else None  # before anything is written too
    tokenizer = load_hf_tokenizer(source)
    eos = getattr(tokenizer, "eos_id", None)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise UserError(f"the tokenizer in {source} has {tokenizer.vocab_size} ids, config.json's vocab_size is "
                        f"{cfg.model.vocab_size}; are they from the same model?")

    check_run_dir_usable(os.path.dirname(run_dir) or ".")
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("float32")
    try:  # an existing (empty: check_run_dir_owner) run_dir is replaced once the import is complete
        with staged_directory(run_dir, f"the run directory {run_dir!r}",
                              "fix its permissions or space, or pass another --run_dir") as tmp:
            net = GPT(cfg.model, cfg.model.vocab_size).build_weights()
            dtype = load_weights(net, reader, cfg.model, allow_non_finite, warn)
            net = put_on(net) if put_on else net
            tf.io.gfile.makedirs(tmp)
            write_atomically(os.path.join(tmp, MARKER_FILE), "a tpu-llm run directory (tpu_llm/training/checkpoint.py)\n")
            write_atomically(os.path.join(tmp, CONFIG_FILE), cfg.to_yaml())
            save_tokenizer(tokenizer, tmp)
            architecture = next(a for a in hf["architectures"] if a in families.get(cfg.model.family).architectures)
            meta = {"source": source, "architecture": architecture, "dtype": dtype, "config": hf}
            write_atomically(os.path.join(tmp, IMPORT_FILE), json.dumps(meta, indent=1) + "\n")
            # the model only (train adds the optimizer), and the tokenizer it goes with
            Checkpointer(tmp, keep=cfg.checkpoint.keep, tokenizer=tokenizer,
                         trained=trained_state(cfg, optimizer=False), model=net).save(0)
    finally:
        keras.mixed_precision.set_global_policy(policy)
    return {"run_dir": run_dir, "family": cfg.model.family, "dtype": dtype, "eos_id": eos,
            "params": net.num_params(), "tokenizer": tokenizer.kind, "adapter_rank": getattr(net.adapters, "rank", 0)}
