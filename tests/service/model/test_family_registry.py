"""The registry of families: every module of service/model/families/ is in it, DESIGN.md
lists it as it is, and each family recognises its own checkpoints (and only those)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from mtpdraft.service.model import families
from mtpdraft.service.model.checkpoint import load_mtp_weights
from mtpdraft.service.model.families import FAMILIES, family_named
from mtpdraft.service.model.mtp_head import MTPHead
from mtpdraft.service.model.synthetic import write_random_checkpoint

DESIGN = Path(__file__).parents[3] / "DESIGN.md"
PACKAGE = Path(families.__file__).parent


def _module(family) -> str:
    return type(family).__module__.rsplit(".", 1)[-1]


def _section(text: str, title: str) -> str:
    start = text.index(f"\n### {title}\n")
    return text[start : text.index("\n#", start + 1)]


def test_design_lists_the_families_of_the_registry_in_its_order() -> None:
    """Each bullet of "MTP families" names a family and its module, as FAMILIES has them."""
    section = _section(DESIGN.read_text(), "MTP families")
    listed = re.findall(r'^- \*\*.*?\*\* \(family `"(\w+)"`, `families/(\w+)\.py`', section, re.M)
    assert listed == [(f.name, _module(f)) for f in FAMILIES]


def test_every_family_module_is_registered_once() -> None:
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__", "family"}
    assert sorted(_module(f) for f in FAMILIES) == sorted(modules)
    assert len({f.name for f in FAMILIES}) == len(FAMILIES)


@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_a_small_checkpoint_of_each_family_is_recognised_as_its_own(tmp_path, name: str) -> None:
    """write_random_checkpoint writes what the family's loader reads, found as that family
    (not as one tried before it) and run by the head."""
    weights = load_mtp_weights(write_random_checkpoint(tmp_path, name))
    family = family_named(name)
    assert weights.family == name
    assert weights.embed_first == family.embed_first
    assert weights.mask_first_embedding == family.mask_first_embedding
    assert weights.pass_normed_hidden == family.pass_normed_hidden
    head = MTPHead(weights, torch.device("cpu"), ops="torch")
    assert torch.isfinite(head.logits(torch.randn(2, weights.config.hidden_size))).all()


def test_an_unknown_family_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown family 'gpt2'"):
        family_named("gpt2")
