"""The conformance vector's drafts from the float64 oracle, and emulations of bf16/fp32.

`Oracle(ref).run(ops)` walks the vector's operations over the rows each state must
hold (tests/drafting.py's Expected: Propose appends the committed row R0, a
verdict keeps R1..Ra, a = K adds the last draft's row, refeed replaces chain
hiddens by the verifier's; a refused operation changes nothing) and asks the
float64 oracle (tests/mtp_reference.py) for every proposal's drafts, with its
bitmask rows and min_confidence applied as the contract says. A state allocated with a
grammar has a matcher of its own (xgrammar's, over the vocabulary's bytes, compiled here),
moved on by the tokens the operations commit: each draft is the argmax over the tokens the
grammar allows after the drafts before it, and the chain ends where it allows none.

A state with sampling parameters (temperature > 0; AllocState's `sampling`, changed by a
Propose's or a batch row's) draws its drafts from q, vLLM's processing of the logits cut to
the server's max_sample_top_k tokens (tests/sampling_reference.py). The draw's uniform
depends on the state's id, which the server chooses, so a sampled proposal has one draft
(the oracle walks no chain past a token it cannot know), any token of q's support, and
its expect lists each possible answer (`one_of`). num_drafts 0 leaves K to the drafter,
which the oracle knows at two verify_token_costs whatever the state's calibration: at 0
each more draft is worth its cost, so K is draft_cap; above 1 none is (k drafts yield at
most 1 + k tokens for 1 + cost k, under the 1 of no draft), so K is 0, the chain stopped
at its first draft.

A ProposeBatch (a
ProposeStream's message too) is one Propose per row (batch_rows), a failed row
changing nothing, a message that fails as a whole nothing at all. It imports
nothing from the service.

`Oracle(ref, store, forced)` does the same with `store` applied to every value an
implementation keeps in its compute dtype (mtp_reference's hook) and the drafts
forced to the exact ones, so that each draft's logits and probability can be
compared with the exact computation's: make_vector.py's error model.
"""

from __future__ import annotations

import base64
import copy
import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xgrammar
from drafting import Expected
from grammars import allowed as grammar_allows
from grammars import compile_kind, compiler
from mtp_reference import Reference, Store
from sampling_reference import vllm_processed

#: Unit roundoffs (round to nearest, 8 and 24 significant bits).
BF16_U = 2.0**-8
FP32_U = 2.0**-24
#: GetInfo.max_sample_top_k of the vector's server: the most tokens a sampled draft's q holds.
MAX_SAMPLE_TOP_K = 64


def to_bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).double()


def to_fp32(x: torch.Tensor) -> torch.Tensor:
    return x.float().double()


def perturbed(u: float, gen: torch.Generator) -> Store:
    """Multiplies each element by (1 + d), d uniform in [-u, u]: a rounding to the
    compute dtype whatever the kernel's accumulation order and rounding mode."""

    def store(x: torch.Tensor) -> torch.Tensor:
        d = torch.rand(x.shape, generator=gen, dtype=torch.float64) * 2 - 1
        return x * (1 + u * d)

    return store


def tensor(t: dict[str, Any]) -> torch.Tensor:
    """A vector tensor (raw little-endian bytes in base64) as float64 (int32 exactly)."""
    return torch.from_numpy(raw(t).astype(np.float64))


def encoded(arr: np.ndarray) -> dict[str, Any]:
    """A float32 or int32 array as a vector tensor."""
    dtype = {np.dtype("float32"): "DTYPE_FP32", np.dtype("int32"): "DTYPE_INT32"}[arr.dtype]
    data = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()
    return {"dtype": dtype, "shape": list(arr.shape), "data": base64.b64encode(data).decode()}


def raw(t: dict[str, Any]) -> np.ndarray:
    """A vector tensor's values in their own dtype (float32 or int32)."""
    kinds = {"DTYPE_FP32": "<f4", "DTYPE_INT32": "<i4"}
    flat = np.frombuffer(base64.b64decode(t["data"]), dtype=kinds[t["dtype"]])
    return flat.reshape(t["shape"]).astype(flat.dtype.newbyteorder("="))


