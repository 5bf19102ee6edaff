"""The families of published MTP checkpoints served, one module each, and their registry.

A checkpoint belongs to the first family in FAMILIES that recognises it: GLM-4.5 comes
before DeepSeek-V3, whose layout it shares. Adding a family is its module and a line
here (DESIGN.md, "Adding a family").
"""

from __future__ import annotations

from collections.abc import Collection

from ..config import ConfigReader
from ..errors import CheckpointError
from .deepseek_v3 import DeepseekV3
from .family import Family, Layout
from .glm4_moe import Glm4Moe
from .mimo import Mimo
from .qwen3_next import Qwen3Next

FAMILIES: tuple[Family, ...] = (Mimo(), Glm4Moe(), DeepseekV3(), Qwen3Next())

__all__ = ["FAMILIES", "Family", "Layout", "family_named", "family_of"]


def family_of(config: ConfigReader, names: Collection[str]) -> Family:
    """The family of the checkpoint whose config and tensor names these are."""
    for family in FAMILIES:
        if family.recognises(config, names):
            return family
    *others, last = dict.fromkeys(family.marker(config) for family in FAMILIES)
    raise CheckpointError(f"no MTP layer found (looked for {', '.join(others)} and {last})")


def family_named(name: str) -> Family:
    """The family GetInfo reports as `name`."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ValueError(f"unknown family {name!r}")
