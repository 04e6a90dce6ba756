"""pyproject.toml: one TensorFlow wheel per environment, chosen by extra, and an exactly pinned libtpu.

`tensorflow` and `tensorflow-tpu` both install the `tensorflow/` package, so an environment that gets
both has whichever was installed last; libtpu's newest releases abort `import tensorflow` 2.20."""

from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tpu_llm import cli

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

PROJECT = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
# Distributions that install the CPU/GPU `tensorflow/` files, or require the wheel that does
CPU_TENSORFLOW = {"tensorflow", "tensorflow-cpu", "tensorflow-text", "tensorflow-intel", "tf-nightly"}
# tensorflow-tpu 2.20.0's own metadata: `Requires-Dist: libtpu~=0.0.14`
TPU_LIBTPU = SpecifierSet("~=0.0.14")


def names(requirements) -> dict[str, Requirement]:
    """Requirements by normalised name, self-references (tpu-llm[x]) expanded."""
    out = {}
    for text in requirements:
        req = Requirement(text)
        name = req.name.lower().replace("_", "-")
        if name == PROJECT["name"]:
            for extra in req.extras:
                out.update(names(PROJECT["optional-dependencies"][extra]))
        else:
            out[name] = req
    return out


def environment(*extras) -> dict[str, Requirement]:
    return names(PROJECT["dependencies"] + [r for e in extras for r in PROJECT["optional-dependencies"][e]])


def test_the_base_install_has_no_tensorflow():
    base = environment()
    assert not (set(base) & (CPU_TENSORFLOW | {"tensorflow-tpu", "libtpu"})), sorted(base)


@pytest.mark.parametrize("extra", sorted(PROJECT["optional-dependencies"]))
def test_no_extra_brings_both_tensorflow_wheels(extra):
    got = set(environment(extra))
    assert not ({"tensorflow-tpu", "libtpu"} & got and CPU_TENSORFLOW & got), (extra, sorted(got))


def test_tpu_extra_pins_tensorflow_tpu_and_the_libtpu_it_declares():
    tpu = environment("tpu")
    assert str(tpu["tensorflow-tpu"].specifier) == "==2.20.0"
    [pin] = list(tpu["libtpu"].specifier)
    assert pin.operator == "==" and Version(pin.version) in TPU_LIBTPU, tpu["libtpu"]
    assert "cloud-tpu-client" not in tpu  # pip resolves it to 0.7 (2020), which shadows TF's own resolver client
    assert {"google-api-python-client", "oauth2client"} <= set(tpu)  # what TF's own client needs for TPU names


def test_the_other_extras_install_tensorflow_2_20():
    for extra in ("cpu", "gpu"):
        assert str(environment(extra)["tensorflow"].specifier) == "==2.20.*", extra
    assert "tensorflow-text" in environment("sentencepiece") and "tensorflow-text" not in environment("tpu")


def test_without_tensorflow_the_cli_names_the_extras(monkeypatch, capsys):
    monkeypatch.setattr(cli, "tensorflow_installed", lambda: False)
    assert cli.main(["info"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: TensorFlow is not installed: pip install 'tpu-llm[cpu]' (CPU), 'tpu-llm[gpu]' (NVIDIA GPUs) or "
        "'tpu-llm[tpu]' (a Cloud TPU VM), one of them per environment")


def test_hf_extra_and_the_reference_test_extra():
    from packaging.markers import default_environment

    hf = environment("hf")
    assert {"safetensors", "tokenizers"} <= set(hf) and "tensorflow" not in hf  # fine beside tensorflow-tpu
    assert not (set(environment("hf", "tpu")) & CPU_TENSORFLOW)
    ref = environment("reference")
    assert str(ref["torch"].specifier) == "==2.13.0"  # the CPU wheel; unpinned can pull a CUDA build
    assert ref["transformers"].specifier == SpecifierSet(">=5,<6")
    for name in ("torch", "transformers"):  # transformers 5 needs Python 3.11: skipped on 3.10, not failing
        marker = ref[name].marker
        assert marker is not None
        assert not marker.evaluate({**default_environment(), "python_version": "3.10"})
        assert marker.evaluate({**default_environment(), "python_version": "3.11"})
    # the tokenizers range accepts what the pinned transformers needs (5.x: tokenizers>=0.22,<0.24)
    assert Version("0.23.3") in hf["tokenizers"].specifier


def test_make_train_installs_what_training_needs_and_make_test_adds_the_test_extras():
    makefile = (Path(__file__).resolve().parent.parent / "Makefile").read_text()
    installs = [line for line in makefile.splitlines() if "pip install --quiet -e" in line]
    train, test = [set(line.split("[", 1)[1].split("]", 1)[0].split(",")) for line in installs]
    assert train == {"cpu", "sentencepiece", "hf"}  # no torch or transformers for `make train` (issue 30)
    assert test == train | {"dev", "reference", "eval"}  # eval: lm-eval, for tests/test_eval.py (issue 49)
    assert "\ntrain: $(STAMP)" in makefile and "\ntest: $(DEV_STAMP)" in makefile


def test_eval_extra_is_lm_eval_0_4_without_tensorflow_or_torch():
    ev = environment("eval")
    # 0.4.9 fails to import beside transformers 5; 0.4.13's hf backend is what tests/test_eval.py matches
    assert ev["lm-eval"].specifier == SpecifierSet(">=0.4.13,<0.5")
    assert not {"tensorflow", "tensorflow-tpu", "torch"} & set(PROJECT["optional-dependencies"]["eval"])


def test_keras_is_bounded_to_the_verified_minors_and_installed_within_them():
    from importlib.metadata import version

    keras = environment()["keras"]
    assert any(spec.operator == "<" for spec in keras.specifier), keras  # ReducedGradientsAdamW overrides privates
    assert Version(version("keras")) in keras.specifier, (version("keras"), str(keras.specifier))
