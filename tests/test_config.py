"""Config: defaults, YAML and override layering, and the one-line errors for user mistakes."""

import dataclasses
from pathlib import Path

import pytest
import yaml
from helpers import tiny_config

from tpu_llm.config import Config, config_from_dict, load_config, validate
from tpu_llm.config.reading import parse_set_args
from tpu_llm.errors import UserError

REPO = Path(__file__).resolve().parent.parent


def write(path: Path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_defaults_validate():
    validate(Config())
    assert load_config() == Config()
    assert load_config(None, {}) == Config()


def test_tiny_config_helper(tmp_path):
    cfg = tiny_config(tmp_path, train__steps=2, **{"model.n_layer": 1})
    assert (cfg.model.n_layer, cfg.model.n_embd, cfg.data.seq_len, cfg.train.steps) == (1, 32, 16, 2)
    assert cfg.run_dir == str(tmp_path / "run")
    assert cfg.data.train == str(tmp_path / "corpus" / "*.txt") and len(list((tmp_path / "corpus").glob("*.txt"))) == 3


def test_yaml_then_overrides_later_layers_win(tmp_path):
    path = write(tmp_path / "c.yaml", "run_dir: runs/x\nmodel:\n  n_layer: 3\n  n_embd: 96\n"
                                      "train:\n  lr: 1\n  steps: 50\ndata:\n  seq_len: 64\n")
    cfg = load_config(path, {"model.n_layer": 5, "train.steps": 7, "data.train": ("a.txt", "b.txt")})
    assert cfg.model.n_layer == 5 and cfg.train.steps == 7  # command line beats YAML
    assert cfg.model.n_embd == 96 and cfg.data.seq_len == 64 and cfg.run_dir == "runs/x"  # YAML beats defaults
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)  # int accepted for a float
    assert cfg.model.n_head == Config().model.n_head  # untouched key keeps its default
    assert cfg.data.train == "a.txt,b.txt"  # a sequence of files (as a YAML list gives) joins with commas


def test_float_in_exponent_notation_without_dot(tmp_path):
    # YAML 1.1 (PyYAML) reads `3e-4` as a string; it must still be accepted for a float key.
    path = write(tmp_path / "c.yaml", "train:\n  lr: 3e-3\n  min_lr: 3e-4\n")
    cfg = load_config(path, parse_set_args(["train.weight_decay=1e-2"]))
    assert (cfg.train.lr, cfg.train.min_lr, cfg.train.weight_decay) == (3e-3, 3e-4, 1e-2)


def test_to_yaml_round_trip():
    cfg = load_config(None, {"model.n_layer": 2, "data.train": "x/*.txt", "sample.prompt": "def f():\n\t"})
    assert config_from_dict(yaml.safe_load(cfg.to_yaml()), source="saved") == cfg


@pytest.mark.parametrize("key, named, close", [("model.n_layr", "model.n_layr", "model.n_layer"),
                                               ("trian.steps", "trian", "train"),
                                               ("data.seq_length", "data.seq_length", "data.seq_len")])
def test_unknown_key_names_it_and_suggests(key, named, close):
    with pytest.raises(UserError) as e:
        load_config(None, {key: 3})
    message = str(e.value)
    assert f"unknown config key '{named}'; did you mean '{close}'?" in message
    assert "\n" not in message


def test_unknown_key_in_yaml_names_the_file(tmp_path):
    path = write(tmp_path / "c.yaml", "model:\n  n_heads: 2\n")
    with pytest.raises(UserError, match=r"c\.yaml: unknown config key 'model\.n_heads'; did you mean 'model\.n_head'"):
        load_config(path)


def test_unknown_key_without_close_match_lists_valid_keys():
    with pytest.raises(UserError) as e:
        load_config(None, {"model.zzzz": 1})
    assert "did you mean" not in str(e.value)
    assert "valid keys in model: n_layer, n_head" in str(e.value)


@pytest.mark.parametrize("key, value, type_name", [("model.n_layer", "four", "int"), ("model.n_layer", True, "int"),
                                                   ("train.lr", "fast", "float"), ("model.bias", "maybe", "bool"),
                                                   ("data.train", None, "str")])
def test_wrong_type_names_key_and_type(key, value, type_name):
    with pytest.raises(UserError) as e:
        load_config(None, {key: value})
    assert f"'{key}' must be {type_name}, got {value!r}" in str(e.value)


def test_wrong_type_in_yaml(tmp_path):
    path = write(tmp_path / "c.yaml", "model:\n  n_layer: four\n")
    with pytest.raises(UserError, match=r"c\.yaml: 'model\.n_layer' must be int, got 'four' \(str\)"):
        load_config(path)


def test_section_given_a_value():
    with pytest.raises(UserError, match=r"'model' is a section"):
        load_config(None, {"model": 3})


