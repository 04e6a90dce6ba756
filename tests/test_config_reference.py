"""The configuration reference (docs/configuration.md) is exactly what the config dataclasses generate."""

from pathlib import Path

from tpu_llm.config import Config
from tpu_llm.tools import config_reference

PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def test_docs_block_equals_the_generated_reference():
    assert config_reference.PAGE == PAGE  # where --write writes by default
    text = PAGE.read_text(encoding="utf-8")
    start, end = text.index(config_reference.BEGIN), text.index(config_reference.END)
    block = text[start:end + len(config_reference.END)] + "\n"
    assert block == config_reference.reference(), (
        "docs/configuration.md's configuration reference is stale; run `.venv/bin/python -m tpu_llm.tools.config_reference --write`")


def test_every_key_is_documented():
    reference = config_reference.reference()
    cfg = Config()
    for section, value in vars(cfg).items():
        keys = [f"{section}.{k}" for k in vars(value)] if hasattr(value, "__dataclass_fields__") else [section]
        for key in keys:
            row = next(line for line in reference.splitlines() if line.startswith(f"| `{key}` |"))
            assert not row.endswith("|  |"), f"{key} has no comment in tpu_llm/config/schema.py"


def test_write_replaces_only_the_block(tmp_path):
    path = tmp_path / "configuration.md"
    path.write_text(f"intro\n\n{config_reference.BEGIN}\nold\n{config_reference.END}\n\nafter\n")
    assert config_reference.main(["--write", str(path)]) == 0
    assert path.read_text() == f"intro\n\n{config_reference.reference()}\nafter\n"
    assert config_reference.main(["--write", str(path)]) == 0  # idempotent
    assert path.read_text() == f"intro\n\n{config_reference.reference()}\nafter\n"
