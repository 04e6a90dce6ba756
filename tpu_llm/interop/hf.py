"""Hugging Face checkpoints in and out: `tpu-llm import --from DIR` and `tpu-llm export --format hf`.

A Hugging Face model directory holds config.json, the weights (model.safetensors, or shards named by
model.safetensors.index.json; float32, bfloat16 or float16) and the tokenizer files. Two layouts are
read and written: GPT2LMHeadModel (model.family gpt2) and LlamaForCausalLM (model.family llama).

Import makes a new run directory, as `tpu-llm train` would: the marker, config.yaml (the mapped model
section, fine-tuning defaults for the rest), the tokenizer, and a checkpoint at step 0 holding the
model only (the first `train` in it starts a fresh optimizer). Every tensor is read on its own and
assigned to its variable (safetensors_io), so the host holds the model plus one tensor. Everything is
written into a temporary directory beside the target, renamed into place once complete.

Export reads the run's newest checkpoint (as `generate` does) and writes config.json,
model.safetensors, generation_config.json and the tokenizer files, in the dtype the run was imported
from (or --dtype). Import then export gives back the same tensors bit for bit: the mapping moves and
transposes values, and float32 holds every bfloat16 and float16 value exactly.

How the tensors map (Keras Dense kernels are (in, out), the transpose of a torch Linear's weight; GPT-2's
Conv1D already stores (in, out)): see WEIGHTS below, and the variables in tpu_llm/model/transformer.py.
"""

from __future__ import annotations

import json
import os

import numpy as np
import tensorflow as tf

from tpu_llm.config import ModelConfig, config_from_dict
from tpu_llm.errors import UserError
from tpu_llm.interop import safetensors_io
from tpu_llm.interop.export import EXPORT_FIX, META_FILE, export_target, load_float32, staged_directory
from tpu_llm.model import GPT
from tpu_llm.tokenizers import save_tokenizer
from tpu_llm.tokenizers.hf import load_hf_tokenizer, write_hf_tokenizer
from tpu_llm.training.checkpoint import (CONFIG_FILE, MARKER_FILE, Checkpointer, _write_atomically, check_run_dir_owner,
                                         check_run_dir_reachable, check_run_dir_usable, is_run_dir)

IMPORT_FILE = "hf_import.json"  # in an imported run: where it came from, its dtype and config.json
ARCHITECTURES = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama"}
EXPORT_DTYPES = ("auto", "float32", "bfloat16", "float16")
_NP_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": safetensors_io.DTYPES["BF16"],
              "float16": np.dtype(np.float16)}
_CODE_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


# --------------------------------------------------------------------------------------------------
# config.json <-> the model section


def _unsupported(field: str, value, supported: str) -> UserError:
    return UserError(f"config.json: {field}={json.dumps(value)} is not supported by tpu-llm ({supported})")


def model_config(hf: dict) -> dict:
    """The `model` section for a Hugging Face config.json; UserError naming the first field we cannot honour."""
    archs = hf.get("architectures") or []
    family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if family is None:
        raise _unsupported("architectures", archs, "supported: " + ", ".join(ARCHITECTURES))
    if family == "gpt2":
        return _gpt2_config(hf)
    return _llama_config(hf)


def _expect(hf: dict, field: str, allowed: tuple, default, supported: str) -> None:
    value = hf.get(field, default)
    if value not in allowed:
        raise _unsupported(field, value, supported)


def _gpt2_config(hf: dict) -> dict:
    C = hf["n_embd"]
    _expect(hf, "activation_function", ("gelu_new", "gelu_pytorch_tanh"), "gelu_new", "the tanh GELU: gelu_new")
    _expect(hf, "n_inner", (None, 4 * C), None, f"4 x n_embd = {4 * C}")
    _expect(hf, "scale_attn_weights", (True,), True, "true")
    _expect(hf, "scale_attn_by_inverse_layer_idx", (False,), False, "false")
    _expect(hf, "add_cross_attention", (False,), False, "false: a decoder only")
    _expect(hf, "tie_word_embeddings", (True,), True, "true: GPT-2's head is its embedding table")
    return {"family": "gpt2", "n_layer": hf["n_layer"], "n_head": hf["n_head"], "n_embd": C,
            "max_len": hf["n_positions"], "dropout": float(hf.get("resid_pdrop", 0.1)), "bias": True,
            "vocab_size": hf["vocab_size"], "norm_eps": float(hf.get("layer_norm_epsilon", 1e-5))}