def test_bool_strings_accepted():
    assert load_config(None, {"model.bias": "False"}).model.bias is False


def test_n_embd_not_divisible_by_n_head():
    with pytest.raises(UserError) as e:
        load_config(None, {"model.n_embd": 30, "model.n_head": 4})
    assert str(e.value) == ("config: model.n_embd=30 is not divisible by model.n_head=4; "
                            "valid n_head values: 1, 2, 3, 5, 6, 10, 15, 30 (or give model.head_dim)")


def test_seq_len_exceeds_max_len():
    with pytest.raises(UserError) as e:
        load_config(None, {"data.seq_len": 64, "model.max_len": 32})
    assert str(e.value) == ("config: data.seq_len=64 exceeds model.max_len=32; "
                            "lower data.seq_len or raise model.max_len")


@pytest.mark.parametrize("overrides, culprit", [
    ({"train.batch_size": 6, "train.grad_accum": 4}, "train.grad_accum=4"),
    ({"data.tokenizer": "bpe"}, "valid choices: byte, char, sentencepiece"),
    ({"data.tokenizer": "sentencepiece"}, "data.tokenizer_model"),
    ({"model.dropout": 1.0}, "model.dropout=1.0"),
    ({"strategy": "horovod"}, "valid choices: auto, tpu, mirrored, multi_worker, parameter_server, default"),
    ({"strategy": "multi_worker", "cpu_devices": 2}, "strategy=multi_worker runs one device per process"),
    ({"cluster.communication": "mpi"}, "valid choices: auto, ring, nccl"),
])
def test_inconsistent_values_rejected(overrides, culprit):
    with pytest.raises(UserError, match="^config: ") as e:
        load_config(None, overrides)
    assert culprit in str(e.value)


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path / "broken.yaml", "model:\n  n_layer: 2\n  n_head: [2, 4\ntrain:\n  steps: 3\n")
    with pytest.raises(UserError) as e:
        load_config(path)
    message = str(e.value)
    assert message.startswith(f"{path}: YAML syntax error at line ")
    line = int(message.split(" at line ")[1].split(",")[0])
    assert 3 <= line <= 4  # the unclosed list starts on line 3; PyYAML reports where it gave up
    assert "\n" not in message


def test_yaml_not_a_mapping(tmp_path):
    path = write(tmp_path / "list.yaml", "- a\n- b\n")
    with pytest.raises(UserError, match="expected a mapping of config sections, got list"):
        load_config(path)


def test_empty_yaml_is_defaults(tmp_path):
    assert load_config(write(tmp_path / "empty.yaml", "# nothing\n")) == Config(run_dir="runs/empty")  # (its name)


def test_missing_config_file(tmp_path):
    path = str(tmp_path / "nope.yaml")
    with pytest.raises(UserError, match=f"config file '{path}' not found"):
        load_config(path)


def test_parse_set_args():
    assert parse_set_args(None) == {} and parse_set_args([]) == {}
    assert parse_set_args(["model.n_layer=6", "train.lr=0.5", "model.bias=false", "data.train=a/*.txt",
                           "sample.prompt=", "sample.prompt2=a=b"]) == {
        "model.n_layer": 6, "train.lr": 0.5, "model.bias": False, "data.train": "a/*.txt",
        "sample.prompt": "", "sample.prompt2": "a=b"}
    assert parse_set_args("train.steps=10") == {"train.steps": 10}
    with pytest.raises(UserError, match="expected KEY=VALUE"):
        parse_set_args(["model.n_layer"])


def test_set_values_that_are_not_yaml_scalars_stay_strings():
    # A code prompt is YAML for a mapping; an unclosed bracket is a YAML error. Both are plain text here.
    got = parse_set_args(["sample.prompt=def main():", "data.train=[x", "sample.prompt2=# note"])
    assert got == {"sample.prompt": "def main():", "data.train": "[x", "sample.prompt2": "# note"}
    cfg = load_config(None, parse_set_args(["sample.prompt=def main():", "train.steps=9"]))
    assert cfg.sample.prompt == "def main():" and cfg.train.steps == 9


CONFIG_FILES = sorted((REPO / "configs").glob("*.yaml"))


def test_configs_dir_is_not_empty():
    assert CONFIG_FILES, f"no YAML files in {REPO / 'configs'}"


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(str(path))
    validate(cfg)
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    for section, values in raw.items():  # every key in the file took effect
        if isinstance(values, dict):
            for key, value in values.items():
                got = getattr(getattr(cfg, section), key)
                assert got == value, f"{path.name}: {section}.{key}={got!r}, file says {value!r}"
    assert dataclasses.asdict(cfg) == config_from_dict(raw, str(path)).to_dict()


