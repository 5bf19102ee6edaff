"""The vector's drafts are the float64 oracle's, and clear the tie rule it states.

No server: the oracle (oracle.py over tests/mtp_reference.py) replays the vector's
operations over the rows each state must hold and must give every recorded draft,
probability and confidence (a batch's columns with their padding and failed rows
too; a sampled draft's q, and each answer its draw may give); every draft must lead its
runner-up (a sampled draft's q, its ranking) by the
margin the vector's derivation requires, and a min_confidence must lie
prob_tolerance or more from every probability of its chain.
"""

from __future__ import annotations

import pytest
from mtp_reference import Reference
from oracle import Oracle, Proposal, expectations, margins, proposes, two_digits_up
from vector_runner import load_vector

from mtpdraft.service.model.default_model import DEFAULT_CHECKPOINT


@pytest.fixture(scope="module")
def vector() -> dict:
    return load_vector()


@pytest.fixture(scope="module")
def exact(vector: dict) -> list[Proposal | None]:
    return Oracle(Reference(DEFAULT_CHECKPOINT)).run(vector["operations"])


def test_every_draft_is_the_oracles(vector: dict, exact: list[Proposal | None]) -> None:
    ops = proposes(vector["operations"])
    assert len(ops) == len(exact)
    drafting = [(op, p) for op, p in zip(ops, exact, strict=True) if p is not None]
    assert len(drafting) >= 10
    for op, p in drafting:
        want = p.expect(op["position"])
        assert same(want, op["expect"]), (op["expect"], want)


def same(want: object, got: object) -> bool:
    """Equal, floats within 1e-9, at any depth of lists and dicts."""
    if isinstance(want, dict):
        return (
            isinstance(got, dict)
            and set(got) == set(want)
            and all(same(want[k], got[k]) for k in want)
        )
    if isinstance(want, list):
        return (
            isinstance(got, list)
            and len(got) == len(want)
            and all(same(w, g) for w, g in zip(want, got, strict=True))
        )
    if isinstance(want, float):
        return isinstance(got, float) and abs(got - want) <= 1e-9
    return type(got) is type(want) and got == want


def test_every_operation_expects_the_oracles(vector: dict, exact: list[Proposal | None]) -> None:
    """Each drafting operation's whole expect, as oracle.expectations derives it."""
    found = expectations(vector["operations"], exact)
    kinds = {op.get("op", "message") for op, _ in found}
    assert {"Propose", "message", "ProposeBatch"} <= kinds
    for op, want in found:
        assert same(want, op["expect"]), (op.get("op"), op["expect"], want)


def errors(batch: dict) -> list:
    """A batch's expected row errors (each of its answers lists the same)."""
    return batch["expect"].get("one_of", [batch["expect"]])[0]["errors"]


def test_the_vector_covers_batches_unary_and_on_a_stream(vector: dict) -> None:
    ops = vector["operations"]
    unary = [op for op in ops if op["op"] == "ProposeBatch"]
    streamed = [msg for op in ops if op["op"] == "ProposeStream" for msg in op["messages"]]
    assert any(len(msg["states"]) == 1 for msg in streamed)  # a single state: a batch of one
    for batches in (unary, streamed):
        answered = [b for b in batches if "expect" in b]
        assert any(
            -1 in b.get("num_accepted", [])
            and any(b.get("refeed_rows", []))
            and any(b.get("bitmask_rows", []))
            and any(b.get("min_confidence", []))
            for b in answered
            if not b["expect"]["errors"]
        )
        assert any(
            b["expect"]["errors"] and len(b["expect"]["errors"]) < len(b["states"])
            for b in answered
        )
        assert any(b.get("expect_reason") == "COLUMNS_MISMATCH" for b in batches)
    reasons = {e["reason"] for b in unary if "expect" in b for e in errors(b)}
    assert {"DUPLICATE_STATE", "POSITION_MISMATCH", "STATE_NOT_FOUND"} <= reasons
    assert any(len(b["num_drafts"]) == 1 < len(b["states"]) for b in unary)  # one K for all