def allowed(bitmask: dict[str, Any], vocab: int) -> torch.Tensor:
    """[rows, vocab] bool: bit t % 32 of word t // 32 allows token t (uncovered: not)."""
    t = tensor(bitmask)
    words = t.long().reshape(-1, t.shape[-1]) & 0xFFFFFFFF
    bits = (words[:, :, None] >> torch.arange(32)) & 1
    out = torch.zeros(words.shape[0], vocab, dtype=torch.bool)
    n = min(vocab, words.shape[1] * 32)
    out[:, :n] = bits.reshape(words.shape[0], -1)[:, :n].bool()
    return out


@dataclass
class Draft:
    token: int
    prob: float
    logits: torch.Tensor  # [vocab], disallowed tokens at -inf
    # A sampled draft's q, most probable first: its support's ids and probabilities (token
    # and prob are then its most probable token's); None for a greedy draft.
    q: tuple[list[int], list[float]] | None = None

    def ranked(self) -> torch.Tensor:
        """The logits of the tokens whose order the answer shows, most probable first: a
        greedy draft's and its runner-up, a sampled draft's support and the next token."""
        return self.logits.topk(2 if self.q is None else len(self.q[0]) + 1).values


@dataclass
class Proposal:
    """A Propose's outcome: every draft computed, the last one dropped if it stopped."""

    drafts: list[Draft]
    stopped: bool

    @property
    def kept(self) -> list[Draft]:
        return self.drafts[:-1] if self.stopped else self.drafts

    @property
    def sampled(self) -> bool:
        return any(d.q is not None for d in self.drafts)

    def expect(self, position: int) -> dict[str, Any]:
        """The answer's fields; a sampled proposal's, one for each token its draft may be."""
        if self.sampled:
            return {"one_of": [a | {"first_position": position + 1} for a in self.answers()]}
        return {
            "tokens": [d.token for d in self.kept],
            "probs": [d.prob for d in self.kept],
            "confidence": min(d.prob for d in self.drafts),
            "first_position": position + 1,
        }

    def answers(self) -> list[dict[str, Any]]:
        """A sampled proposal's possible answers: its one draft any token of q's support."""
        ((ids, probs),) = [d.q for d in self.drafts]
        q = {"q_support": len(ids), "q_ids": [ids], "q_probs": [probs]}
        pairs = zip(ids, probs, strict=True)
        return [{"tokens": [t], "probs": [p], "confidence": p} | q for t, p in pairs]


class Rows(Expected):
    """Expected's rows of one state, for a model of any hidden size."""

    def __init__(self, ref: Reference) -> None:
        width = ref.cfg["hidden_size"]
        super().__init__(ref, hiddens=torch.empty(0, width, dtype=torch.float64))

    grammar = None  # its grammar's matcher, at the committed tokens (None: no grammar)
    sampling: dict[str, Any] | None = None  # its sampling parameters (None: greedy)

    def add(self, toks: list[int], hid: torch.Tensor) -> None:
        self.tokens += list(toks)
        self.hiddens = torch.cat([self.hiddens, hid.double().reshape(len(toks), -1)])

    def commit(self, tokens: list[int]) -> None:
        for token in tokens if self.grammar is not None else ():
            if not self.grammar.accept_token(token):
                raise ValueError(f"token {token} does not continue the state's grammar")


