"""A grammar test checkpoint (its byte tokenizer, a stop token), its head, the float64
oracle and the tests' own xgrammar compiler."""

from __future__ import annotations

import pytest
import torch
from grammars import EOS, compiler, write_tokenizer
from mtp_reference import Reference

from mtpdraft.service.model.checkpoint import load_mtp_weights
from mtpdraft.service.model.mtp_head import MTPHead
from mtpdraft.service.model.synthetic import write_random_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = write_random_checkpoint(
        tmp_path_factory.mktemp("ckpt"), "mimo", seed=5, extra_config={"eos_token_id": EOS}
    )
    write_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def head(checkpoint) -> MTPHead:
    return MTPHead(load_mtp_weights(checkpoint), torch.device("cpu"))


@pytest.fixture(scope="module")
def ref(checkpoint) -> Reference:
    return Reference(checkpoint)


@pytest.fixture(scope="module")
def own_compiler():
    return compiler()