def test_a_config_file_names_its_run_directory(tmp_path):
    """A config file that sets no run_dir trains in runs/<its name>, not in the default run's runs/tiny
    (issue 30: examples with a config of their own collided with `make train`'s run)."""
    mine = tmp_path / "my_run.yaml"
    mine.write_text("model: {n_layer: 2}\n")
    assert load_config(str(mine)).run_dir == "runs/my_run"
    assert load_config(str(mine), {"run_dir": "runs/elsewhere"}).run_dir == "runs/elsewhere"  # the command line wins
    (tmp_path / "own.yml").write_text("run_dir: gs://b/r\n")
    assert load_config(str(tmp_path / "own.yml")).run_dir == "gs://b/r"  # its own
    assert load_config(None).run_dir == "runs/tiny" and load_config("tiny").run_dir == "runs/tiny"


def test_generate_and_the_config_bound_sampling_alike():
    """One definition of the sampling bounds (config.CAPS): what `tpu-llm generate` accepts before TensorFlow
    loads, the config of its samples accepts too, and one past a bound is refused by both, the flag's
    message naming the flag."""
    from tpu_llm.cli.generate_flags import check_sampling
    from tpu_llm.config import CAPS

    most = {key: CAPS[f"sample.{key}"][0] for key in ("max_new_tokens", "num_samples", "top_k", "seed")}
    check_sampling(most["max_new_tokens"], 0.8, most["top_k"], 1.0, most["seed"], most["num_samples"])
    load_config(None, {f"sample.{key}": value for key, value in most.items()})
    for key in most:
        past = {**most, key: most[key] + 1}
        with pytest.raises(UserError, match=rf"^--{key}={past[key]} must "):
            check_sampling(past["max_new_tokens"], 0.8, past["top_k"], 1.0, past["seed"], past["num_samples"])
        with pytest.raises(UserError, match=rf"^config: sample.{key}={past[key]} is more than its cap"):
            load_config(None, {f"sample.{key}": past[key]})
    lowest = -2**63
    check_sampling(1, 0.8, 0, 1.0, lowest, 1)
    load_config(None, {"sample.seed": lowest})
    with pytest.raises(UserError, match=rf"^--seed={lowest - 1} must fit in 64 bits"):
        check_sampling(1, 0.8, 0, 1.0, lowest - 1, 1)
    with pytest.raises(UserError, match=rf"^config: sample.seed={lowest - 1} must be >= -2\*\*63"):
        load_config(None, {"sample.seed": lowest - 1})


@pytest.mark.parametrize("overrides, culprit", [
    ({"sample.num_beams": 0}, "sample.num_beams=0 must be between 1 (off) and 64"),
    ({"sample.num_beams": 65, "sample.temperature": 0}, "sample.num_beams=65 must be between 1"),
    ({"sample.num_beams": 4}, "sample.num_beams=4 searches greedily: set sample.temperature=0 (not 0.8"),
    ({"sample.num_beams": 4, "sample.temperature": 0}, "sample.num_samples=2 with sample.num_beams=4"),
    ({"sample.num_return_sequences": 2}, "sample.num_return_sequences=2 must be between 1 and sample.num_beams=1"),
    ({"sample.early_stopping": "sometimes"}, "sample.early_stopping='sometimes'; valid choices: false, true, never"),
])
def test_beam_search_settings_are_checked(overrides, culprit):
    with pytest.raises(UserError, match="^config: ") as e:
        load_config(None, overrides)
    assert culprit in str(e.value)


def test_early_stopping_takes_yaml_booleans_and_never(tmp_path):
    (tmp_path / "c.yaml").write_text("sample: {num_beams: 4, temperature: 0, num_samples: 1, early_stopping: true}\n")
    assert load_config(str(tmp_path / "c.yaml")).sample.early_stopping == "true"
    assert load_config(None, parse_set_args(["sample.early_stopping=false"])).sample.early_stopping == "false"
    assert load_config(None, {"sample.early_stopping": "never"}).sample.early_stopping == "never"


@pytest.mark.parametrize("value", [1e39, -1e39, 4.5])
def test_a_length_penalty_whose_power_overflows_float32_is_refused(value):
    """Issue 50 #6: --length_penalty 1e39 (finite, so accepted) overflowed float32 (length ** it) in the beam
    search; it is bounded, in the config (a run's samples, the Python API) and by `generate`'s flags."""
    from tpu_llm.cli.generate_flags import check_beams

    with pytest.raises(UserError, match="sample.length_penalty=.* must be between -4 and 4"):
        load_config(None, {"sample.length_penalty": value})
    with pytest.raises(UserError, match="--length_penalty=.* must be between -4 and 4"):
        check_beams(2, value, "false", 1, 0.0, 1)
    with pytest.raises(UserError, match="--length_penalty=nan must be between -4 and 4"):
        check_beams(2, float("nan"), "false", 1, 0.0, 1)
    check_beams(2, -4.0, "false", 1, 0.0, 1)
    load_config(None, {"sample.length_penalty": 4.0})
