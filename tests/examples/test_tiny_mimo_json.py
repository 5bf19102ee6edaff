"""examples/tiny_mimo's JSON pieces on the CPU: its records follow their schema, its
tokenizer.json is the model's bytes, and decoding under the schema with constrained and
unconstrained drafts emits the same tokens (speculative decoding stays lossless)."""

from __future__ import annotations

import json

import torch
import xgrammar

from examples.tiny_mimo.json_acceptance import decode
from examples.tiny_mimo.json_data import HELD_OUT_SEED, SCHEMA, document
from examples.tiny_mimo.model import load_checkpoint
from examples.tiny_mimo.tokenizer import byte_tokenizer
from mtpdraft.service.config import ServeConfig
from mtpdraft.service.engine.engine import DraftEngine
from mtpdraft.service.grammar.spec import GrammarSpec
from mtpdraft.service.model.checkpoint import load_mtp_weights
from mtpdraft.service.model.default_model import DEFAULT_CHECKPOINT
from mtpdraft.service.model.mtp_head import MTPHead


def test_records_follow_their_schema():
    vocab = [bytes([i]) for i in range(256)]
    info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, stop_token_ids=[])
    grammar = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    for line in document(HELD_OUT_SEED).splitlines():
        matcher = xgrammar.GrammarMatcher(grammar)
        assert all(matcher.accept_token(b) for b in line) and matcher.is_completed()


def test_the_shipped_tokenizer_is_the_one_the_script_writes():
    shipped = json.loads((DEFAULT_CHECKPOINT / "tokenizer.json").read_text())
    assert shipped == byte_tokenizer()


def test_constrained_and_unconstrained_drafts_decode_the_same_json():
    torch.set_grad_enabled(False)
    try:
        model = load_checkpoint(DEFAULT_CHECKPOINT, torch.float64).eval()
        head = MTPHead(load_mtp_weights(DEFAULT_CHECKPOINT), torch.device("cpu"), torch.float32)
        engine = DraftEngine(head, ServeConfig(kv_blocks=256))
        grammar = engine.grammars.compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
        prompt = list(b"\n".join(document(HELD_OUT_SEED).split(b"\n")[:2]) + b"\n")
        constrained = decode(model, engine, grammar, prompt, 3, True, 40)
        free = decode(model, engine, grammar, prompt, 3, False, 40)
        assert constrained[0] == free[0] and len(constrained[0]) == 40
        assert bytes(constrained[0]).startswith(b"{")
        assert not engine.states
    finally:
        torch.set_grad_enabled(True)
