"""`make mutants` (scripts/mutants.py) is not run by the suite, which is its budget's job: here only
its list is checked, statically, so that a test renamed or removed is noticed where it happens."""

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "mutants.py"


def load_mutants():
    spec = importlib.util.spec_from_file_location("mutants", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def test_every_test_a_mutation_names_exists():
    mutants = load_mutants()
    assert len(mutants.MUTATIONS) >= 40
    assert mutants.missing_tests(mutants.MUTATIONS) == []
    # and the check notices each kind of name that resolves to nothing
    stale = mutants.M("stale", "tpu_llm/model/transformer.py", "x", "y",
                      "tests/test_model.py::test_no_such_test tests/test_no_such_file.py "
                      "tests/test_model.py::test_logged_gradient_norm_is_the_global_norm_and_clipping_scales_the_update[0.5] -k no_such_word")
    assert mutants.missing_tests([stale]) == [
        "stale: names tests/test_model.py::test_no_such_test, which is not a test in tests/test_model.py",
        "stale: names tests/test_no_such_file.py, which does not exist",
        "stale: -k no_such_word matches no test in tests/test_model.py"]