def _rope(hf: dict) -> float:
    """rope_theta, from transformers 5's rope_parameters or the older rope_theta / rope_scaling."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling")
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "default":
            raise _unsupported("rope_scaling.rope_type", kind, "only plain rotary embeddings: no rope_scaling")
    kind = params.get("rope_type", "default")
    if kind != "default":
        raise _unsupported("rope_parameters.rope_type", kind, "only default")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _llama_config(hf: dict) -> dict:
    C, H = hf["hidden_size"], hf["num_attention_heads"]
    _expect(hf, "hidden_act", ("silu",), "silu", "silu (SwiGLU)")
    _expect(hf, "attention_bias", (False,), False, "false: no biases")
    _expect(hf, "mlp_bias", (False,), False, "false: no biases")
    _expect(hf, "head_dim", (None, C // H), None, f"hidden_size / num_attention_heads = {C // H}")
    _expect(hf, "pretraining_tp", (1,), 1, "1")
    return {"family": "llama", "n_layer": hf["num_hidden_layers"], "n_head": H, "n_embd": C,
            "max_len": hf["max_position_embeddings"], "dropout": float(hf.get("attention_dropout", 0.0)),
            "bias": False, "vocab_size": hf["vocab_size"], "n_kv_head": hf.get("num_key_value_heads") or H,
            "mlp_hidden": hf["intermediate_size"], "rope_theta": _rope(hf),
            "norm_eps": float(hf.get("rms_norm_eps", 1e-6)), "tie_embeddings": bool(hf.get("tie_word_embeddings", False))}


def _known_keys(model: dict) -> dict:
    """`model` without the keys this tree's ModelConfig lacks, when they hold what it does anyway."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for key in [k for k in model if k not in fields]:
        if (key, model[key]) not in (("family", "gpt2"), ("norm_eps", 1e-5)):
            raise UserError(f"config.json: this tpu-llm has no model.{key} (model.{key}={model[key]!r} needed)")
        del model[key]
    return model


def hf_config(m, bos_id: int, eos_id: int, dtype: str) -> dict:
    """config.json for the model section `m` (a ModelConfig)."""
    family = getattr(m, "family", "gpt2")
    eps = getattr(m, "norm_eps", 1e-5)
    if family == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": m.vocab_size,
                "n_positions": m.max_len, "n_embd": m.n_embd, "n_layer": m.n_layer, "n_head": m.n_head,
                "n_inner": None, "activation_function": "gelu_new", "resid_pdrop": m.dropout,
                "embd_pdrop": m.dropout, "attn_pdrop": m.dropout, "layer_norm_epsilon": eps,
                "initializer_range": 0.02, "scale_attn_weights": True, "use_cache": True,
                "bos_token_id": bos_id, "eos_token_id": eos_id, "tie_word_embeddings": True, "dtype": dtype}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": m.vocab_size,
            "hidden_size": m.n_embd, "intermediate_size": m.hidden(), "num_hidden_layers": m.n_layer,
            "num_attention_heads": m.n_head, "num_key_value_heads": m.kv_heads(), "head_dim": m.n_embd // m.n_head,
            "max_position_embeddings": m.max_len, "rms_norm_eps": eps, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "attention_dropout": m.dropout, "initializer_range": 0.02,
            "rope_theta": m.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
            "tie_word_embeddings": m.tie_embeddings, "use_cache": True, "bos_token_id": bos_id,
            "eos_token_id": eos_id, "dtype": dtype}


# --------------------------------------------------------------------------------------------------
# Tensors <-> variables


def weights(m) -> list[tuple[str, str, bool]]:
    """(Hugging Face tensor name, Keras variable path without the model's prefix, transposed?) for the
    model section `m`, in the order export writes them."""
    out = []
    if getattr(m, "family", "gpt2") == "gpt2":
        out += [("transformer.wte.weight", "wte/embeddings", False), ("transformer.wpe.weight", "wpe/embeddings", False)]
        for i in range(m.n_layer):
            h, b = f"transformer.h.{i}.", f"block_{i}/"
            # GPT-2's Conv1D stores (in, out), as Keras does: no transpose
            for hf_name, ours in (("ln_1", "ln1"), ("attn.c_attn", "attn/qkv"), ("attn.c_proj", "attn/proj"),
                                  ("ln_2", "ln2"), ("mlp.c_fc", "mlp/fc"), ("mlp.c_proj", "mlp/proj")):
                w, bias = ("gamma", "beta") if ours.startswith("ln") else ("kernel", "bias")
                out += [(f"{h}{hf_name}.weight", f"{b}{ours}/{w}", False), (f"{h}{hf_name}.bias", f"{b}{ours}/{bias}", False)]
        return out + [("transformer.ln_f.weight", "ln_f/gamma", False), ("transformer.ln_f.bias", "ln_f/beta", False)]
    out.append(("model.embed_tokens.weight", "wte/embeddings", False))
    for i in range(m.n_layer):
        h, b = f"model.layers.{i}.", f"block_{i}/"
        out += [(f"{h}input_layernorm.weight", f"{b}ln1/scale", False)]
        out += [(f"{h}self_attn.{p}_proj.weight", f"{b}attn/{q}/kernel", True)
                for p, q in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "proj"))]
        out += [(f"{h}post_attention_layernorm.weight", f"{b}ln2/scale", False)]
        out += [(f"{h}mlp.{p}_proj.weight", f"{b}mlp/{p}/kernel", True) for p in ("gate", "up", "down")]
    out.append(("model.norm.weight", "ln_f/scale", False))
    if not m.tie_embeddings:
        out.append(("lm_head.weight", "lm_head/embeddings", False))
    return out


