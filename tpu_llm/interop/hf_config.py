"""config.json <-> the model section: what `tpu-llm import` reads and `export --format hf` writes.

Each family translates its own fields (model/families/: `from_hf`, `to_hf`); this module reads the
file and hands the family a `ConfigJson`, which gives every field it asks for checked: of its type, and
a size at most the cap of the config key it becomes (tpu_llm/config.py CAPS), so a value from outside
never reaches a loop or an allocation unchecked. config.json comes from a download: at most
MAX_CONFIG_JSON bytes, a JSON object, and one UserError line for anything else.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import reprlib

import tensorflow as tf

from tpu_llm.config import CAPS, Config, ModelConfig, config_from_dict
from tpu_llm.errors import UserError
from tpu_llm.interop import safetensors_io
from tpu_llm.model import families

MAX_CONFIG_JSON = 10 << 20  # bytes of config.json: a real one is a few KB
FIX = "give the config.json that came with the weights"
# Gemma: what Llama's layout here lacks, for the one line that refuses it
_GEMMA = "(1 + weight) RMSNorm, embeddings scaled by sqrt(hidden_size), a GeGLU MLP{}"
REFUSED = {"GemmaForCausalLM": _GEMMA.format(""),
           "Gemma2ForCausalLM": _GEMMA.format(", post-attention and post-MLP norms, logit soft-capping and "
                                              "sliding-window layers"),
           "Gemma3ForCausalLM": _GEMMA.format(", post-attention and post-MLP norms, q/k norms and sliding-window "
                                              "layers with their own rotary base"),
           "Gemma3ForConditionalGeneration": "a vision tower besides Gemma 3's decoder"}


def shown(value) -> str:
    """`value` as config.json writes it, for a message: cut short however long or deep it is."""
    try:
        text = json.dumps(value)
    except (RecursionError, ValueError, TypeError):
        text = reprlib.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def unsupported(field: str, value, supported: str) -> UserError:
    return UserError(f"config.json: {field}={shown(value)} is not supported by tpu-llm ({supported})")


def read_config(source: str) -> dict:
    """config.json of the Hugging Face model directory `source`, a JSON object of at most
    MAX_CONFIG_JSON bytes, or a one-line UserError."""
    path = os.path.join(source, "config.json")
    if not tf.io.gfile.exists(path):
        raise UserError(f"--from {source!r} has no config.json; give a Hugging Face model directory (e.g. "
                        "`huggingface-cli download gpt2 --local-dir gpt2`)")
    return read_json(path)


def read_json(path: str, fix: str = FIX) -> dict:
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


class ConfigJson:
    """The fields of a config.json object (or of an object nested in it), each read checked: what a
    family's `from_hf` asks for."""

    def __init__(self, data: dict):
        self.data = data

    def __bool__(self) -> bool:
        return bool(self.data)

    def get(self, field: str, default=None):
        """The raw value, unchecked (for a test of presence or a comparison that cannot raise)."""
        return self.data.get(field, default)

    def int(self, field: str, cap_key: str | None = None, default=_REQUIRED, low: int = 1) -> int:
        """The integer given `field`, at least `low` and at most the cap of the config key `cap_key`."""
        if field not in self.data and default is _REQUIRED:
            raise UserError(f"config.json has no {field}; {FIX}")
        value = self.data.get(field, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise UserError(f"config.json: {field}={shown(value)} is not an integer >= {low}; {FIX}")
        if cap_key and value > CAPS[cap_key][0]:
            cap, why = CAPS[cap_key]
            raise UserError(f"config.json: {field}={value} is more than tpu-llm's cap of {cap:,} ({why})")
        return value

    def float(self, field: str, default: float | None) -> float:
        value = self.data.get(field, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise UserError(f"config.json: {field}={shown(value)} is not a finite number; {FIX}")
        return float(value)

    def bool(self, field: str, default: bool) -> bool:
        value = self.data.get(field, default)
        if not isinstance(value, bool):
            raise UserError(f"config.json: {field}={shown(value)} is not true or false; {FIX}")
        return value

    def object(self, field: str) -> "ConfigJson":
        """The object nested at `field` ({} when missing or null)."""
        value = self.data.get(field) or {}
        if not isinstance(value, dict):
            raise UserError(f"config.json: {field}={shown(value)} is not an object; {FIX}")
        return ConfigJson(value)

    def expect(self, field: str, allowed: tuple, default, supported: str) -> None:
        """A UserError naming `supported` unless `field` (or `default`, missing) is one of `allowed`."""
        value = self.data.get(field, default)
        if value not in allowed:  # == on any JSON value: never raises
            raise unsupported(field, value, supported)

    @staticmethod
    def unsupported(field: str, value, supported: str) -> UserError:
        return unsupported(field, value, supported)


def model_config(hf: dict) -> dict:
    """The `model` section for a Hugging Face config.json; UserError naming the first field we cannot honour."""
    archs = hf.get("architectures") or []
    names = archs if isinstance(archs, list) else []
    family = families.by_architecture(names)
    refused = next((a for a in names if isinstance(a, str) and a in REFUSED), None)
    readable = ", ".join(families.architectures())
    if family is None and refused:
        raise UserError(f"config.json: architectures={shown(archs)} is not supported by tpu-llm: {refused} needs "
                        f"{REFUSED[refused]}, which tpu-llm does not have (supported: {readable})")
    if family is None:
        raise unsupported("architectures", archs, "supported: " + readable)
    return _known_keys(family.from_hf(ConfigJson(hf)))


def _known_keys(model: dict) -> dict:
    """`model`, every key of which ModelConfig has (a family's from_hf names no other)."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = [k for k in model if k not in fields]
    if unknown:
        raise UserError(f"config.json: this tpu-llm has no model.{unknown[0]} (model.{unknown[0]}="
                        f"{model[unknown[0]]!r} needed)")
    return model


def hf_config(m, bos_id: int, eos_id: int, dtype: str) -> dict:
    """config.json for the model section `m` (a ModelConfig)."""
    return families.of(m).to_hf(m, bos_id, eos_id, dtype)


def run_config(hf: dict, source: str, run_dir: str, max_len: int = 0) -> Config:
    """The config of the new run `run_dir` for the config.json `hf` (of the model directory `source`):
    the mapped model section, fine-tuning defaults for the rest, validated (tpu_llm/config.py: types
    and caps)."""
    model = model_config(hf)
    family = families.get(model["family"])
    if max_len and max_len != model["max_len"]:
        if family.block.positions == "learned" or not 0 < max_len < model["max_len"]:
            rotary = [f.name for f in families.FAMILIES.values() if f.block.rotary]
            learned = [f.name for f in families.FAMILIES.values() if not f.block.rotary]
            raise UserError(f"--max_len={max_len}: give a context shorter than config.json's {model['max_len']}, for a "
                            f"{', '.join(rotary[:-1])} or {rotary[-1]} model (a {' or '.join(learned)} model's learned "
                            "position table fixes its own)")
        model["max_len"] = max_len
    family.check_context(ConfigJson(hf), model["max_len"])
    settings = {"run_dir": run_dir, "model": model,
                "data": {"tokenizer": "hf", "seq_len": min(256, model["max_len"])},
                # fine-tuning: a tenth of the from-scratch rate, short warmup, no dropout surprises
                "train": {"lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 20, "steps": 200, "weight_decay": 0.0},
                "checkpoint": {"every_steps": 100}}
    return config_from_dict(settings, source=os.path.join(source, "config.json"))
