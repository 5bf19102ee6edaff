"""Writes tests/conformance/vector.json: the conformance vector every client replays.

    python3 tests/conformance/make_vector.py [--check] [--seed N] [--draws N]

Inputs (tokens, fp32 hiddens, bitmasks, min_confidences) come from a seeded
generator. Expected outputs come from three sources, none of them the service's
numbers:

- structure (row counts, next positions, chunk counts, error codes, reasons and
  fields, a batch's failed rows): the contract's, written in scenario() below;
- drafts, probabilities and confidences (a Propose's proposal, a batch's
  columns): the float64 oracle (oracle.py over
  tests/mtp_reference.py, which reads the safetensors itself), on the rows the
  contract says each state holds, bitmask rows and min_confidence applied;
- GetInfo: the static configuration of the server the vector is for.

A bfloat16 server cannot reproduce float64 numbers, so the vector carries a
tolerance for probabilities and a tie rule for tokens, both derived here:

Error model. A valid implementation computes what the oracle computes, except
that every value it keeps in its compute dtype (each op's output, the cached K/V,
the RoPE table, the hidden passed on, the logits) carries a relative error up to
u = u_dtype + sqrt(K) u_fp32: its rounding (u_bf16 = 2^-8, u_fp32 = 2^-24) plus
the error of a sum of up to K terms accumulated in fp32 (K = 1152, the longest
sum of the default model; sqrt(K) u_fp32 is the size of that error when rounding
errors are independent, as in Higham & Mary's probabilistic analysis, SIAM J.
Sci. Comput. 2019: small beside u_bf16, it is most of float32's u). A
probability, computed in fp32 from the logits, carries up to (1 + sqrt(K)) u_fp32
more. CPUs, kernels and accumulation orders differ only within this.

Emulation. The oracle runs the scenario once with every kept value rounded to
the dtype (to nearest even, as torch's kernels store), then DRAWS times
with each multiplied by (1 + d), d uniform in [-u, u] and independent per
element, the drafts forced to the exact ones. For each draft: the change of its
probability (as the wire's float32 carries it) and of its logit lead over every
token its bitmask allows. The worst of these over all runs and drafts are the
worst deviations.

Tolerance: prob_tolerance = SAFETY x the worst probability deviation (rounded
up to two significant digits). Tie rule: every draft's exact logit lead over its
runner-up among the allowed tokens is at least SAFETY x the worst lead
deviation, and with min_confidence every computed draft's probability lies at
least prob_tolerance from it; so no token can flip and tokens compare exactly.
scenario()'s inputs are drawn again, proposal by proposal (a Propose, a batch's
row), until its drafts clear MARGIN (above the
requirement) and are well conditioned: in SCREEN runs of the bfloat16 error
model, no draft's probability moves by more than PROB_BUDGET nor its lead by more
than LEAD_BUDGET (one ill-conditioned proposal would widen the tolerance of every
draft; the derivation's own runs are independent of these). make_vector refuses
to write a vector that breaks the rule.

SAFETY = 2: each deviation sums thousands of small independent errors and is
near Gaussian. The worst of DRAWS draws over some eighty drafts lies about 3
standard deviations out, so the tolerance and the margin lie 6 or more out, where
a Gaussian's two tails hold some 1e-8 (the vector records the largest standard
deviations, prob_sigma and lead_sigma, and the ratios to them).

The same derivation for float32 (`--dtype float32` servers) gives the tight
tolerance of the vector's `float32` variant. Before writing, the vector is
replayed against the default server, a float32 one, and both on kernels of
other x86-64 CPUs (vector_runner.OTHER_CPUS): all must pass. Regenerate when
the default checkpoint or the contract changes; `--check` only compares a fresh
vector with the file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: the oracle's modules

from mtp_reference import Reference
from oracle import (
    ErrorModel,
    Oracle,
    Proposal,
    batch_rows,
    batches,
    deviation,
    emulate,
    expectations,
    margins,
    perturbed,
    proposes,
    raw,
    reduction_length,
    two_digits_up,
)
from vector_runner import (
    FORMAT,
    OTHER_CPUS,
    VECTOR_PATH,
    DefaultServer,
    check_vector,
    encode_tensor,
    load_vector,
    replay,
    static_info,
    variant,
)

from mtpdraft.client import DrafterClient
from mtpdraft.service.model.default_model import DEFAULT_CHECKPOINT

SEED = 7
DRAWS = 64
SAFETY = 2.0
MARGIN = 1.0  # the logit lead asked of every draft while choosing inputs
GAP = 0.125  # and the distance of its probabilities from a min_confidence
TRIES = 400  # inputs drawn for one Propose before giving up
SCREEN = 8  # runs of the bfloat16 error model that screen each proposal's inputs
PROB_BUDGET = 0.035  # the largest probability deviation the screen lets through
LEAD_BUDGET = 0.35  # and the largest lead deviation
_CONFIG = json.loads((DEFAULT_CHECKPOINT / "config.json").read_text())
HIDDEN = _CONFIG["hidden_size"]
VOCAB = _CONFIG["vocab_size"]
SERVER = "python3 -m mtpdraft serve --port 0 --device cpu"
FLOAT32 = ("--dtype", "float32")

RULES = [
    "Refuse, before any call and with a non-zero exit, a vector whose format is not "
    f"{FORMAT!r}, whose prob_tolerance is missing or not a non-negative number, whose "
    "operations are missing or empty, with an operation whose op is unknown, a "
    "ProposeStream without messages, or a ProposeBatch (or a ProposeStream message) "
    "without states or without hiddens.",
    "Replay the operations in order against one server started as `server`.",
    "AllocState binds `state` to the returned id; TakeKV binds `handle`; the other "
    "operations look these names up. Ids are uint64 and non-zero.",
    "Tensors: dtype (proto enum name), shape, data = base64 of the raw little-endian "
    "bytes, sent unchanged.",
    "Prefill streams rows in chunks of at most chunk_rows rows; the first chunk carries "
    "state_id and start_position. `chunks` in expect is the number of chunks sent.",
    "Propose: `previous` is the fused verdict on the pending proposal; min_confidence, "
    "when given, is sent as it is. A Proposal's state_id must equal the state's id.",
    "AllocState: `sampling`, when given, is the state's SamplingParams (temperature, "
    "top_k, top_p, min_p, seed; absent: 0). A Propose's `sampling`, when given, is its "
    "sampling field; with num_drafts 0 it carries draft_cap and verify_token_cost. "
    "A grammar is one key, its kind (json_schema, ebnf, regex, structural_tag) to its "
    "source, or {\"none\": true} (Grammar.none); AllocState's `grammar` is the state's, a "
    "Propose's `grammar` the state's from this step on.",
    "ProposeBatch: one ProposeBatchRequest of B rows: state_ids from the `states` names "
    "(a name may be bound to a freed state), tokens, positions, hiddens [B, H], num_drafts "
    "(B values or one) and, when given, num_accepted (-1: no verdict), refeed_rows with "
    "refeed_hiddens, bitmask_rows with bitmasks, min_confidence (B values or one), "
    "sampling_rows with sampling (SamplingParams as AllocState's), grammar_rows with "
    "grammars (grammars as a Propose's), draft_caps and verify_token_costs, all sent as "
    "they are. expect: width, drafts and probs as B rows "
    "of width values, draft_counts, confidences, first_positions, and errors (the failed "
    "rows in row order: row, code name, reason, field, '' for none), all compared; where "
    "listed, q_support and q_ids and q_probs as B rows of width rows of q_support values. "
    "expect_error: the message failed as a whole: the call's status.",
    "ProposeStream: open one stream and send its `messages` (each a ProposeBatch "
    "operation without `op`, request_id 1, 2, ... in order) one at a time, each answered "
    "before the next; each answer's request_id must be its message's. A message that "
    "fails as a whole is answered with its error value (expect_error, expect_reason, "
    "expect_field: its code name, reason and field) and the stream stays open. Close the "
    "stream after the last answer.",
    "expect: every listed field must match, exactly except probs and confidence "
    "(and a batch's probs and confidences, and q_probs: absolute tolerance "
    "prob_tolerance). A Proposal's q_support, q_ids ([K][q_support]) and q_probs are "
    "compared where listed. An expect of `one_of` lists the answers a sampled draft "
    "may give (the server's draw depends on the state's id): the answer must match one. "
    "expect_error: the gRPC status code name; "
    "expect_reason: its google.rpc.ErrorInfo reason; expect_field: the first "
    "google.rpc.BadRequest field violation's field (absent: none). Compare all three.",
    "Drafts, probs and confidence are the float64 oracle's. prob_tolerance is derived "
    "from bfloat16's rounding (see derivation), and every draft leads its runner-up by "
    "a margin no valid bfloat16 server can overturn: tokens compare exactly.",
    "`float32` is the same vector for a server started as float32.server: its info "
    "replaces GetInfo's expect fields, its prob_tolerance the vector's.",
    "GetInfo lists only fields that are fixed for the server command (no live counters).",
    "Print one line per operation and finally `N passed, M failed`; exit non-zero on any "
    "failure. Free every state you allocated before exiting.",
]


def checkpoint_digests() -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(DEFAULT_CHECKPOINT.iterdir())
        if p.is_file()
    }


def bitmask(allowed: list[np.ndarray]) -> np.ndarray:
    """xgrammar's packed int32 layout: bit t % 32 of word t // 32 allows token t."""
    words = np.zeros((len(allowed), VOCAB // 32), dtype=np.uint32)
    for row, allow in enumerate(allowed):
        for t in np.flatnonzero(allow):
            words[row, t // 32] |= np.uint32(1 << (t % 32))
    return words.view(np.int32)


class Draws:
    """The scenario's inputs, drawn from one seeded generator in the order asked for."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def hiddens(self, n: int) -> dict[str, Any]:
        return encode_tensor(self.rng.standard_normal((n, HIDDEN)).astype(np.float32))

    def hidden(self) -> dict[str, Any]:
        return encode_tensor(self.rng.standard_normal(HIDDEN).astype(np.float32))

    def token(self) -> int:
        return int(self.rng.integers(0, VOCAB))

    def mask(self, n: int) -> np.ndarray:
        """n bitmask rows, each allowing about a quarter of the vocabulary."""
        return bitmask([self.rng.random(VOCAB) < 0.25 for _ in range(n)])

    def batch(self, *rows: dict[str, Any], one_k: bool = False, **extra: Any) -> dict[str, Any]:
        """A ProposeBatch of `rows` (see row()), its inputs drawn; `one_k`: num_drafts as
        one value for all."""
        op: dict[str, Any] = {"op": "ProposeBatch", "states": [r["state"] for r in rows]}
        drawn = [self.token() for _ in rows]  # a row's own token (a grammar's) replaces it
        op["tokens"] = [r.get("token", t) for r, t in zip(rows, drawn, strict=True)]
        op["positions"] = [r["position"] for r in rows]
        op["hiddens"] = self.hiddens(len(rows))
        op["num_drafts"] = [r["k"] for r in rows]
        if one_k:
            (k,) = set(op["num_drafts"])
            op["num_drafts"] = [k]
        if any(r["a"] >= 0 for r in rows):
            op["num_accepted"] = [r["a"] for r in rows]
        if any(r.get("refeed") for r in rows):
            op["refeed_rows"] = [r["a"] if r.get("refeed") else 0 for r in rows]
            op["refeed_hiddens"] = self.hiddens(sum(op["refeed_rows"]))
        masks = [r.get("mask") for r in rows]
        if any(m is not None for m in masks):
            op["bitmask_rows"] = [0 if m is None else len(m) for m in masks]
            op["bitmasks"] = encode_tensor(np.concatenate([m for m in masks if m is not None]))
        if any(r.get("floor") for r in rows):
            op["min_confidence"] = [None if r.get("floor") else 0.0 for r in rows]
        changes = [(i, r["sampling"]) for i, r in enumerate(rows) if "sampling" in r]
        if changes:
            op["sampling_rows"] = [i for i, _ in changes]
            op["sampling"] = [s for _, s in changes]
        grammars = [(i, r["grammar"]) for i, r in enumerate(rows) if "grammar" in r]
        if grammars:
            op["grammar_rows"] = [i for i, _ in grammars]
            op["grammars"] = [g for _, g in grammars]
        if any("cap" in r for r in rows):
            op["draft_caps"] = [r.get("cap", 0) for r in rows]
            op["verify_token_costs"] = [r.get("cost", 0.0) for r in rows]
        errors = [{"row": i} | r["error"] for i, r in enumerate(rows) if "error" in r]
        return op | ({} if "expect_error" in extra else {"expect": {"errors": errors}}) | extra


def row(state: str, position: int, k: int, a: int = -1, **extra: Any) -> dict[str, Any]:
    """One row of a batch: state, position, K and verdict (-1: none); `refeed` (its a
    rows), `mask` (bitmask rows), `floor` (a min_confidence that settle() places),
    `token` (the row's token, else drawn), `error` (the row's error, fails()),
    `sampling` and `grammar` (the state's from this step on), `cap` and `cost` (K 0's draft cap and
    verify token cost)."""
    return {"state": state, "position": position, "k": k, "a": a} | extra


def message(batch: dict[str, Any]) -> dict[str, Any]:
    """A ProposeStream message: a ProposeBatch operation without its `op`."""
    return {k: v for k, v in batch.items() if k != "op"}


def error(code: str, reason: str, field: str | None = None) -> dict[str, Any]:
    """An operation's (or a message's) expected error."""
    out = {"expect_error": code, "expect_reason": reason}
    return out | ({"expect_field": field} if field else {})


def fails(code: str, reason: str, field: str = "") -> dict[str, Any]:
    """A batch row's expected error."""
    return {"error": {"code": code, "reason": reason, "field": field}}


# A row whose position does not continue its state.
MISMATCH_ROW = fails("INVALID_ARGUMENT", "POSITION_MISMATCH", "positions")


def unfit(op: dict[str, Any], key: str, rows: dict[str, Any]) -> dict[str, Any]:
    """The batch `op` with `rows` as its tensor `key`, whose rows its counts do not add up
    to: the columns do not fit together, the message fails as a whole."""
    op = {k: v for k, v in op.items() if k != "expect"}
    return op | {key: rows} | error("INVALID_ARGUMENT", "COLUMNS_MISMATCH", key)


def scenario(seed: int) -> list[dict[str, Any]]:
    """The operations with their inputs and the contract's structural expectations."""
    draw = Draws(seed)
    hiddens, token = draw.hiddens, draw.token

    def propose(state: str, position: int, k: int, **extra: Any) -> dict[str, Any]:
        op = {"op": "Propose", "state": state, "token": token(), "position": position}
        op |= {"num_drafts": k, "hidden": draw.hidden()}
        if "expect_error" not in extra:
            op["expect"] = {"first_position": position + 1}
        return op | extra

    def verify(state: str, a: int, rows: int, refeed: bool = False) -> dict[str, Any]:
        op: dict[str, Any] = {"op": "AfterVerify", "state": state, "num_accepted": a}
        if refeed:
            op["refeed_hiddens"] = hiddens(a)
        return op | {"expect": {"num_rows": rows, "next_position": rows + 1}}

    mismatch = error("INVALID_ARGUMENT", "POSITION_MISMATCH", "position")
    no_state = error("NOT_FOUND", "STATE_NOT_FOUND")
    prompt = [token() for _ in range(8)]  # x0..x7; rows (x1, h0) .. (x6, h5) are prefilled
    first = propose("A", 7, 3)  # (x7, h6) at position 7 drafts d1..d3 at 8..10
    first["token"] = prompt[7]
    mask = bitmask([draw.rng.random(VOCAB) < 0.25, draw.rng.random(VOCAB) < 0.25])
    return [
        {"op": "GetInfo"},
        {"op": "AllocState", "state": "A"},
        {
            "op": "Prefill",
            "state": "A",
            "start_position": 1,
            "tokens": prompt[1:7],
            "chunk_rows": 4,
            "hiddens": hiddens(6),
            "expect": {"num_rows": 6, "next_position": 7, "chunks": 2},
        },
        {  # rows 1..6 are there: position 3 does not continue the state
            "op": "Prefill",
            "state": "A",
            "start_position": 3,
            "tokens": [token()],
            "chunk_rows": 4,
            "hiddens": hiddens(1),
        }
        | error("INVALID_ARGUMENT", "POSITION_MISMATCH", "start_position"),
        first,
        {k: v for k, v in first.items() if k != "expect"}
        | error("FAILED_PRECONDITION", "PROPOSAL_PENDING"),
        verify("A", 1, rows=8),  # rows of x7 and d1: positions 7, 8
        {"op": "AfterVerify", "state": "A", "num_accepted": 0}
        | error("FAILED_PRECONDITION", "NO_PENDING_PROPOSAL"),
        propose("A", 10, 4, **mismatch),  # the next position is 9
        propose("A", 9, 4, bitmask=encode_tensor(mask)),
        verify("A", 2, rows=11, refeed=True),
        propose("A", 12, 3),
        propose("A", 16, 2, previous={"num_accepted": 3}),  # a = K: 11 + 1 + 3 = 15 rows
        propose("A", 18, 3, previous={"num_accepted": 1, "refeed_hiddens": hiddens(1)}),
        verify("A", 0, rows=18),
        {"op": "TakeKV", "state": "A", "handle": "H1", "expect": {"num_rows": 18}},
        propose("A", 19, 3, **mismatch),  # A is empty: next is 1
        {"op": "AllocState", "state": "B"},
        {
            "op": "InstallKV",
            "state": "B",
            "handle": "H1",
            "expect": {"num_rows": 18, "next_position": 19},
        },
        {"op": "InstallKV", "state": "A", "handle": "H1"}
        | error("NOT_FOUND", "HANDLE_NOT_FOUND"),  # used
        propose("B", 19, 3),
        verify("B", 3, rows=22, refeed=True),
        {  # the hot path, one state a batch of one: each carries the verdict on the last
            "op": "ProposeStream",
            "messages": [
                message(draw.batch(row("B", 23, 3))),
                # a = 1 leaves 22 + 1 + 1 rows: position 26 does not continue B, and
                # the refused row changes nothing (its verdict is not applied)
                message(draw.batch(row("B", 26, 2, 1, **MISMATCH_ROW))),
                message(draw.batch(row("B", 25, 2, 1))),
                message(draw.batch(row("B", 28, 4, 2, refeed=True))),
            ],
        },
        verify("B", 0, rows=28),
        {"op": "AllocState", "state": "C"},
        {
            "op": "Prefill",
            "state": "C",
            "start_position": 1,
            "tokens": [token()],
            "chunk_rows": 4,
            "hiddens": hiddens(1),
            "expect": {"num_rows": 1, "next_position": 2, "chunks": 1},
        },
        {"op": "TakeKV", "state": "C", "handle": "H2", "expect": {"num_rows": 1}},
        {"op": "InstallKV", "state": "B", "handle": "H2"}
        | error("FAILED_PRECONDITION", "STATE_NOT_EMPTY"),
        {
            "op": "InstallKV",
            "state": "C",
            "handle": "H2",
            "expect": {"num_rows": 1, "next_position": 2},
        },
        # The chain stops where its confidence would fall below min_confidence, which
        # settle() places between two drafts' probabilities.
        propose("C", 2, 4, min_confidence=0.0),
        {"op": "FreeState", "state": "A", "expect": {"existed": True}},
        {"op": "FreeState", "state": "A", "expect": {"existed": False}},
        propose("A", 1, 3, **no_state),
        {
            "op": "Prefill",
            "state": "A",
            "start_position": 1,
            "tokens": [token()],
            "chunk_rows": 4,
            "hiddens": hiddens(1),
        }
        | no_state,
        {"op": "FreeState", "state": "B", "expect": {"existed": True}},
        {"op": "AfterVerify", "state": "B", "num_accepted": 0} | no_state,
        {"op": "FreeState", "state": "C", "expect": {"existed": True}},
        *many_states(draw),
        *grammar_states(draw),
        *sampled_states(draw),
    ]


# The sampled states' parameters: q is the top 2 tokens after the temperature (their
# order and the cut clear the tie rule's margin), the answer's draft any of them; greedy
# is temperature 0.
HOT = {"temperature": 2.0, "top_k": 2, "seed": 11}
WARM = {"temperature": 0.7, "top_k": 2, "seed": 5}
GREEDY = {"temperature": 0.0}


def sampled_states(draw: Draws) -> list[dict[str, Any]]:
    """State "S" allocated with sampling parameters, "T" greedy; batch rows change their
    sampling through the columns (S to greedy, T to sampled and back). A sampled proposal
    has one draft and its verdict is 0: its token is the server's draw (see oracle.py). The
    drafter's own K (num_drafts 0): its draft_cap at verify_token_cost 0, 0 drafts at a cost
    above 1."""
    hiddens = draw.hiddens

    def prefill(state: str, n: int) -> dict[str, Any]:
        return {
            "op": "Prefill",
            "state": state,
            "start_position": 1,
            "tokens": [draw.token() for _ in range(n)],
            "chunk_rows": 4,
            "hiddens": hiddens(n),
            "expect": {"num_rows": n, "next_position": n + 1, "chunks": -(-n // 4)},
        }

    def propose(state: str, position: int, k: int, **extra: Any) -> dict[str, Any]:
        op = {"op": "Propose", "state": state, "token": draw.token(), "position": position}
        return op | {"num_drafts": k, "hidden": draw.hidden()} | extra

    return [
        {"op": "AllocState", "state": "S", "sampling": HOT},
        prefill("S", 4),
        propose("S", 5, 1),  # 5 rows, one sampled draft pending
        {"op": "AfterVerify", "state": "S", "num_accepted": 0}
        | {"expect": {"num_rows": 5, "next_position": 6}},
        {"op": "AllocState", "state": "T"},
        prefill("T", 3),
        draw.batch(
            row("S", 6, 3, sampling=GREEDY),  # 6 rows, 3 greedy drafts pending
            row("T", 4, 1, sampling=WARM),  # 4 rows, one sampled draft pending
        ),
        draw.batch(
            row("S", 9, 0, 2, cap=2, cost=0.0),  # 8 rows; K is the cap
            row("T", 5, 1, 0),  # 5 rows, sampled still
        ),
        # K 0 at a cost above 1: the chain stops at its first draft; 10 rows
        propose("S", 11, 0, draft_cap=3, verify_token_cost=1.5, previous={"num_accepted": 1}),
        {
            "op": "ProposeStream",
            "messages": [
                message(
                    draw.batch(
                        row("S", 12, 0, 0, cap=4, cost=0.0),  # 11 rows
                        row("T", 6, 2, 0, sampling=GREEDY),  # 5 rows
                    )
                ),
            ],
        },
        *({"op": "FreeState", "state": s, "expect": {"existed": True}} for s in "ST"),
    ]


def grammar_states(draw: Draws) -> list[dict[str, Any]]:
    """States with a grammar: "J" obeys a JSON schema (its tokens are ones the schema allows
    after those before, the verdicts reject every draft), "W" a regular expression of
    words (a letter may follow any accepted drafts). Their drafts are the oracle's under
    the grammar; a token it refuses fails its Propose or its row, changing nothing."""
    hiddens = draw.hiddens
    prompt = list(b"config =")  # rows at positions 1..8
    rejected = ("INVALID_ARGUMENT", "TOKEN_REJECTED_BY_GRAMMAR")

    def alloc(state: str, **grammar: str) -> dict[str, Any]:
        return {"op": "AllocState", "state": state, "grammar": grammar}

    def prefill(state: str) -> dict[str, Any]:
        return {
            "op": "Prefill",
            "state": state,
            "start_position": 1,
            "tokens": prompt,
            "chunk_rows": 8,
            "hiddens": hiddens(len(prompt)),
            "expect": {"num_rows": 8, "next_position": 9, "chunks": 1},
        }

    def propose(state: str, position: int, token: str, k: int, **extra: Any) -> dict[str, Any]:
        op = {"op": "Propose", "state": state, "token": ord(token), "position": position}
        op |= {"num_drafts": k, "hidden": draw.hidden()}
        return (
            op
            | ({} if "expect_error" in extra else {"expect": {"first_position": position + 1}})
            | extra
        )

    a0 = {"previous": {"num_accepted": 0}}
    return [
        alloc("K", ebnf="root ::= undefined")
        | error("INVALID_ARGUMENT", "GRAMMAR_INVALID", "grammar"),
        alloc("J", json_schema=JSON_SCHEMA),
        prefill("J"),
        propose("J", 9, "{", 4),  # 9 rows
        propose("J", 10, "x", 4, **a0, **error(*rejected, "token")),  # not after "{"
        propose("J", 10, '"', 4, **a0),  # 10 rows
        {"op": "AfterVerify", "state": "J", "num_accepted": 0}
        | {"expect": {"num_rows": 10, "next_position": 11}},
        alloc("W", regex=WORDS),
        prefill("W"),
        propose("W", 9, "a", 3),  # 9 rows, 3 drafts pending
        draw.batch(
            row("W", 12, 3, 2, token=ord("b"), refeed=True),  # 12 rows
            row("J", 11, 2, token=ord("n")),  # "name", the schema's first property; 11 rows
        ),
        {
            "op": "ProposeStream",
            "messages": [
                message(
                    draw.batch(
                        row("J", 12, 2, 0, token=ord("1"), **fails(*rejected, "tokens")),
                        row("W", 14, 4, 1, token=ord("c")),  # 14 rows
                    )
                ),
                message(draw.batch(row("J", 12, 3, 0, token=ord("a")))),  # 12 rows
            ],
        },
        *({"op": "FreeState", "state": s, "expect": {"existed": True}} for s in "JW"),
        *grammar_changes(draw, prefill, propose),
    ]


def grammar_changes(draw: Draws, prefill: Any, propose: Any) -> list[dict[str, Any]]:
    """Grammars changed by a step: "G", allocated without one, takes four digits on a
    Propose (its token the first digit), a batch row changes it to words and a later one
    clears it (none: its drafts are free again); a row whose grammar does not compile
    fails alone (field grammars), "H" keeping no grammar."""
    bad = {"ebnf": "root ::= undefined"}
    return [
        *({"op": "AllocState", "state": s} for s in "GH"),
        prefill("G"),
        prefill("H"),
        propose("G", 9, "1", 2, grammar={"regex": DIGITS}),  # 9 rows, 2 digits pending
        draw.batch(
            row("G", 10, 2, 0, token=ord("a"), grammar={"regex": WORDS}),  # 10 rows
            row("H", 9, 1, grammar=bad, **fails("INVALID_ARGUMENT", "GRAMMAR_INVALID", "grammars")),
        ),
        draw.batch(
            row("G", 11, 2, 0, grammar={"none": True}),  # 11 rows, the drafts free
            row("H", 9, 1),  # 9 rows
        ),
        *({"op": "FreeState", "state": s, "expect": {"existed": True}} for s in "GH"),
    ]


# The grammars of grammar_states(): an object with a name and a size, and words.
JSON_SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "size": {"type": "integer"}},
        "required": ["name", "size"],
    }
)
WORDS = "[a-z]+( [a-z]+)*"
DIGITS = "[0-3]{4}"


def many_states(draw: Draws) -> list[dict[str, Any]]:
    """ProposeBatch and ProposeStream over states D, E, F, G; "A" is a freed state by
    now. Positions follow the contract: a state of n rows takes its next Propose at
    n + 1; a verdict a on a proposal at p leaves p + a rows."""
    hiddens, mask = draw.hiddens, draw.mask

    def prefill(state: str, n: int) -> dict[str, Any]:
        return {
            "op": "Prefill",
            "state": state,
            "start_position": 1,
            "tokens": [draw.token() for _ in range(n)],
            "chunk_rows": 4,
            "hiddens": hiddens(n),
            "expect": {"num_rows": n, "next_position": n + 1, "chunks": -(-n // 4)},
        }

    out_of_range = "NUM_ACCEPTED_OUT_OF_RANGE"
    return [
        *({"op": "AllocState", "state": s} for s in "DEF"),
        prefill("D", 5),
        prefill("E", 3),
        prefill("F", 4),
        draw.batch(row("D", 6, 3), row("E", 4, 2)),  # D: 6 rows, E: 4, both pending
        draw.batch(  # the same state twice: its second row fails
            row("D", 8, 3, 1, refeed=True, mask=mask(1)),  # 8 rows
            row("F", 5, 3),  # 5 rows, pending
            row("D", 8, 2, 1, **fails("INVALID_ARGUMENT", "DUPLICATE_STATE", "state_ids")),
        ),
        draw.batch(  # F's a = 1 leaves 6 rows: position 6 does not continue it
            row("F", 6, 2, 1, **MISMATCH_ROW),
            row("E", 7, 2, 2),  # a = K: 4 + 2 + 1 = 7 rows
        ),
        {"op": "AfterVerify", "state": "F", "num_accepted": 2}
        | {"expect": {"num_rows": 7, "next_position": 8}},
        draw.batch(  # C1: a = K, a refeed, no verdict (-1); a bitmask and a min_confidence
            row("D", 12, 3, 3, floor=True),  # 12 rows, the chain stopped early
            row("E", 9, 2, 1, refeed=True, mask=mask(2)),  # 9 rows
            row("F", 8, 4),  # 8 rows
        ),
        draw.batch(  # C2: two rows fail and change nothing; the others are answered
            row("D", 13, 2, 0),  # 13 rows
            row("A", 1, 3, **fails("NOT_FOUND", "STATE_NOT_FOUND", "state_ids")),
            row("F", 12, 2, 2, **MISMATCH_ROW),
            row("E", 12, 3, 2, refeed=True),  # a = K: 12 rows
        ),
        {"op": "AllocState", "state": "G"},
        prefill("G", 2),
        {
            "op": "ProposeStream",
            "messages": [
                message(
                    draw.batch(  # S1: F as C2 left it (8 rows, 4 drafts pending)
                        row("F", 11, 3, 2),  # 11 rows
                        row("E", 16, 2, 3, mask=mask(1)),  # a = K: 16 rows
                        row("G", 3, 3, floor=True),  # 3 rows
                        row("D", 15, 4, 1, refeed=True),  # 15 rows
                    )
                ),
                message(
                    draw.batch(  # S2: D's a > K, G's pending proposal; both unchanged
                        row("E", 17, 2, 0),  # 17 rows
                        row(
                            "D", 21, 3, 5, **fails("INVALID_ARGUMENT", out_of_range, "num_accepted")
                        ),
                        row("F", 13, 2, 1),  # 13 rows
                        row("G", 4, 2, **fails("FAILED_PRECONDITION", "PROPOSAL_PENDING")),
                    )
                ),
                message(
                    unfit(  # S3: bitmask_rows [1, 0] take one row of bitmasks, which has two
                        draw.batch(row("D", 17, 2, 1, mask=mask(1)), row("G", 5, 2, 1)),
                        "bitmasks",
                        encode_tensor(mask(2)),
                    )
                ),
            ],
        },
        unfit(  # C3: refeed_rows [1, 0] take one row of refeed_hiddens, which has two
            draw.batch(row("D", 17, 2, 1, refeed=True), row("F", 15, 2, 1)),
            "refeed_hiddens",
            hiddens(2),
        ),
        draw.batch(  # D, G and F as S1 and S2 left them; one K for all
            row("D", 17, 2, 1, refeed=True),  # 17 rows
            row("G", 5, 2, 1, floor=True),  # 5 rows
            row("F", 16, 2, 2),  # a = K: 16 rows
            one_k=True,
        ),
        *({"op": "FreeState", "state": s, "expect": {"existed": True}} for s in "DEFG"),
    ]


def settle(ref: Reference, ops: list[dict[str, Any]], seed: int) -> None:
    """Draws each drafting proposal's hidden again (a batch row's within its batch's
    hiddens) until its drafts clear MARGIN and pass the Screen; places each
    min_confidence GAP or more from its drafts' probabilities, the chain stopping."""
    rng = np.random.default_rng([seed, 1])
    walker = Oracle(ref)
    screen = Screen(ref, seed)
    for op in ops:
        if op["op"] == "Propose" and "expect_error" not in op:
            settle_one(walker, op, rng, screen)
        for batch in batches(op):  # a stream's messages one after another
            if "expect_error" not in batch:
                settle_batch(walker, batch, rng, screen)
            walker.apply(batch | {"op": "ProposeBatch"})
        if not batches(op):
            walker.apply(op)


def settle_batch(
    walker: Oracle, op: dict[str, Any], rng: np.random.Generator, screen: Screen
) -> None:
    """settle_one for each row that is answered, written back into the columns."""
    hiddens = raw(op["hiddens"])
    for i, row_ in enumerate(batch_rows(op)):
        if "expect_error" in row_:
            continue
        settle_one(walker, row_, rng, screen)
        hiddens[i] = raw(row_["hidden"])
        if "min_confidence" in row_:
            op["min_confidence"][i] = row_["min_confidence"]
    op["hiddens"] = encode_tensor(hiddens)


def settle_one(
    walker: Oracle, op: dict[str, Any], rng: np.random.Generator, screen: Screen
) -> None:
    free = {k: v for k, v in op.items() if k != "min_confidence"}  # all K drafts
    for _ in range(TRIES):
        p = walker.trial(free)
        if clears(p, op) and screen.passes(walker, free, p):
            return
        op["hidden"] = free["hidden"] = encode_tensor(
            rng.standard_normal(HIDDEN).astype(np.float32)
        )
    raise SystemExit(f"make_vector: none of {TRIES} inputs clears the margin and the screen")


class Screen:
    """SCREEN runs of the bfloat16 error model over one proposal (the states' rows as the
    exact walk holds them): passes when no draft moves beyond PROB_BUDGET or LEAD_BUDGET."""

    def __init__(self, ref: Reference, seed: int) -> None:
        self.ref, self.model = ref, ErrorModel.of("bfloat16", ref)
        seed = int(np.random.default_rng([seed, 2]).integers(2**62))
        self.gen = torch.Generator().manual_seed(seed)

    def passes(self, walker: Oracle, op: dict[str, Any], p: Proposal) -> bool:
        probs = np.array([d.prob for d in p.drafts])
        for _ in range(SCREEN):
            run = Oracle(self.ref, perturbed(self.model.u, self.gen), [p])
            run.states = walker.states  # trial() leaves them as they are
            d = deviation([p], [run.trial(op)])
            if (np.abs(d.prob) + self.model.prob_u * probs).max() > PROB_BUDGET:
                return False
            if d.lead.max() > LEAD_BUDGET:
                return False
        return True


def clears(p: Proposal, op: dict[str, Any]) -> bool:
    """Whether the drafts of `p` (computed without a floor) clear MARGIN; for a Propose
    with min_confidence, sets it so that the chain stops GAP or more from every draft."""
    drafts = p.drafts
    if "min_confidence" in op:
        probs = [d.prob for d in drafts]
        for j in range(1, len(probs)):  # keep one draft at least, stop at draft j + 1
            floor = math.floor((min(probs[:j]) + probs[j]) / 2 * 64) / 64
            if min(probs[:j]) - floor >= GAP and floor - probs[j] >= GAP:
                op["min_confidence"], drafts = floor, drafts[: j + 1]
                break
        else:
            return False
    return min(margins([Proposal(drafts, False)])) >= MARGIN


def expect_drafts(ref: Reference, ops: list[dict[str, Any]]) -> list[Proposal | None]:
    """Fills in every drafting operation's (and stream message's) expect from the oracle (a
    batch's errors stay as the scenario wrote them); returns the proposals."""
    exact = Oracle(ref).run(ops)
    for op, want in expectations(ops, exact):
        op["expect"] = want
    return exact


def derive(
    ref: Reference, ops: list[dict[str, Any]], exact: list[Proposal | None], draws: int, seed: int
) -> dict[str, Any]:
    """The tolerance and the tie rule's figures (the module's docstring); exits unless
    every draft clears the rule."""
    out: dict[str, Any] = {
        "model": "a valid implementation keeps each op's output, the KV cache, the RoPE "
        "table, the hidden passed on and the logits in its dtype, each with a relative "
        "error up to unit_roundoff = u_dtype + sqrt(K) u_fp32 (rounding plus an fp32 sum "
        "of up to K terms); its probabilities (fp32) up to (1 + sqrt(K)) u_fp32 more. "
        "Emulated by the oracle rounding every such value to the dtype once, then "
        "perturbing each by a uniform relative error within unit_roundoff in each of "
        "`draws` runs, drafts forced. prob_tolerance = safety_factor x "
        "worst_prob_deviation, rounded up to two digits; required_margin = safety_factor "
        "x worst_lead_deviation (a draft's logit lead over any allowed token).",
        "reduction_length_K": reduction_length(ref),
        "draws": draws,
        "safety_factor": SAFETY,
        "smallest_margin": min(margins(exact)),
    }
    floors = [
        (op["min_confidence"], p)
        for op, p in zip(proposes(ops), exact, strict=True)
        if "min_confidence" in op
    ]
    if floors:
        out["smallest_min_confidence_gap"] = min(
            abs(d.prob - floor) for floor, p in floors for d in p.drafts
        )
    for dtype in ("bfloat16", "float32"):
        fig = emulate(ref, ops, exact, ErrorModel.of(dtype, ref), draws, seed)
        fig["prob_tolerance"] = two_digits_up(SAFETY * fig["worst_prob_deviation"])
        fig["required_margin"] = SAFETY * fig["worst_lead_deviation"]
        fig["prob_tolerance_in_sigmas"] = fig["prob_tolerance"] / fig["prob_sigma"]
        fig["required_margin_in_sigmas"] = fig["required_margin"] / fig["lead_sigma"]
        out[dtype] = fig
        print(f"make_vector: {dtype}: {json.dumps(fig)}")
        if out["smallest_margin"] < fig["required_margin"]:
            raise SystemExit(
                f"make_vector: a draft leads by {out['smallest_margin']:.3g} only, under the "
                f"{fig['required_margin']:.3g} {dtype} requires: try another --seed"
            )
        if floors and out["smallest_min_confidence_gap"] < fig["prob_tolerance"]:
            raise SystemExit("make_vector: a draft's prob is too near its min_confidence")
    return out


def check_servers(vector: dict[str, Any]) -> None:
    """Replays the vector against the default server, a float32 one and both on other
    CPUs' kernels; exits unless every replay passes. Fills in GetInfo's expectations."""
    with DefaultServer() as server, DrafterClient(server.address) as client:
        info = static_info(client.info())
    config = {k: _CONFIG[k] for k in ("hidden_size", "vocab_size", "num_attention_heads")}
    if {k: info[k] for k in config} != config or info["bitmask_words"] != -(-VOCAB // 32):
        raise SystemExit(f"make_vector: the server's GetInfo disagrees with the config: {info}")
    getinfo = next(op for op in vector["operations"] if op["op"] == "GetInfo")
    getinfo["expect"] = info
    with DefaultServer(*FLOAT32) as server, DrafterClient(server.address) as client:
        info32 = static_info(client.info())
    vector["float32"]["info"] = {k: v for k, v in info32.items() if info[k] != v}
    for cpu, env in [("this CPU", None), *OTHER_CPUS.items()]:
        for name, extra in ((None, ()), ("float32", FLOAT32)):
            with DefaultServer(*extra, env=env) as server:
                ops, tol = variant(vector, name)
                outcomes = replay(server.address, ops, tol)
            failed = [o.line() for o in outcomes if not o.ok]
            where = f"{name or 'default'} server on {cpu} ({env or 'as it is'})"
            if failed:
                raise SystemExit(f"make_vector: the {where} disagrees:\n" + "\n".join(failed))
            print(f"make_vector: the {where} passes")


def make(seed: int, draws: int) -> dict[str, Any]:
    ref = Reference(DEFAULT_CHECKPOINT)
    ops = scenario(seed)
    settle(ref, ops, seed)
    exact = expect_drafts(ref, ops)
    derivation = derive(ref, ops, exact, draws, seed)
    vector = {
        "format": FORMAT,
        "about": "Operations every mtpdraft client replays against a live server; "
        "written by tests/conformance/make_vector.py: drafts, probs and confidence from "
        "the float64 oracle (tests/mtp_reference.py), the tolerance as `derivation` says.",
        "server": SERVER,
        "checkpoint": {"path": "service/model/default_checkpoint", "sha256": checkpoint_digests()},
        "seed": seed,
        "prob_tolerance": derivation["bfloat16"]["prob_tolerance"],
        "float32": {
            "server": f"{SERVER} {' '.join(FLOAT32)}",
            "prob_tolerance": derivation["float32"]["prob_tolerance"],
            "info": {},
        },
        "derivation": derivation,
        "rules": RULES,
        "operations": ops,
    }
    check_vector(vector)
    check_servers(vector)
    return vector


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the file only")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--draws", type=int, default=DRAWS)
    parser.add_argument("--out", type=Path, default=VECTOR_PATH)
    args = parser.parse_args()

    vector = make(args.seed, args.draws)
    text = dump(vector)
    if args.check:
        diffs = differences(load_vector(args.out), vector)
        print("\n".join(diffs) or f"make_vector: {args.out} is up to date")
        return 1 if diffs else 0
    args.out.write_text(text)
    print(f"make_vector: wrote {args.out} ({len(vector['operations'])} operations)")
    return 0


def differences(old: Any, new: Any, where: str = "") -> list[str]:
    """Where `new` departs from `old`: floats beyond a relative 1e-6 (float64 sums differ
    in their last bits between CPUs), anything else at all."""
    if isinstance(new, dict) and isinstance(old, dict):
        keys = list(new) + [k for k in old if k not in new]
        return [d for k in keys for d in differences(old.get(k), new.get(k), f"{where}.{k}")]
    if isinstance(new, list) and isinstance(old, list) and len(new) == len(old):
        pairs = enumerate(zip(old, new, strict=True))
        return [d for i, (a, b) in pairs for d in differences(a, b, f"{where}[{i}]")]
    if isinstance(new, float) and isinstance(old, float):
        return [] if math.isclose(old, new, rel_tol=1e-6, abs_tol=1e-12) else [f"{where} differs"]
    return [] if old == new else [f"{where} differs"]


def dump(vector: dict[str, Any]) -> str:
    """Pretty JSON with one line per operation (short diffs, a readable file)."""
    head = {k: v for k, v in vector.items() if k != "operations"}
    lines = json.dumps(head, indent=2).rstrip("}").rstrip() + ',\n  "operations": [\n'
    lines += ",\n".join("    " + json.dumps(op) for op in vector["operations"])
    return lines + "\n  ]\n}\n"


if __name__ == "__main__":
    sys.exit(main())