def _variables(model) -> dict:
    prefix = model.name + "/"
    return {v.path[len(prefix):] if v.path.startswith(prefix) else v.path: v for v in model.weights
            if "seed_generator" not in v.path}


def _ignored(name: str, m) -> bool:
    """Tensors of a checkpoint that are not weights: GPT-2's causal-mask buffers (older files), Llama's
    rotary inv_freq buffers, and a tied head saved next to its embedding table."""
    return (name.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq"))
            or name == "lm_head.weight" and getattr(m, "tie_embeddings", True))


def load_weights(model, reader: safetensors_io.Reader, m) -> str:
    """Assign every tensor of `reader` to its variable of `model`; returns the checkpoint's dtype name."""
    wanted = {hf_name: (path, transposed) for hf_name, path, transposed in weights(m)}
    names = reader.names()
    if getattr(m, "family", "gpt2") == "gpt2" and not any(n.startswith("transformer.") for n in names):
        names_of = {f"transformer.{n}" if not n.startswith("lm_head") else n: n for n in names}  # the hub's gpt2
    else:
        names_of = {n: n for n in names}
    unknown = [n for n in names_of if n not in wanted and not _ignored(n, m)]
    if unknown:
        family = getattr(m, "family", "gpt2")
        raise UserError(f"the checkpoint has tensor {names_of[unknown[0]]}, which a {family} model of this "
                        f"config.json does not have ({len(unknown)} such); is config.json the one of these weights?")
    missing = [n for n in wanted if n not in names_of]
    if missing:
        raise UserError(f"the checkpoint lacks tensor {missing[0]} ({len(missing)} missing); download every shard")
    variables, dtypes = _variables(model), set()
    for hf_name, (path, transposed) in wanted.items():
        stored = names_of[hf_name]
        dtypes.add(reader.dtype(stored))
        value = reader.get(stored).astype(np.float32)  # exact for bfloat16 and float16
        if transposed:
            value = value.T
        variable = variables[path]
        if tuple(value.shape) != tuple(variable.shape):
            raise UserError(f"tensor {stored} has shape {list(value.shape)}, config.json implies "
                            f"{list(variable.shape)}; is config.json the one of these weights?")
        variable.assign(value)
    dtypes = sorted(_CODE_NAMES.get(d, d) for d in dtypes)
    return dtypes[0] if len(dtypes) == 1 else "float32"


# --------------------------------------------------------------------------------------------------
# Tokenizer (tpu_llm/tokenizers/core.py's kinds; the Hugging Face one reads and writes the HF files)


def _write_tokenizer(tokenizer, output: str, max_len: int) -> list[str]:
    """Hugging Face tokenizer files for `tokenizer` in `output` (an hf tokenizer only); the names written."""
    if getattr(tokenizer, "kind", "") != "hf":
        return []  # byte, char, sentencepiece: transformers has no files for them

    return write_hf_tokenizer(tokenizer, output, model_max_length=max_len)


# --------------------------------------------------------------------------------------------------
# Import


