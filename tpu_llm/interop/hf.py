"""Hugging Face checkpoints in and out: `tpu-llm import --from DIR` and `tpu-llm export --format hf`.

A Hugging Face model directory holds config.json, the weights (model.safetensors, or shards named by
model.safetensors.index.json; float32, bfloat16 or float16) and the tokenizer files. These architectures
are read and written: GPT2LMHeadModel (model.family gpt2), LlamaForCausalLM (llama, Llama 3.1's
`rope_type: llama3` included), Qwen2ForCausalLM (qwen2: Llama's layout with q/k/v biases) and
MistralForCausalLM (mistral); Gemma's are refused in one line naming what they would need.

Import makes a new run directory, as `tpu-llm train` would: the marker, config.yaml (the mapped model
section, fine-tuning defaults for the rest), the tokenizer, and a checkpoint at step 0 holding the
model only (the first `train` in it starts a fresh optimizer). Every tensor is read on its own and
assigned to its variable (safetensors_io), so the host holds the model plus one tensor. Everything is
written into a temporary directory beside the target, renamed into place once complete.

The model directory comes from outside (a download), so it is checked before anything is built, the
cheapest first: config.json (at most MAX_CONFIG_JSON bytes, a JSON object, every field used of its type,
sizes under tpu_llm/config.py's CAPS and MAX_PARAMS), every safetensors header (safetensors_io), the
tensors' names, dtypes and shapes against config.json (`check_tensors`, from `variable_shapes`), then
the tokenizer. Whatever it holds ends in success or one UserError line, in milliseconds, not after
building a model of the size config.json claims.

Export reads the run's newest checkpoint (as `generate` does) and writes config.json,
model.safetensors, generation_config.json and the tokenizer files, in the dtype the run was imported
from (or --dtype). Import then export gives back the same tensors bit for bit: the mapping moves and
transposes values, and float32 holds every bfloat16 and float16 value exactly.

How the tensors map (Keras Dense kernels are (in, out), the transpose of a torch Linear's weight; GPT-2's
Conv1D already stores (in, out)): see WEIGHTS below, and the variables in tpu_llm/model/transformer.py.
"""

from __future__ import annotations

import json
import math
import os
import reprlib

import numpy as np
import tensorflow as tf

from tpu_llm.config import CAPS, Config, ModelConfig, config_from_dict
from tpu_llm.errors import UserError
from tpu_llm import files
from tpu_llm.files import write_atomically
from tpu_llm.interop import safetensors_io
from tpu_llm.interop.export import EXPORT_FIX, META_FILE, export_target, load_float32, staged_directory
from tpu_llm.model import GPT
from tpu_llm.run_layout import CONFIG_FILE, HF_EXPORT_DIR, IMPORT_FILE, MARKER_FILE, checkpoint_step
from tpu_llm.tokenizers import save_tokenizer
from tpu_llm.tokenizers.hf import load_hf_tokenizer, write_hf_tokenizer
from tpu_llm.training.checkpoint import (Checkpointer, check_run_dir_owner, check_run_dir_reachable, check_run_dir_usable,
                                         is_run_dir)

ARCHITECTURES = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                 "MistralForCausalLM": "mistral"}
EXPORTED_AS = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),  # (architecture,
               "mistral": ("MistralForCausalLM", "mistral")}                                   # model_type)
# Gemma: what Llama's layout here lacks, for the one line that refuses it
_GEMMA = ("(1 + weight) RMSNorm, embeddings scaled by sqrt(hidden_size), a GeGLU MLP, head_dim apart from "
          "hidden_size / heads{}")
REFUSED = {"GemmaForCausalLM": _GEMMA.format(""),
           "Gemma2ForCausalLM": _GEMMA.format(", post-attention and post-MLP norms, logit soft-capping and "
                                              "sliding-window layers"),
           "Gemma3ForCausalLM": _GEMMA.format(", post-attention and post-MLP norms, q/k norms and sliding-window "
                                              "layers with their own rotary base"),
           "Gemma3ForConditionalGeneration": "a vision tower besides Gemma 3's decoder"}
EXPORT_DTYPES = ("auto", "float32", "bfloat16", "float16")
_NP_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": safetensors_io.DTYPES["BF16"],
              "float16": np.dtype(np.float16)}
_CODE_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


# --------------------------------------------------------------------------------------------------
# config.json <-> the model section


MAX_CONFIG_JSON = 10 << 20  # bytes of config.json: a real one is a few KB
_FIX = "give the config.json that came with the weights"


