"""A LoRA run's adapters in Hugging Face PEFT's format: `tpu-llm export --format peft`, and `tpu-llm import
--adapter DIR` (a base checkpoint with a PEFT adapter on it: a LoRA run at step 0).

<output>/                       (default <run_dir>/peft)
  adapter_config.json           PEFT's LoraConfig: peft_type LORA, r, lora_alpha, lora_dropout, target_modules
                                (train.lora_targets), task_type CAUSAL_LM; gpt2: fan_in_fan_out (its Conv1D)
  adapter_model.safetensors     base_model.model.<module>.lora_A.weight (r, in) and .lora_B.weight (out, r) of
                                every adapted module, float32: the transposes of our A (in, r) and B (r, out)
  export.json                   what was exported from where

`peft.PeftModel.from_pretrained(base, output)` puts the adapters on the transformers model the run's base
came from (`tpu-llm export --format hf` of the base run, or the checkpoint `tpu-llm import` read) and gives
this run's logits. The module names are interop/hf.py's tensor names without `.weight`: one table for the
weights and their adapters.
"""

from __future__ import annotations

import math
import os

import numpy as np
import tensorflow as tf

from tpu_llm.config import validate
from tpu_llm.config.checks import lora_targets
from tpu_llm.config.reading import set_dotted
from tpu_llm.errors import UserError
from tpu_llm.interop import hf, safetensors_io
from tpu_llm.interop.export import EXPORT_FIX, META_FILE, export_target, staged_directory
from tpu_llm.interop.hf_config import read_json, shown
from tpu_llm.interop.hf_export import write_json
from tpu_llm.model import GPT, adapters, families, spec
from tpu_llm.platform.run_layout import PEFT_EXPORT_DIR, checkpoint_step
from tpu_llm.training.checkpoint import load_for_generation

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."  # PEFT's names of the wrapped model's modules


def adapter_modules(m) -> list[tuple[str, str]]:
    """(Hugging Face module name, our layer path without the model's prefix) of every projection an
    adapter can sit on (PEFT's module names: model.layers.0.self_attn.q_proj, transformer.h.0.attn.c_attn)."""
    return [(name[:-len(".weight")], path[:-len("/kernel")])
            for name, path, _ in hf.weights(m) if path.endswith("/kernel")]


def adapter_config(cfg) -> dict:
    """PEFT's adapter_config.json for the run's train.lora_* settings."""
    t, family = cfg.train, families.of(cfg.model)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": t.lora_rank, "lora_alpha": t.lora_alpha,
            "lora_dropout": t.lora_dropout, "target_modules": lora_targets(t.lora_targets, family.name),
            "fan_in_fan_out": family.peft_fan_in_fan_out, "bias": "none", "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": None, "layers_to_transform": None,
            "rank_pattern": {}, "alpha_pattern": {}, "base_model_name_or_path": None}