def import_checkpoint(source: str, run_dir: str, max_len: int = 0) -> dict:
    """Make the new run directory `run_dir` from the Hugging Face model directory `source`; `max_len`
    (llama only) shortens the context, which sizes generation's KV cache (config.json's is often 128k)."""
    import keras

    source, run_dir = str(source).rstrip("/"), str(run_dir).rstrip("/")
    config_path = os.path.join(source, "config.json")
    if not tf.io.gfile.exists(config_path):
        raise UserError(f"--from {source!r} has no config.json; give a Hugging Face model directory (e.g. "
                        "`huggingface-cli download gpt2 --local-dir gpt2`)")
    with tf.io.gfile.GFile(config_path) as f:
        hf = json.load(f)
    model = _known_keys(model_config(hf))
    if max_len and max_len != model["max_len"]:
        if model.get("family") != "llama" or not 0 < max_len < model["max_len"]:
            raise UserError(f"--max_len={max_len}: give a context shorter than config.json's {model['max_len']}, for a "
                            "llama model (a gpt2 model's learned position table fixes its own)")
        model["max_len"] = max_len
    check_run_dir_reachable(run_dir)
    check_run_dir_owner(run_dir)  # not another tool's directory ...
    if is_run_dir(run_dir):  # ... and never an existing run: import makes a new one
        raise UserError(f"run_dir {run_dir!r} already holds a tpu-llm run; import into a new --run_dir")
    reader = safetensors_io.Reader(source)  # the weights' headers: fail before anything is written
    tokenizer = load_hf_tokenizer(source)
    eos = getattr(tokenizer, "eos_id", None)
    settings = {"run_dir": run_dir, "model": model,
                "data": {"tokenizer": tokenizer.kind, "seq_len": min(256, model["max_len"])},
                # fine-tuning: a tenth of the from-scratch rate, short warmup, no dropout surprises
                "train": {"lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 20, "steps": 200, "weight_decay": 0.0},
                "checkpoint": {"every_steps": 100}}
    cfg = config_from_dict(settings, source=config_path)
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
            dtype = load_weights(net, reader, cfg.model)
            tf.io.gfile.makedirs(tmp)
            _write_atomically(os.path.join(tmp, MARKER_FILE), "a tpu-llm run directory (tpu_llm/training/checkpoint.py)\n")
            _write_atomically(os.path.join(tmp, CONFIG_FILE), cfg.to_yaml())
            save_tokenizer(tokenizer, tmp)
            meta = {"source": source, "architecture": hf["architectures"][0], "dtype": dtype, "config": hf}
            _write_atomically(os.path.join(tmp, IMPORT_FILE), json.dumps(meta, indent=1) + "\n")
            Checkpointer(tmp, keep=cfg.checkpoint.keep, model=net).save(0)  # the model only: train adds the optimizer
    finally:
        keras.mixed_precision.set_global_policy(policy)
    return {"run_dir": run_dir, "family": model.get("family", "gpt2"), "dtype": dtype, "eos_id": eos,
            "params": net.num_params(), "tokenizer": tokenizer.kind}


# --------------------------------------------------------------------------------------------------
# Export


def export(run_dir: str, output: str = "", overwrite: bool = False, dtype: str = "auto") -> dict:
    """Write `run_dir`'s newest checkpoint in the Hugging Face layout to `output` (default <run_dir>/hf)."""
    if dtype not in EXPORT_DTYPES:
        raise UserError(f"--dtype={dtype!r}; valid choices: {', '.join(EXPORT_DTYPES)}")
    run_dir, output = export_target(run_dir, output, "hf", overwrite)
    model, tokenizer, cfg, checkpoint, notes = load_float32(run_dir)
    if dtype == "auto":  # an imported run goes back in the dtype it came in
        dtype = "float32"
        meta_path = os.path.join(run_dir, IMPORT_FILE)
        if tf.io.gfile.exists(meta_path):
            with tf.io.gfile.GFile(meta_path) as f:
                dtype = json.load(f).get("dtype", "float32")
    m = cfg.model
    if not hasattr(m, "family"):  # a model section from before the families: gpt2
        m.family = "gpt2"
    tail = checkpoint.rsplit("ckpt-", 1)[-1]
    step = int(tail) if tail.isdigit() else None
    variables = _variables(model)
    np_dtype = _NP_DTYPES[dtype]

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
        _write_json(os.path.join(tmp, "config.json"), hf_config(m, bos, eos, dtype))
        _write_json(os.path.join(tmp, "generation_config.json"),
                    {"bos_token_id": bos, "eos_token_id": eos, "max_length": m.max_len})
        written = _write_tokenizer(tokenizer, tmp, m.max_len)
        meta = {"run_dir": run_dir, "checkpoint": checkpoint, "step": step, "format": "hf", "dtype": dtype,
                "family": m.family, "vocab_size": m.vocab_size, "eos_id": eos, "tokenizer_files": written}
        _write_json(os.path.join(tmp, META_FILE), meta)
    return {**meta, "output": output, "notes": notes}


def _write_json(path: str, data: dict) -> None:
    with tf.io.gfile.GFile(path, "w") as f:
        f.write(json.dumps(data, indent=2) + "\n")