def _shown(value) -> str:
    """`value` as config.json writes it, for a message: cut short however long or deep it is."""
    try:
        text = json.dumps(value)
    except (RecursionError, ValueError, TypeError):
        text = reprlib.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _unsupported(field: str, value, supported: str) -> UserError:
    return UserError(f"config.json: {field}={_shown(value)} is not supported by tpu-llm ({supported})")


def read_config(source: str) -> dict:
    """config.json of the Hugging Face model directory `source`, a JSON object of at most
    MAX_CONFIG_JSON bytes, or a one-line UserError."""
    path = os.path.join(source, "config.json")
    if not tf.io.gfile.exists(path):
        raise UserError(f"--from {source!r} has no config.json; give a Hugging Face model directory (e.g. "
                        "`huggingface-cli download gpt2 --local-dir gpt2`)")
    return read_json(path)


def read_json(path: str, fix: str = _FIX) -> dict:
    """The JSON object in the file `path` (config.json, a PEFT adapter's adapter_config.json) of at most
    MAX_CONFIG_JSON bytes, or a one-line UserError ending in `fix`."""
    raw = safetensors_io.read_capped(path, MAX_CONFIG_JSON, f"a {os.path.basename(path)}", fix)
    try:
        hf = json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: nested thousands deep
        reason = str(e).splitlines()[0][:80] if isinstance(e, ValueError) else "nested too deeply"
        raise UserError(f"{path} is not valid JSON ({reason}); {fix}") from None
    if not isinstance(hf, dict):
        raise UserError(f"{path} is a JSON {type(hf).__name__}, not an object; {fix}")
    return hf


_REQUIRED = object()


