"""Grammars for the tests: a test checkpoint's tokenizer, matchers independent of the
service's, and the float64 oracle's drafts under a grammar.

The independent matcher is xgrammar's own, over a TokenizerInfo built here from the
vocabulary's bytes (not from the service's tokenizer.json reader), compiled by a
compiler of its own, and moved on only by the tokens a verifier commits; the drafts
it expects are the masked argmax of the float64 oracle (tests/mtp_reference.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import xgrammar

V = 200  # the test checkpoints' vocabulary (tests/drafting.py)
EOS = V - 1  # the test grammar checkpoint's end-of-sequence token: a special token


def byte_chars() -> list[str]:
    """GPT-2's character for each byte (the byte-level BPE format), written out again."""
    kept = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table = {b: chr(b) for b in kept}
    table |= {b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in kept)}
    return [table[b] for b in range(256)]


def write_tokenizer(folder: Path) -> None:
    """tokenizer.json for a V-token model: token i is byte i, the last is <|end|>."""
    vocab = {c: i for i, c in enumerate(byte_chars()[:EOS])}
    level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False}
    spec = {
        "version": "1.0",
        "added_tokens": [{"id": EOS, "content": "<|end|>", "special": True}],
        "pre_tokenizer": {**level, "use_regex": False},
        "decoder": {**level, "use_regex": False},
        "model": {"type": "BPE", "vocab": vocab, "merges": []},
    }
    (folder / "tokenizer.json").write_text(json.dumps(spec))


def compiler(vocab_size: int = V, eos: int | None = EOS) -> xgrammar.GrammarCompiler:
    """A compiler of the tests' own: token i < EOS is byte i."""
    vocab = [bytes([i]) for i in range(vocab_size)]
    stop = []
    if eos is not None:
        vocab[eos], stop = b"<|end|>", [eos]
    info = xgrammar.TokenizerInfo(
        vocab, xgrammar.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop
    )
    return xgrammar.GrammarCompiler(info)


def compile_kind(c: xgrammar.GrammarCompiler, kind: str, source: str):
    return {
        "json_schema": c.compile_json_schema,
        "ebnf": c.compile_grammar,
        "regex": c.compile_regex,
        "structural_tag": c.compile_structural_tag,
    }[kind](source)


def allowed(matcher: xgrammar.GrammarMatcher, vocab_size: int = V) -> torch.Tensor:
    """[V] bool: the tokens the matcher allows next (none once it has ended)."""
    if matcher.is_terminated():
        return torch.zeros(vocab_size, dtype=torch.bool)
    words = xgrammar.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(words)
    bits = (words[0, :, None] >> torch.arange(32)) & 1
    return bits.flatten()[:vocab_size].bool()


def unpacked(words, vocab_size: int = V) -> torch.Tensor:
    """[rows, V] bool: the tokens each row of an int32 bitmask [rows, W] allows."""
    words = torch.as_tensor(words, dtype=torch.int32).reshape(-1, (vocab_size + 31) // 32)
    bits = (words[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten(1)[:, :vocab_size].bool()


def masks_along(matcher: xgrammar.GrammarMatcher, drafts: list[int]) -> torch.Tensor:
    """[len(drafts) + 1, V] bool: what the grammar allows before each draft and after the
    last (the matcher left where it was)."""
    rows = [allowed(matcher)]
    for d in drafts:
        assert matcher.accept_token(d)
        rows.append(allowed(matcher))
    if drafts:
        matcher.rollback(len(drafts))
    return torch.stack(rows)


def oracle_drafts(ref, tokens, hiddens, k, matcher, min_confidence=0.0, extra=None):
    """The float64 oracle's greedy chain after rows (tokens, hiddens) under the grammar
    at `matcher` (left where it was): each draft the argmax of the logits over the tokens
    the grammar allows after the drafts before it (and `extra[j]`, a client mask row);
    the chain ends where the grammar allows nothing, after a stop token, or at
    min_confidence. Returns (drafts, probs, output hiddens of each computed row)."""
    tokens, hiddens = list(tokens), hiddens.double()
    drafts, probs, outs, running = [], [], [], 1.0
    try:
        for j in range(k):
            mask = allowed(matcher)
            if extra is not None:
                mask &= extra[min(j, len(extra) - 1)]
            if not mask.any():
                break
            out = ref.rows(tokens, hiddens)[-1]
            outs.append(out)
            logits = ref.logits(out).masked_fill(~mask, float("-inf"))
            d = int(logits.argmax())
            p = float(logits.softmax(-1)[d])
            running = min(running, p)
            if running < min_confidence:
                break
            drafts.append(d)
            probs.append(p)
            assert matcher.accept_token(d)
            if matcher.is_terminated():
                break
            tokens.append(d)
            hiddens = torch.cat([hiddens, out[None]])
    finally:
        if drafts:
            matcher.rollback(len(drafts))
    return drafts, probs, outs