class Oracle:
    """Walks vector operations over the rows each state holds; Proposes get the oracle's drafts.

    `store` and `forced` as in the module's docstring: a Propose's drafts are then
    forced to those of `forced` (the exact proposals, in replay order).
    """

    def __init__(
        self, ref: Reference, store: Store | None = None, forced: list[Proposal | None] = ()
    ) -> None:
        self.ref, self.store, self.forced = ref, store, list(forced)
        self.vocab = ref.cfg["vocab_size"]
        self.states: dict[str, Rows] = {}
        self.compiler = None  # made at the first grammar
        self.handles: dict[str, Rows] = {}
        self.proposals: list[Proposal | None] = []  # one per Propose, None where refused

    def run(self, ops: list[dict[str, Any]]) -> list[Proposal | None]:
        for op in ops:
            self.apply(op)
        return self.proposals

    def apply(self, op: dict[str, Any]) -> None:
        """One operation's effect on the states; a refused one changes nothing."""
        name = op["op"]
        if name == "ProposeStream":
            for msg in op["messages"]:
                self.apply(msg | {"op": "ProposeBatch"})
        elif name == "Propose":
            ok = "expect_error" not in op
            self.proposals.append(self.propose(self.states[op["state"]], op) if ok else None)
        elif "expect_error" in op:
            pass
        elif name == "ProposeBatch":
            for row in batch_rows(op):
                ok = "expect_error" not in row
                self.proposals.append(self.propose(self.states[row["state"]], row) if ok else None)
        elif name == "AllocState":
            self.states[op["state"]] = rows = Rows(self.ref)
            if "grammar" in op:
                rows.grammar = self.matcher(op["grammar"])
            rows.sampling = op.get("sampling")
        elif name == "Prefill":
            self.states[op["state"]].add(op["tokens"], tensor(op["hiddens"]))
        elif name == "AfterVerify":
            verdict(self.states[op["state"]], op["num_accepted"], op.get("refeed_hiddens"))
        elif name == "TakeKV":
            self.handles[op["handle"]] = self.states[op["state"]]
            self.states[op["state"]] = Rows(self.ref)
        elif name == "InstallKV":
            self.states[op["state"]] = self.handles.pop(op["handle"])
        elif name == "FreeState":
            self.states.pop(op["state"], None)

    def matcher(self, grammar: dict[str, Any]) -> xgrammar.GrammarMatcher | None:
        """A fresh matcher of a grammar ({kind: source}); None for {"none": true}."""
        ((kind, source),) = grammar.items()
        if kind == "none":
            return None
        self.compiler = self.compiler or compiler(self.vocab, eos=None)
        return xgrammar.GrammarMatcher(compile_kind(self.compiler, kind, source))

    def trial(self, op: dict[str, Any]) -> Proposal:
        """The proposal a Propose would get now, leaving the states as they are."""
        rows = copy.copy(self.states[op["state"]])
        rows.tokens = list(rows.tokens)
        rows.grammar = rows.grammar and rows.grammar.fork()
        return self.propose(rows, op)

    def propose(self, rows: Rows, op: dict[str, Any]) -> Proposal:
        """A Propose on these rows: the previous verdict, R0, then the chain of drafts."""
        if "previous" in op:
            prev = op["previous"]
            verdict(rows, prev["num_accepted"], prev.get("refeed_hiddens"))
        if "sampling" in op:  # from this step on
            rows.sampling = op["sampling"]
        if "grammar" in op:  # from this step's token on, after the verdict's drafts
            rows.grammar = self.matcher(op["grammar"])
        sampling = rows.sampling if (rows.sampling or {}).get("temperature") else None
        k, stop_at = drafts_asked(op)
        if sampling is not None and k != 1:
            raise ValueError("a sampled proposal of the vector has one draft")
        rows.add([op["token"]], tensor(op["hidden"]))
        rows.commit([op["token"]])
        masks = allowed(op["bitmask"], self.vocab) if "bitmask" in op else None
        floor = op.get("min_confidence", 0.0)
        forced = self.forced[len(self.proposals)] if self.forced else None
        forced_stop = len(forced.drafts) - 1 if forced and forced.stopped else -1
        tokens, hiddens = list(rows.tokens), rows.hiddens
        drafts, outs, stopped = [], [], False
        grammar, walked = rows.grammar, 0
        for j in range(k):
            mask = None if masks is None else masks[min(j, len(masks) - 1)]
            if grammar is not None:
                mask = grammar_allows(grammar, self.vocab) & (True if mask is None else mask)
                if not mask.any():  # the grammar allows nothing more: the chain ends
                    break
            out = self.ref.rows(tokens, hiddens, self.store)[-1]
            logits = self.ref.logits(out, self.store)
            if mask is not None:
                logits = logits.masked_fill(~mask, float("-inf"))
            token = forced.drafts[j].token if forced else int(logits.argmax())
            prob = logits.softmax(-1)[token].item()
            q = None if sampling is None else sampled_q(logits, sampling)
            if q is not None:
                token, prob = q[0][0], q[1][0]
            drafts.append(Draft(token, prob, logits.detach(), q))
            # The running minimum falls below min_confidence where a draft's prob does; a
            # count the drafter chose stops the chain where it cuts it.
            stopped = j == forced_stop if forced else prob < floor or j == stop_at
            if stopped:
                break
            outs.append(out)
            tokens.append(token)
            hiddens = torch.cat([hiddens, out[None]])
            if grammar is not None:
                assert grammar.accept_token(token)
                walked += 1
                if grammar.is_terminated():
                    break
        if walked:
            grammar.rollback(walked)
        proposal = Proposal(drafts, stopped)
        rows.last = ([d.token for d in proposal.kept], outs)
        return proposal