def _int(hf: dict, field: str, cap_key: str | None = None, default=_REQUIRED, low: int = 1) -> int:
    """The integer config.json gives `field`, at least `low` and at most the cap of the config key
    `cap_key` (tpu_llm/config.py CAPS): a size from outside never reaches a loop or an allocation
    unchecked."""
    if field not in hf and default is _REQUIRED:
        raise UserError(f"config.json has no {field}; {_FIX}")
    value = hf.get(field, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise UserError(f"config.json: {field}={_shown(value)} is not an integer >= {low}; {_FIX}")
    if cap_key and value > CAPS[cap_key][0]:
        cap, why = CAPS[cap_key]
        raise UserError(f"config.json: {field}={value} is more than tpu-llm's cap of {cap:,} ({why})")
    return value


def _float(hf: dict, field: str, default: float) -> float:
    value = hf.get(field, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise UserError(f"config.json: {field}={_shown(value)} is not a finite number; {_FIX}")
    return float(value)


def _bool(hf: dict, field: str, default: bool) -> bool:
    value = hf.get(field, default)
    if not isinstance(value, bool):
        raise UserError(f"config.json: {field}={_shown(value)} is not true or false; {_FIX}")
    return value


def _object(hf: dict, field: str) -> dict:
    value = hf.get(field) or {}
    if not isinstance(value, dict):
        raise UserError(f"config.json: {field}={_shown(value)} is not an object; {_FIX}")
    return value


def model_config(hf: dict) -> dict:
    """The `model` section for a Hugging Face config.json; UserError naming the first field we cannot honour."""
    archs = hf.get("architectures") or []
    names = archs if isinstance(archs, list) else []
    family = next((ARCHITECTURES[a] for a in names if isinstance(a, str) and a in ARCHITECTURES), None)
    refused = next((a for a in names if isinstance(a, str) and a in REFUSED), None)
    if family is None and refused:
        raise UserError(f"config.json: architectures={_shown(archs)} is not supported by tpu-llm: {refused} needs "
                        f"{REFUSED[refused]}, which tpu-llm does not have (supported: {', '.join(ARCHITECTURES)})")
    if family is None:
        raise _unsupported("architectures", archs, "supported: " + ", ".join(ARCHITECTURES))
    if family == "gpt2":
        return _gpt2_config(hf)
    return _llama_config(hf, family)


def _expect(hf: dict, field: str, allowed: tuple, default, supported: str) -> None:
    value = hf.get(field, default)
    if value not in allowed:  # == on any JSON value: never raises
        raise _unsupported(field, value, supported)


def _gpt2_config(hf: dict) -> dict:
    C = _int(hf, "n_embd", "model.n_embd")
    _expect(hf, "activation_function", ("gelu_new", "gelu_pytorch_tanh"), "gelu_new", "the tanh GELU: gelu_new")
    _expect(hf, "n_inner", (None, 4 * C), None, f"4 x n_embd = {4 * C}")
    _expect(hf, "scale_attn_weights", (True,), True, "true")
    _expect(hf, "scale_attn_by_inverse_layer_idx", (False,), False, "false")
    _expect(hf, "add_cross_attention", (False,), False, "false: a decoder only")
    _expect(hf, "tie_word_embeddings", (True,), True, "true: GPT-2's head is its embedding table")
    return {"family": "gpt2", "n_layer": _int(hf, "n_layer", "model.n_layer"), "n_head": _int(hf, "n_head", "model.n_head"),
            "n_embd": C, "max_len": _int(hf, "n_positions", "model.max_len"), "dropout": _float(hf, "resid_pdrop", 0.1),
            "bias": True, "vocab_size": _int(hf, "vocab_size", "model.vocab_size"),
            "norm_eps": _float(hf, "layer_norm_epsilon", 1e-5)}


ROPE_TYPES = ("default", "llama3")


def _rope(hf: dict) -> dict:
    """The model section's rotary settings, from transformers 5's rope_parameters or the older rope_theta
    and rope_scaling: the base, and Llama 3.1's frequency scaling (rope_type llama3) with its four numbers."""
    out = {"rope_theta": 10000.0}
    for field in ("rope_scaling", "rope_parameters"):  # the newer last: it wins
        params = _object(hf, field)
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise _unsupported(f"{field}.rope_type", kind, "supported: " + ", ".join(ROPE_TYPES))
        _expect(params, "partial_rotary_factor", (1, 1.0), 1.0, "1.0: every dimension rotates")
        if kind == "llama3":
            out.update(rope_scaling="llama3", rope_factor=_float(params, "factor", None),
                       rope_low_freq_factor=_float(params, "low_freq_factor", None),
                       rope_high_freq_factor=_float(params, "high_freq_factor", None),
                       rope_original_max_len=_int(params, "original_max_position_embeddings",
                                                  "model.rope_original_max_len"))
        elif params:
            out.pop("rope_scaling", None)  # rope_parameters says default: an old rope_scaling is overruled
    out["rope_theta"] = _float(_object(hf, "rope_parameters"), "rope_theta", _float(hf, "rope_theta", 10000.0))
    return out


def _sliding_window(hf: dict, family: str, context: int) -> None:
    """A UserError if a sliding window (Mistral's; Qwen2's with use_sliding_window) is shorter than
    `context`, the context the import keeps: only then does it differ from full causal attention."""
    window = hf.get("sliding_window")
    if family == "qwen2" and not _bool(hf, "use_sliding_window", False) or window is None:
        return
    window = _int(hf, "sliding_window")
    if family == "qwen2":  # only layers from max_window_layers on (or as layer_types says) slide
        types = hf.get("layer_types")
        first = _int(hf, "max_window_layers", default=0, low=0)
        sliding = ("sliding_attention" in types if isinstance(types, list)
                   else first < _int(hf, "num_hidden_layers"))
        if not sliding:
            return
    if window < context:
        raise UserError(f"config.json: sliding_window={window} is shorter than the context of {context} tokens, "
                        f"and tpu-llm has no sliding-window attention; import with --max_len {window} (or less)")


def _llama_config(hf: dict, family: str) -> dict:
    """Llama's layout: llama, qwen2 (with q/k/v biases, which Qwen2's config.json does not mention) and mistral."""
    C, H = _int(hf, "hidden_size", "model.n_embd"), _int(hf, "num_attention_heads", "model.n_head")
    _expect(hf, "hidden_act", ("silu",), "silu", "silu (SwiGLU)")
    _expect(hf, "attention_bias", (False,), False, "false: no biases in Llama's attention (Qwen2 is its own family)")
    _expect(hf, "mlp_bias", (False,), False, "false: no biases")
    _expect(hf, "head_dim", (None, C // H), None, f"hidden_size / num_attention_heads = {C // H}")
    _expect(hf, "pretraining_tp", (1,), 1, "1")
    kv = _int(hf, "num_key_value_heads", "model.n_head") if hf.get("num_key_value_heads") not in (None, 0) else H
    return {"family": family, "n_layer": _int(hf, "num_hidden_layers", "model.n_layer"), "n_head": H, "n_embd": C,
            "max_len": _int(hf, "max_position_embeddings", "model.max_len"),
            "dropout": _float(hf, "attention_dropout", 0.0), "bias": family == "qwen2",
            "vocab_size": _int(hf, "vocab_size", "model.vocab_size"), "n_kv_head": kv,
            "mlp_hidden": _int(hf, "intermediate_size", "model.mlp_hidden"), **_rope(hf),
            "norm_eps": _float(hf, "rms_norm_eps", 1e-6), "tie_embeddings": _bool(hf, "tie_word_embeddings", False)}


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
    architecture, model_type = EXPORTED_AS[family]
    rope = {"rope_type": "default", "rope_theta": m.rope_theta}
    if getattr(m, "rope_scaling", "none") == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": m.rope_theta, "factor": m.rope_factor,
                "low_freq_factor": m.rope_low_freq_factor, "high_freq_factor": m.rope_high_freq_factor,
                "original_max_position_embeddings": m.rope_original_max_len}
    out = {"architectures": [architecture], "model_type": model_type, "vocab_size": m.vocab_size,
           "hidden_size": m.n_embd, "intermediate_size": m.hidden(), "num_hidden_layers": m.n_layer,
           "num_attention_heads": m.n_head, "num_key_value_heads": m.kv_heads(), "head_dim": m.n_embd // m.n_head,
           "max_position_embeddings": m.max_len, "rms_norm_eps": eps, "hidden_act": "silu",
           "attention_dropout": m.dropout, "initializer_range": 0.02,
           # rope_parameters for transformers 5, rope_theta and rope_scaling for 4.x
           "rope_theta": m.rope_theta, "rope_parameters": rope,
           **({"rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"}} if len(rope) > 2 else {}),
           "tie_word_embeddings": m.tie_embeddings, "use_cache": True, "bos_token_id": bos_id,
           "eos_token_id": eos_id, "dtype": dtype}
    if family == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    else:  # full causal attention: no sliding window (import refuses one shorter than the context)
        out["sliding_window"] = None
        if family == "qwen2":
            out.update(use_sliding_window=False, max_window_layers=m.n_layer)
    return out


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
        if m.family == "qwen2":  # Qwen2's q/k/v biases (in the order its checkpoints list them)
            out += [(f"{h}self_attn.{p}_proj.bias", f"{b}attn/{p}/bias", False) for p in ("q", "k", "v")]
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


def variable_shapes(m) -> dict[str, tuple[int, ...]]:
    """The shape of every variable `weights(m)` names (its Keras path without `block_i/`), from the model
    section alone (as tpu_llm/model/transformer.py builds them): the checkpoint is compared with them
    before a model is built, so a mismatch costs milliseconds, not the building of a huge model."""
    C, V, F = m.n_embd, m.vocab_size, m.hidden()
    hd = C // m.n_head
    q, kv = m.n_head * hd, m.kv_heads() * hd
    return {"wte/embeddings": (V, C), "wpe/embeddings": (m.max_len, C), "lm_head/embeddings": (V, C),
            "ln_f/gamma": (C,), "ln_f/beta": (C,), "ln_f/scale": (C,),
            "ln1/gamma": (C,), "ln1/beta": (C,), "ln1/scale": (C,), "ln2/gamma": (C,), "ln2/beta": (C,), "ln2/scale": (C,),
            "attn/qkv/kernel": (C, 3 * C), "attn/qkv/bias": (3 * C,), "attn/proj/kernel": (q, C), "attn/proj/bias": (C,),
            "attn/q/kernel": (C, q), "attn/k/kernel": (C, kv), "attn/v/kernel": (C, kv),
            "attn/q/bias": (q,), "attn/k/bias": (kv,), "attn/v/bias": (kv,),
            "mlp/fc/kernel": (C, F), "mlp/fc/bias": (F,), "mlp/proj/kernel": (F, C), "mlp/proj/bias": (C,),
            "mlp/gate/kernel": (C, F), "mlp/up/kernel": (C, F), "mlp/down/kernel": (F, C)}


def tensor_shapes(m) -> dict[str, tuple[int, ...]]:
    """{Hugging Face tensor name: its shape in a checkpoint} for the model section `m`, in `weights` order."""
    shapes = variable_shapes(m)
    out = {}
    for hf_name, path, transposed in weights(m):
        shape = shapes[path.split("/", 1)[1] if path.startswith("block_") else path]
        out[hf_name] = shape[::-1] if transposed else shape
    return out


WEIGHT_DTYPES = ("F32", "BF16", "F16")  # what import reads into float32 variables, exactly


def check_tensors(reader: safetensors_io.Reader, m) -> dict[str, str]:
    """Compare the checkpoint's names, dtypes and shapes (its headers) with what the model section `m`
    needs, before anything is built; {Hugging Face name: the name stored in the checkpoint}."""
    names = reader.names()
    if getattr(m, "family", "gpt2") == "gpt2" and not any(n.startswith("transformer.") for n in names):
        names_of = {f"transformer.{n}" if not n.startswith("lm_head") else n: n for n in names}  # the hub's gpt2
    else:
        names_of = {n: n for n in names}
    wanted = weights(m)
    known = {hf_name for hf_name, _, _ in wanted}
    unknown = [n for n in names_of if n not in known and not _ignored(n, m)]
    if unknown:
        family = getattr(m, "family", "gpt2")
        raise UserError(f"the checkpoint has tensor {names_of[unknown[0]]}, which a {family} model of this "
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
    variables, dtypes = _variables(model), set()
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


def run_config(hf: dict, source: str, run_dir: str, max_len: int = 0) -> Config:
    """The config of the new run `run_dir` for the config.json `hf` (of the model directory `source`):
    the mapped model section, fine-tuning defaults for the rest, validated (tpu_llm/config.py: types
    and caps)."""
    model = _known_keys(model_config(hf))
    if max_len and max_len != model["max_len"]:
        if model.get("family", "gpt2") == "gpt2" or not 0 < max_len < model["max_len"]:
            raise UserError(f"--max_len={max_len}: give a context shorter than config.json's {model['max_len']}, for a "
                            "llama, qwen2 or mistral model (a gpt2 model's learned position table fixes its own)")
        model["max_len"] = max_len
    if model.get("family", "gpt2") != "gpt2":
        _sliding_window(hf, model["family"], model["max_len"])
    settings = {"run_dir": run_dir, "model": model,
                "data": {"tokenizer": "hf", "seq_len": min(256, model["max_len"])},
                # fine-tuning: a tenth of the from-scratch rate, short warmup, no dropout surprises
                "train": {"lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 20, "steps": 200, "weight_decay": 0.0},
                "checkpoint": {"every_steps": 100}}
    return config_from_dict(settings, source=os.path.join(source, "config.json"))


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
            architecture = next(a for a in hf["architectures"] if isinstance(a, str) and a in ARCHITECTURES)
            meta = {"source": source, "architecture": architecture, "dtype": dtype, "config": hf}
            write_atomically(os.path.join(tmp, IMPORT_FILE), json.dumps(meta, indent=1) + "\n")
            # the model only (train adds the optimizer), and the tokenizer it goes with
            Checkpointer(tmp, keep=cfg.checkpoint.keep, tokenizer=tokenizer, model=net).save(0)
    finally:
        keras.mixed_precision.set_global_policy(policy)
    return {"run_dir": run_dir, "family": cfg.model.family, "dtype": dtype, "eos_id": eos,
            "params": net.num_params(), "tokenizer": tokenizer.kind, "lora_rank": cfg.train.lora_rank}


# --------------------------------------------------------------------------------------------------
# Export


def export(run_dir: str, output: str = "", overwrite: bool = False, dtype: str = "auto") -> dict:
    """Write `run_dir`'s newest checkpoint in the Hugging Face layout to `output` (default <run_dir>/hf)."""
    if dtype not in EXPORT_DTYPES:
        raise UserError(f"--dtype={dtype!r}; valid choices: {', '.join(EXPORT_DTYPES)}")
    run_dir, output = export_target(run_dir, output, HF_EXPORT_DIR, overwrite)
    model, tokenizer, cfg, checkpoint, notes = load_float32(run_dir)
    if dtype == "auto":  # an imported run goes back in the dtype it came in
        dtype = imported_dtype(run_dir)
    m = cfg.model
    if not hasattr(m, "family"):  # a model section from before the families: gpt2
        m.family = "gpt2"
    step = checkpoint_step(checkpoint)
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
        write_json(os.path.join(tmp, "config.json"), hf_config(m, bos, eos, dtype))
        write_json(os.path.join(tmp, "generation_config.json"),
                    {"bos_token_id": bos, "eos_token_id": eos, "max_length": m.max_len})
        written = _write_tokenizer(tokenizer, tmp, m.max_len)
        meta = {"run_dir": run_dir, "checkpoint": checkpoint, "step": step, "format": "hf", "dtype": dtype,
                "family": m.family, "vocab_size": m.vocab_size, "eos_id": eos, "tokenizer_files": written}
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
    if not isinstance(dtype, str) or dtype not in _NP_DTYPES:
        raise UserError(f"{path}: dtype {_shown(dtype)} is none export writes ({', '.join(_NP_DTYPES)}); {fix}")
    return dtype


def write_json(path: str, data: dict) -> None:
    with tf.io.gfile.GFile(path, "w") as f:
        f.write(json.dumps(data, indent=2) + "\n")

