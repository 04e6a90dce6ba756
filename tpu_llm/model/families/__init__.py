"""The model families (`model.family`), one module each, and the registry: the only place that knows
their names. Everything else asks a family (`get`, `of`) what it needs: the block variant, config
checks, Hugging Face names, PEFT targets (families/base.py's `Family` lists them).

Adding a family: a module beside these holding `FAMILY = SomeFamily(...)`, its line below, its row in
docs/model-families.md. No TensorFlow is imported here: config/checks.py validates a model section with it.
"""

from __future__ import annotations

from tpu_llm.model.families import gpt2, llama, mistral, qwen2, qwen3
from tpu_llm.model.families.base import Block, Family

FAMILIES: dict[str, Family] = {module.FAMILY.name: module.FAMILY for module in (gpt2, llama, qwen2, qwen3, mistral)}
NAMES = tuple(FAMILIES)  # model.family's valid choices, in the order docs list them
DEFAULT = "gpt2"  # a model section from before the families (an older run's config) is gpt2

__all__ = ["Block", "Family", "FAMILIES", "NAMES", "by_architecture", "get", "of"]


def get(name: str) -> Family:
    """The family of that name (config validation has refused any other)."""
    return FAMILIES[name]


def of(m) -> Family:
    """The family of the model section `m` (an older run's section, without model.family, is gpt2's)."""
    return FAMILIES[getattr(m, "family", DEFAULT)]


def by_architecture(architectures: list) -> Family | None:
    """The family of the first of a config.json's `architectures` that one reads, or None."""
    for name in architectures:
        for family in FAMILIES.values():
            if isinstance(name, str) and name in family.architectures:
                return family
    return None


def architectures() -> list[str]:
    """Every Hugging Face architecture some family reads, for messages."""
    return [a for family in FAMILIES.values() for a in family.architectures]
