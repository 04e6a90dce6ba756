"""Run configuration: one schema, every default defined once.

A run is configured by the dataclasses of config/schema.py, then a YAML file (`configs/*.yaml`), then
command-line overrides in dotted form (`--model.n_layer=6`, or `--set model.n_layer=6`), later layers
winning. Unknown keys, wrong types and inconsistent values are rejected with a one-line `UserError` naming
the key and the valid choices (config/checks.py). `docs`-style help for every field is its comment in
the schema.

A config may come from elsewhere (a copied run's config.yaml, a Hugging Face config.json mapped by
tpu_llm/interop/hf_config.py), so reading it is bounded: a YAML file of at most MAX_CONFIG_BYTES (reading
the file, the `--set` arguments and a mapping onto the dataclasses: config/reading.py), sizes and counts
under CAPS and a model of at most MAX_PARAMS parameters (checked first), messages that echo a value cut
short, and no message built unless its check fails.
"""

from __future__ import annotations

import copy
import os
import re
from typing import Any

from tpu_llm.config.checks import approx_params, comm_refusal, profile_range, validate
from tpu_llm.config.reading import apply_mapping, config_file, read_yaml, set_dotted
from tpu_llm.config.schema import (ATTENTIONS, BAD_STEP_ACTIONS, CAPS, COMMUNICATIONS, COMPRESSIONS, DATA_FORMATS,
                                   EARLY_STOPPING, EXECUTIONS, INT64, MAX_BEAMS, MAX_LENGTH_PENALTY, MAX_NEW_TOKENS,
                                   MAX_PARAMS, MAX_SAMPLES, OUTER_OPTIMIZERS, PRECISIONS, SCHEDULES, STRATEGIES, TOKENIZERS,
                                   CheckpointConfig, ClusterConfig, CommConfig, Config, DataConfig, ModelConfig,
                                   ParallelConfig, SampleConfig, TrainConfig)
from tpu_llm.model import families

__all__ = ["ATTENTIONS", "BAD_STEP_ACTIONS", "CAPS", "COMMUNICATIONS", "COMPRESSIONS", "DATA_FORMATS",
           "EARLY_STOPPING", "EXECUTIONS", "INT64", "MAX_BEAMS", "MAX_LENGTH_PENALTY", "MAX_NEW_TOKENS", "MAX_PARAMS",
           "MAX_SAMPLES", "OUTER_OPTIMIZERS", "PRECISIONS", "SCHEDULES", "STRATEGIES", "TOKENIZERS",
           "CheckpointConfig", "ClusterConfig", "CommConfig", "Config", "DataConfig", "ModelConfig", "ParallelConfig",
           "SampleConfig", "TrainConfig", "approx_params", "comm_refusal", "config_from_dict", "load_config",
           "profile_range", "validate"]


def load_config(path: str | None = None, overrides: dict[str, Any] | None = None, base: Config | None = None) -> Config:
    """Defaults (or a copy of `base`) <- YAML file at `path` (or a preset's name) <- dotted `overrides`, the
    model family's own defaults for the model keys neither gave (a new config only); validated."""
    cfg = copy.deepcopy(base) if base is not None else Config()
    given = set()
    if path:
        path = config_file(path)
        data = read_yaml(path)
        if base is None and isinstance(data, dict) and "run_dir" not in data:
            # a config names its run: my_run.yaml trains in runs/my_run, not in the default run's runs/tiny
            cfg.run_dir = f"runs/{re.sub(r'[.]ya?ml$', '', os.path.basename(path))}"
        apply_mapping(cfg, data, source=path)
        given |= _model_keys(data)
    for key, value in (overrides or {}).items():
        set_dotted(cfg, key, value, source="command line")
        if str(key).startswith("model."):
            given.add(str(key).removeprefix("model."))
    if base is None:
        _family_defaults(cfg, given)
    validate(cfg)
    return cfg


def config_from_dict(data: dict, source: str) -> Config:
    cfg = Config()
    apply_mapping(cfg, data, source=source)
    _family_defaults(cfg, _model_keys(data))
    validate(cfg)
    return cfg


def _model_keys(data) -> set:
    """The model section's keys a YAML mapping gives."""
    model = data.get("model") if isinstance(data, dict) else None
    return set(model) if isinstance(model, dict) else set()


def _family_defaults(cfg: Config, given: set) -> None:
    """The model family's values where the schema's defaults (gpt2's) do not fit it (model/families/:
    llama, mistral and qwen3 have no biases), for the model keys in neither the file nor the flags."""
    family = families.FAMILIES.get(cfg.model.family)  # (an unknown one: refused by validate)
    for key, value in (family.defaults.items() if family else ()):
        if key not in given:
            setattr(cfg.model, key, value)