def test_the_vector_covers_sampled_drafts_and_the_drafters_k(vector: dict) -> None:
    ops = vector["operations"]
    batches = [b for op in ops for b in ([op] if op["op"] == "ProposeBatch" else [])]
    batches += [m for op in ops if op["op"] == "ProposeStream" for m in op["messages"]]
    sampled = [op["sampling"] for op in ops if op["op"] == "AllocState" and "sampling" in op]
    assert any(s["temperature"] > 0 and s["top_k"] and s["seed"] for s in sampled)
    # A sampled Propose and a batch with a sampled row, q in their answers.
    answers = [op["expect"]["one_of"] for op in ops if "one_of" in op.get("expect", {})]
    answers += [b["expect"]["one_of"] for b in batches if "one_of" in b.get("expect", {})]
    assert any("q_ids" in a[0] and "drafts" not in a[0] for a in answers)
    assert any(a[0]["q_support"] > 0 and "drafts" in a[0] for a in answers)
    # Rows that change sampling through the columns, to sampled and to greedy.
    changes = [s for b in batches for s in b.get("sampling", [])]
    assert {s["temperature"] > 0 for s in changes} == {True, False}
    # The drafter's own K: its cap at cost 0, none at a cost above 1; unary and batched.
    chosen = [op for op in ops if op["op"] == "Propose" and op["num_drafts"] == 0]
    assert any(op["draft_cap"] and op["verify_token_cost"] > 1 for op in chosen)
    assert any(
        0 in b["num_drafts"] and any(b.get("draft_caps", [])) and "verify_token_costs" in b
        for b in batches
    )


def test_the_vector_covers_grammars_changed_by_a_step(vector: dict) -> None:
    """A Propose gives a state without a grammar one (and drafts under it); a batch row
    changes a state's grammar and a later row clears it; a row whose grammar does not
    compile fails alone."""
    ops = vector["operations"]
    grammarless = {op["state"] for op in ops if op["op"] == "AllocState" and "grammar" not in op}
    given = [op for op in ops if op["op"] == "Propose" and "grammar" in op]
    assert any(op["state"] in grammarless and op["expect"].get("tokens") for op in given)
    batches = [op for op in ops if op["op"] == "ProposeBatch" and "grammar_rows" in op]
    changed = [
        (ops.index(b), b["states"][row], grammar)
        for b in batches
        for row, grammar in zip(b["grammar_rows"], b["grammars"], strict=True)
    ]
    none = {"none": True}
    assert any(
        state == later_state and grammar != none and later == none and at < later_at
        for at, state, grammar in changed
        for later_at, later_state, later in changed
    )
    failed = [e for b in batches for e in errors(b) if e["field"] == "grammars"]
    assert any(e["reason"] == "GRAMMAR_INVALID" for e in failed)


def test_every_draft_clears_the_tie_rule(vector: dict, exact: list[Proposal | None]) -> None:
    d = vector["derivation"]
    for dtype in ("bfloat16", "float32"):
        fig = d[dtype]
        assert fig["required_margin"] == pytest.approx(
            d["safety_factor"] * fig["worst_lead_deviation"]
        )
        assert min(margins(exact)) >= fig["required_margin"], dtype


def test_min_confidence_is_clear_of_every_prob(vector: dict, exact: list[Proposal | None]) -> None:
    floors = [
        (op["min_confidence"], p)
        for op, p in zip(proposes(vector["operations"]), exact, strict=True)
        if op.get("min_confidence")
    ]
    assert floors, "the vector should stop one chain by min_confidence"
    for floor, p in floors:
        assert p.stopped and p.kept
        assert min(abs(d.prob - floor) for d in p.drafts) >= vector["prob_tolerance"]


def test_tolerances_are_the_derived_ones(vector: dict) -> None:
    d = vector["derivation"]
    for dtype, tol in (("bfloat16", vector["prob_tolerance"]), ("float32", None)):
        fig = d[dtype]
        want = two_digits_up(d["safety_factor"] * fig["worst_prob_deviation"])
        assert fig["prob_tolerance"] == want
        assert tol is None or tol == want
    assert vector["float32"]["prob_tolerance"] == d["float32"]["prob_tolerance"]
    # float32's tolerance is the tight one: its unit roundoff and sums, not bfloat16's.
    assert vector["float32"]["prob_tolerance"] < vector["prob_tolerance"] / 100