def export(run_dir: str, output: str = "", overwrite: bool = False) -> dict:
    """Write the adapters of `run_dir`'s newest checkpoint in PEFT's format to `output`."""
    run_dir, output = export_target(run_dir, output, PEFT_EXPORT_DIR, overwrite)
    model, _, cfg, checkpoint, notes = load_for_generation(run_dir, with_checkpoint=True, with_notes=True)
    if not cfg.train.lora_rank:
        raise UserError(f"{run_dir!r} has no adapters (train.lora_rank=0): --format peft writes a LoRA run's; "
                        "export the whole model with --format hf")
    layers = {path: layer for path, layer in ((lay.path.removeprefix(model.name + "/"), lay)
                                              for lay in adapters.adapted(model))}
    tensors = {}  # name: (variable, transposed)
    for module, path in adapter_modules(cfg.model):
        if path in layers:
            tensors[f"{PREFIX}{module}.lora_A.weight"] = layers[path].lora_a
            tensors[f"{PREFIX}{module}.lora_B.weight"] = layers[path].lora_b
    with staged_directory(output, f"the export to {output!r}", EXPORT_FIX) as tmp:
        tf.io.gfile.makedirs(tmp)
        safetensors_io.write(os.path.join(tmp, WEIGHTS_FILE),
                             [(name, tuple(v.shape)[::-1], "float32") for name, v in tensors.items()],
                             lambda name: tensors[name].numpy().T)
        write_json(os.path.join(tmp, CONFIG_FILE), adapter_config(cfg))
        meta = {"run_dir": run_dir, "checkpoint": checkpoint, "step": checkpoint_step(checkpoint), "format": "peft",
                "family": cfg.model.family, "adapters": len(tensors) // 2, "rank": cfg.train.lora_rank}
        write_json(os.path.join(tmp, META_FILE), meta)
    return {**meta, "output": output, "notes": notes}


# --------------------------------------------------------------------------------------------------
# Import: `tpu-llm import --from BASE --adapter DIR`

ADAPTER_FIX = "give the directory PEFT's save_pretrained wrote for a LoRA adapter"
# PEFT settings whose non-default values compute something else than the adapters here
PLAIN = {"use_dora": False, "use_rslora": False, "bias": "none", "modules_to_save": None, "layers_to_transform": None,
         "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}, "megatron_config": None}


def read_adapter(directory: str, cfg, allow_non_finite: bool = False, warn=print) -> safetensors_io.Reader:
    """Check the PEFT adapter in `directory` against the model section of `cfg` (its settings, then every
    tensor's name, dtype and shape from the file's header, then its values: finite, as an imported
    checkpoint's, unless `allow_non_finite`) and set cfg.train.lora_* from it; returns its tensors'
    reader. A one-line UserError for anything this module cannot load exactly."""
    path = os.path.join(directory, CONFIG_FILE)
    if not tf.io.gfile.exists(path):
        raise UserError(f"--adapter {directory!r} has no {CONFIG_FILE}; {ADAPTER_FIX}")
    conf = read_json(path, ADAPTER_FIX)

    def refuse(what: str):
        return UserError(f"{path}: {what}; tpu-llm reads plain LoRA adapters (docs/lora.md)")

    if conf.get("peft_type") != "LORA":
        raise refuse(f"peft_type {shown(conf.get('peft_type'))} is not LORA")
    for key, plain in PLAIN.items():
        if conf.get(key, plain) not in (plain, None, [], {}):
            raise refuse(f"{key}={shown(conf[key])} is not supported")
    targets, valid = conf.get("target_modules"), families.of(cfg.model).peft_targets
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t in valid for t in targets):
        raise refuse(f"target_modules {shown(targets)} is not a list of {cfg.model.family} modules "
                     f"({', '.join(valid)})")
    rank, alpha, dropout = conf.get("r"), conf.get("lora_alpha"), conf.get("lora_dropout", 0.0)
    if not (type(rank) is int and type(alpha) in (int, float) and type(dropout) in (int, float)):
        raise refuse(f"r={shown(rank)}, lora_alpha={shown(alpha)}, lora_dropout={shown(dropout)} are not "
                     "numbers (r an integer)")
    if rank < 1:  # 0 is "no adapters" to the config, which then expected none of the adapter's tensors
        raise refuse(f"r={rank} is no LoRA rank (1 or more)")
    if not math.isfinite(alpha):
        raise refuse(f"lora_alpha={shown(alpha)} is not a finite number")
    settings = {"train.lora_rank": rank, "train.lora_alpha": float(alpha), "train.lora_dropout": float(dropout),
                "train.lora_targets": ",".join(targets), "train.freeze": ""}
    try:
        for key, value in settings.items():
            set_dotted(cfg, key, value, source=path)
        validate(cfg)
    except UserError as e:
        raise refuse(str(e).removeprefix("config: ")) from None
    reader = safetensors_io.Reader(directory, WEIGHTS_FILE)
    expected = adapter_shapes(cfg)
    if set(reader.names()) != set(expected):
        odd = sorted(set(reader.names()) ^ set(expected))[0]
        side = "missing from" if odd in expected else "unexpected in"
        raise UserError(f"tensor {odd!r} is {side} {reader.file(odd) if odd in reader.where else WEIGHTS_FILE} "
                        f"for target_modules {', '.join(targets)} on this model; {ADAPTER_FIX}")
    for name, shape in expected.items():
        if reader.shape(name) != shape or reader.dtype(name) not in hf.WEIGHT_DTYPES:
            raise UserError(f"{reader.file(name)}: tensor {name} is {reader.dtype(name)} {list(reader.shape(name))}, "
                            f"this model's adapter of rank {rank} needs {list(shape)} in one of "
                            f"{', '.join(hf.WEIGHT_DTYPES)}; {ADAPTER_FIX}")
    for name in sorted(expected):
        check_finite(reader, name, allow_non_finite, warn)
    return reader


def check_finite(reader: safetensors_io.Reader, name: str, allow_non_finite: bool, warn) -> None:
    """An adapter's tensor holding NaN or infinity is refused, as an imported checkpoint's is (hf.load_weights):
    before, it was imported with exit 0, and every logit of the LoRA run was NaN."""
    value = reader.get(name).astype(np.float32)
    bad = value.size - int(np.count_nonzero(np.isfinite(value)))
    if not bad:
        return
    said = f"{reader.file(name)}: tensor {name} holds {bad:,} non-finite values (NaN or infinity) of its {value.size:,}"
    if not allow_non_finite:
        raise UserError(f"{said}; the adapter is damaged: save or download it again (pass --allow_non_finite to "
                        "import it anyway)")
    warn(f"warning: {said}; imported as they are (--allow_non_finite)")


def adapter_shapes(cfg) -> dict[str, tuple[int, int]]:
    """{PEFT tensor name: shape} of the adapters cfg.train.lora_* put on the model section: lora_A (r, in),
    lora_B (out, r), for every adapted module."""
    lora, shapes = adapters.adapters_for(cfg), spec.block_shapes(cfg.model)
    out = {}
    for module, path in adapter_modules(cfg.model):
        below = path.split("/", 1)[1]  # attn/q of block_0/attn/q
        if below in lora.layers:
            fan_in, fan_out = shapes[f"{below}/kernel"]
            out[f"{PREFIX}{module}.lora_A.weight"] = (lora.rank, fan_in)
            out[f"{PREFIX}{module}.lora_B.weight"] = (fan_out, lora.rank)
    return out


def with_adapter(base, reader: safetensors_io.Reader, cfg):
    """The LoRA model of `cfg` with `base`'s weights and the adapters of `reader` (read_adapter's)."""
    model = GPT.from_config(cfg).build_weights()
    adapters.copy_base(base, model)
    layers = {layer.path.removeprefix(model.name + "/"): layer for layer in adapters.adapted(model)}
    for module, path in adapter_modules(cfg.model):
        if path in layers:
            for letter, variable in (("A", layers[path].lora_a), ("B", layers[path].lora_b)):
                variable.assign(reader.get(f"{PREFIX}{module}.lora_{letter}.weight").astype("float32").T)
    return model


def import_with_adapter(source: str, run_dir: str, adapter: str, **options) -> dict:
    """hf.import_checkpoint of `source` with the PEFT adapter in `adapter` on it, checked (read_adapter)
    with the rest before anything is written."""
    def adapt(cfg):
        reader = read_adapter(str(adapter).rstrip("/"), cfg, options.get("allow_non_finite", False),
                              options.get("warn", print))
        return lambda base: with_adapter(base, reader, cfg)

    return hf.import_checkpoint(source, run_dir, adapt=adapt, **options)