def drafts_asked(op: dict[str, Any]) -> tuple[int, int]:
    """(the drafts a Propose computes, the index of the draft where the drafter's count cuts
    the chain, -1 for none): num_drafts, or with num_drafts 0 the draft cap, cut at 0 when
    verifying a token costs more than a step's drafts can yield."""
    if op["num_drafts"]:
        return op["num_drafts"], -1
    cap, cost = op["draft_cap"], op.get("verify_token_cost", 0.0)
    if cost == 0.0:
        return cap, -1
    if cost > 1.0:
        return cap, 0
    raise ValueError("the oracle knows the drafter's count at verify_token_cost 0 or above 1")


def sampled_q(logits: torch.Tensor, sampling: dict[str, Any]) -> tuple[list[int], list[float]]:
    """q's support, most probable first, and its probabilities: vLLM's processing of the
    logits by `sampling`, cut to MAX_SAMPLE_TOP_K tokens (top_k, when set, cuts it further;
    the vector's q hold no zero past the tokens top_k keeps)."""
    s = sampling
    q = vllm_processed(
        logits,
        s["temperature"],
        s.get("top_k", 0),
        s.get("top_p", 0.0) or 1.0,
        s.get("min_p", 0.0),
        MAX_SAMPLE_TOP_K,
    )
    support = min(s.get("top_k", 0) or MAX_SAMPLE_TOP_K, MAX_SAMPLE_TOP_K)
    probs, ids = q.sort(descending=True, stable=True)
    return ids[:support].tolist(), probs[:support].tolist()


def batches(op: dict[str, Any]) -> list[dict[str, Any]]:
    """The batches an operation sends: a ProposeBatch itself, a ProposeStream's messages
    (each shaped as a ProposeBatch without `op`), none for the others."""
    if op["op"] == "ProposeStream":
        return op["messages"]
    return [op] if op["op"] == "ProposeBatch" else []


def proposes(ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every proposal the operations ask for, in replay order, one per Oracle proposal:
    the Propose operations themselves; the rows of each batch (a ProposeBatch, a
    ProposeStream's message) that does not fail as a whole, as copies shaped as Propose
    operations with the expect their batch holds for them (a failed row with its error)."""
    out: list[dict[str, Any]] = []
    for op in ops:
        if op["op"] == "Propose":
            out.append(op)
        for batch in batches(op):
            out += [] if "expect_error" in batch else batch_rows(batch)
    return out


def batch_rows(op: dict[str, Any]) -> list[dict[str, Any]]:
    """A batch's rows (a ProposeBatch operation or a ProposeStream message), each as the
    Propose operation it stands for.

    As the contract reads the columns: row i of each is state i's; num_drafts and
    min_confidence hold one value per row or one for all (0 or absent: none); a
    num_accepted of -1 (or none given) is no verdict; each row takes its refeed_rows
    rows of refeed_hiddens and its bitmask_rows rows of bitmasks, in order. A row in
    expect.errors carries its error (expect_error, expect_reason, expect_field); the
    others carry the expect that expect's columns hold for them, where it has drafts.
    """
    size = len(op["states"])

    def each(key: str, default: Any) -> list:
        values = op.get(key) or [default]
        return values * size if len(values) == 1 else list(values)

    def split(key: str, counts: list[int]) -> list[np.ndarray | None]:
        rows = raw(op[key]) if key in op else None
        starts = np.cumsum([0, *counts])
        return [rows[a:b] if b > a else None for a, b in itertools.pairwise(starts)]

    hiddens = raw(op["hiddens"])
    accepted = each("num_accepted", -1)
    refeeds = split("refeed_hiddens", each("refeed_rows", 0))
    masks = split("bitmasks", each("bitmask_rows", 0))
    num_drafts, floors = each("num_drafts", None), each("min_confidence", 0.0)
    caps, costs = each("draft_caps", 0), each("verify_token_costs", 0.0)
    sampling = dict(zip(op.get("sampling_rows", []), op.get("sampling", []), strict=True))
    grammars = dict(zip(op.get("grammar_rows", []), op.get("grammars", []), strict=True))
    expect = op.get("expect", {})
    answers = expect.get("one_of", [expect])
    errors = {e["row"]: e for e in expect.get("errors", [])}
    out = []
    for i, state in enumerate(op["states"]):
        row: dict[str, Any] = {"op": "Propose", "state": state, "token": op["tokens"][i]}
        row |= {"position": op["positions"][i], "num_drafts": num_drafts[i]}
        row["hidden"] = encoded(hiddens[i])
        if masks[i] is not None:
            row["bitmask"] = encoded(masks[i])
        if floors[i] != 0.0:
            row["min_confidence"] = floors[i]
        if num_drafts[i] == 0:
            row |= {"draft_cap": caps[i], "verify_token_cost": costs[i]}
        if i in sampling:
            row["sampling"] = sampling[i]
        if i in grammars:
            row["grammar"] = grammars[i]
        if accepted[i] >= 0:
            row["previous"] = {"num_accepted": accepted[i]}
            if refeeds[i] is not None:
                row["previous"]["refeed_hiddens"] = encoded(refeeds[i])
        if i in errors:
            e = errors[i]
            row |= {"expect_error": e["code"], "expect_reason": e["reason"]}
            row |= {"expect_field": e["field"]} if e["field"] else {}
        elif "drafts" in answers[0]:
            rows = unique([row_expect(a, i) for a in answers])
            row["expect"] = rows[0] if len(rows) == 1 else {"one_of": rows}
        out.append(row)
    return out


def row_expect(expect: dict[str, Any], i: int) -> dict[str, Any]:
    """Row i of a batch's expected columns, as a Propose's expect (with its q, if sampled)."""
    n = expect["draft_counts"][i]
    out = {
        "tokens": expect["drafts"][i][:n],
        "probs": expect["probs"][i][:n],
        "confidence": expect["confidences"][i],
        "first_position": expect["first_positions"][i],
    }
    ids = expect.get("q_ids", [[]] * len(expect["draft_counts"]))[i][:n]
    if ids and expect["q_probs"][i][0][0] != 1.0:  # a greedy row's q is its draft at 1
        probs = expect["q_probs"][i][:n]
        support = len(ids[0])
        while support > 1 and all(r[support - 1] == 0.0 for r in probs):
            support -= 1  # the row's own support within the batch's
        cut = [r[:support] for r in ids], [r[:support] for r in probs]
        out = {"tokens": out["tokens"], "probs": out["probs"], "confidence": out["confidence"]}
        out |= {"q_support": support, "q_ids": cut[0], "q_probs": cut[1]}
        out["first_position"] = expect["first_positions"][i]
    return out


def unique(items: list[Any]) -> list[Any]:
    return [x for j, x in enumerate(items) if x not in items[:j]]


def expectations(
    ops: list[dict[str, Any]], exact: list[Proposal | None]
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Each operation or stream message that drafts, with the expect the oracle's
    proposals (`exact`, as Oracle.run gives them) make of it: a Propose's proposal, a
    batch's columns (width: the largest K asked; a row's drafts padded with -1 and its
    probs with 0; a failed row: count 0, confidence 0 and first position 0, its error
    as the batch lists it)."""
    found = iter(exact)
    out = []
    for op in ops:
        if op["op"] == "Propose" and (p := next(found)) is not None:
            out.append((op, p.expect(op["position"])))
        for batch in batches(op):
            if "expect_error" not in batch:
                rows = [next(found) for _ in batch["states"]]
                out.append((batch, batch_expect(batch, rows)))
    if next(found, "end") != "end":
        raise ValueError("more proposals than the operations ask for")
    return out


def batch_expect(op: dict[str, Any], rows: list[Proposal | None]) -> dict[str, Any]:
    """A batch's expected columns; where rows are sampled, one set for each combination of
    their drafts' tokens (`one_of`), each with the q columns."""
    choices = [
        p.expect(pos)["one_of"] if p and p.sampled else [p.expect(pos) if p else None]
        for p, pos in zip(rows, op["positions"], strict=True)
    ]
    answers = [batch_columns(op, list(pick), rows) for pick in itertools.product(*choices)]
    return answers[0] if len(answers) == 1 else {"one_of": answers}


def batch_columns(
    op: dict[str, Any], picks: list[dict[str, Any] | None], rows: list[Proposal | None]
) -> dict[str, Any]:
    """The columns of one answer: width the largest K asked (the cap for a K left to the
    drafter), a row's drafts padded with -1 and its probs with 0; a failed row: count 0,
    confidence 0 and first position 0, its error as the batch lists it. Where a row is
    sampled, q's columns [B, width, support]: a greedy row's q its draft at 1, zeros past a
    row's count."""
    width = max(
        drafts_asked(r)[0] for r in batch_rows({k: v for k, v in op.items() if k != "expect"})
    )
    out: dict[str, Any] = {"width": width, "drafts": [], "probs": [], "draft_counts": []}
    out |= {"confidences": [], "first_positions": []}
    for e in picks:
        e = e or {"tokens": [], "probs": []}
        n = len(e["tokens"])
        out["drafts"].append(e["tokens"] + [-1] * (width - n))
        out["probs"].append(e["probs"] + [0.0] * (width - n))
        out["draft_counts"].append(n)
        out["confidences"].append(e.get("confidence", 0.0))
        out["first_positions"].append(e.get("first_position", 0))
    if any(p is not None and p.sampled for p in rows):
        support = max(e["q_support"] for e in picks if e and "q_support" in e)
        out |= {"q_support": support, "q_ids": [], "q_probs": []}
        for e in picks:
            ids = e.get("q_ids") if e else None
            probs = e.get("q_probs") if e else None
            if ids is None:  # greedy (or failed): each draft its own q
                ids = [[t] for t in (e or {"tokens": []})["tokens"]]
                probs = [[1.0] for _ in ids]
            pad = width - len(ids)
            out["q_ids"].append([r + [0] * (support - len(r)) for r in ids] + [[0] * support] * pad)
            out["q_probs"].append(
                [r + [0.0] * (support - len(r)) for r in probs] + [[0.0] * support] * pad
            )
    return out | {"errors": op.get("expect", {}).get("errors", [])}


def verdict(rows: Rows, accepted: int, refeed: dict[str, Any] | None) -> None:
    rows.commit(rows.last[0][:accepted])
    rows.verdict(accepted, None if refeed is None else tensor(refeed))


@dataclass
class Deviation:
    """An emulated run's drafts against the exact ones, one value per draft."""

    prob: np.ndarray  # prob - exact prob, the prob as the wire's float32 carries it
    lead: np.ndarray  # the largest change of the draft's logit lead over an allowed token
    runner_up: np.ndarray  # the change of its lead over the exact runner-up (signed)


def deviation(exact: list[Proposal | None], other: list[Proposal | None]) -> Deviation:
    prob, lead, runner_up = [], [], []
    for e, o in zip(exact, other, strict=True):
        for de, do in zip(e.drafts if e else [], o.drafts if o else [], strict=True):
            prob.append(float(np.float32(do.prob)) - de.prob)
            ok = torch.isfinite(de.logits)
            change = (do.logits[de.token] - do.logits) - (de.logits[de.token] - de.logits)
            lead.append(float(change[ok].abs().max()))
            if de.q is not None:  # each q probability, and the order of q's ranked tokens
                got = dict(zip(*do.q, strict=True))
                moved = [float(np.float32(got.get(t, 0.0))) - p for t, p in zip(*de.q, strict=True)]
                prob[-1] = max(moved, key=abs)
                order = de.logits.topk(len(de.q[0]) + 1).indices
                gaps = de.logits[order].diff() - do.logits[order].diff()
                lead[-1] = max(lead[-1], float(gaps.abs().max()))
            second = de.logits.topk(2).indices[1]
            # Where one token alone is allowed (a grammar's), none can overtake it.
            runner_up.append(float(change[second]) if ok[second] else 0.0)
    return Deviation(np.array(prob), np.array(lead), np.array(runner_up))


def margins(exact: list[Proposal | None]) -> list[float]:
    """Each exact draft's lead over the runner-up among the tokens its bitmask allows; a
    sampled draft's smallest gap between the logits of q's support, in order, and the
    next token."""
    out = []
    for p in exact:
        for d in p.drafts if p else []:
            out.append(float(-d.ranked().diff().max()))  # the smallest gap of the ranking
    return out


def reduction_length(ref: Reference) -> int:
    """K, the most terms any one sum of the forward adds (a GEMM's inner size, a softmax)."""
    c = ref.cfg
    return max(2 * c["hidden_size"], c["intermediate_size"], c["vocab_size"])


@dataclass
class ErrorModel:
    """A valid implementation keeps values of `dtype`: each with a relative error up to
    `u`, its rounding plus the accumulation in fp32 of a sum of up to K terms."""

    dtype: str
    rounding: Store
    u: float
    prob_u: float  # the relative error of a probability computed in fp32 from the logits

    @classmethod
    def of(cls, dtype: str, ref: Reference) -> ErrorModel:
        accumulation = math.sqrt(reduction_length(ref)) * FP32_U
        rounding, u = {"bfloat16": (to_bf16, BF16_U), "float32": (to_fp32, FP32_U)}[dtype]
        return cls(dtype, rounding, u + accumulation, FP32_U + accumulation)


def two_digits_up(x: float) -> float:
    """x rounded up to two significant digits."""
    exponent = math.floor(math.log10(x)) - 1
    digits = math.ceil(round(x / 10.0**exponent, 9))  # 0.082 stays 82, not 83
    return float(f"{digits}e{exponent}")


def emulate(
    ref: Reference,
    ops: list[dict[str, Any]],
    exact: list[Proposal | None],
    model: ErrorModel,
    draws: int,
    seed: int,
) -> dict[str, float]:
    """The worst deviations of the oracle's drafts under `model`: one run rounding every
    kept value to the dtype (nearest even), `draws` runs perturbing each by up to u."""
    probs = np.array([d.prob for p in exact for d in (p.drafts if p else [])])
    rounded = deviation(exact, Oracle(ref, model.rounding, exact).run(ops))
    gen = torch.Generator().manual_seed(seed)
    runs = [
        deviation(exact, Oracle(ref, perturbed(model.u, gen), exact).run(ops)) for _ in range(draws)
    ]
    # The probability's own fp32 error (softmax, up to K terms) adds at most prob_u * p.
    prob = np.abs(np.stack([rounded.prob, *(r.prob for r in runs)])) + model.prob_u * probs
    lead = np.stack([rounded.lead, *(r.lead for r in runs)])
    return {
        "unit_roundoff": model.u,
        "rounded_prob_deviation": float(np.abs(rounded.prob).max()),
        "rounded_lead_deviation": float(rounded.lead.max()),
        "worst_prob_deviation": float(prob.max()),
        "worst_lead_deviation": float(lead.max()),
        "prob_sigma": float(np.stack([r.prob for r in runs]).std(0).max()),
        "lead_sigma": float(np.stack([r.runner_up for r in runs]).std(0).max()),
    }
