"""Hypothesis-generated requests for every RPC, through the raw generated stub.

Random fields, byte lengths, dtypes (invalid enum values included), shapes, ids, huge
and negative numbers, bitmasks, malformed Prefill chunk sequences, ProposeBatch columns
of random rows (and columns that do not fit together) and ProposeStream lists of them.
For every example:

- only documented status codes come back (a failed row's Error.code too; for a stream,
  every message is answered, and each answer's error is documented too): never
  UNKNOWN, INTERNAL or a crash;
- a failed call (or row) changes nothing: GetInfo's counters are as before, and (every few
  examples, and at the end) the reference states' next proposals are still the ones a
  twin state with the same rows gives;
- a call that succeeded is cleaned up after, and then the server must hold nothing.

Deterministic and bounded in CI (derandomize, MTPDRAFT_FUZZ_EXAMPLES examples per RPC,
150 by default); MTPDRAFT_FUZZ_RANDOM=1 draws fresh examples instead. The codes seen
are printed at the end of the module (pytest -s) and written to the JSON file named by
MTPDRAFT_FUZZ_REPORT, if set.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter, defaultdict
from collections.abc import Iterable

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_support import (
    DOCUMENTED,
    DOCUMENTED_VALUES,
    PATIENCE,
    H,
    ManagedServer,
    V,
    hiddens,
    prefilled,
    server_args,
    tensor,
)

from mtpdraft.client import DrafterClient
from mtpdraft.client.errors import from_rpc_error
from mtpdraft.v1 import drafter_pb2 as pb

EXAMPLES = int(os.environ.get("MTPDRAFT_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    derandomize=os.environ.get("MTPDRAFT_FUZZ_RANDOM", "") != "1",
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
WORDS = (V + 31) // 32
CHECK_EVERY = 8  # failed examples that named a reference between full reference checks
TIMEOUT = PATIENCE  # a call's deadline: only a failure reaches it

# ---- the reference states ------------------------------------------------------------

X, Y = 17, 42  # the tokens of the reference proposals
HX, HY = hiddens(1, 501)[0], hiddens(1, 502)[0]


class Harness:
    """A server with three reference states and a KV handle, and the check of each example.

    idle: 5 rows, nothing pending. pending: 5 rows and a pending proposal of 3 drafts at
    position 6. empty: allocated, no rows. handle: the KV of a 3-row state.
    """

    def __init__(self, server: ManagedServer) -> None:
        self.server, self.stub = server, server.stub
        self.client = DrafterClient(server.address, timeout=TIMEOUT)
        self.codes: dict[str, Counter] = defaultdict(Counter)
        self.examples: Counter = Counter()
        self.reference_checks = 0
        self._since_check = 0
        # What the references' next proposals must be, from twins with the same rows.
        twin = prefilled(self.client, 5, 1)
        self.expect_idle = self.client.propose(twin, X, HX, 6, 3).tokens
        self.client.after_verify(twin, 1)
        self.expect_pending = self.client.propose(twin, Y, HY, 8, 2).tokens
        self.client.free_state(twin)
        self.make_references()

    def make_references(self) -> None:
        c = self.client
        self.refs = {"idle": prefilled(c, 5, 1), "pending": prefilled(c, 5, 1)}
        c.propose(self.refs["pending"], X, HX, 6, 3)
        self.refs["empty"] = c.alloc_state()
        donor = prefilled(c, 3, 2)
        self.handle = c.take_kv(donor).handle_id
        c.free_state(donor)
        self.baseline = self.counters()

    def counters(self) -> tuple:
        info = self.server.info()
        return info.live_states, info.kv_handles, info.kv_blocks_free

    def state(self, name: str | int) -> int:
        return self.refs.get(name, name) if isinstance(name, str) else name

    def handle_id(self, name: str | int) -> int:
        return self.handle if name == "ref" else name

    def free_everything(self, states: Iterable[int], handles: Iterable[int]) -> None:
        c = self.client
        for handle in [self.handle, *handles]:
            scratch = c.alloc_state()
            try:
                c.install_kv(scratch, handle)
            except Exception as err:  # consumed already
                assert getattr(err, "code", None) == grpc.StatusCode.NOT_FOUND, err
            c.free_state(scratch)
        for state in [*self.refs.values(), *states]:
            c.free_state(state)
        info = self.server.info()
        assert (info.live_states, info.kv_handles) == (0, 0), "a state or handle leaked"
        assert info.kv_blocks_free == info.kv_blocks_total, "KV blocks leaked"

    def check_references(self) -> None:
        """Destructive: the references propose what their twins did; then they are remade."""
        c = self.client
        assert c.propose(self.refs["idle"], X, HX, 6, 3).tokens == self.expect_idle
        c.after_verify(self.refs["pending"], 1)
        assert c.propose(self.refs["pending"], Y, HY, 8, 2).tokens == self.expect_pending
        assert c.install_kv(self.refs["empty"], self.handle).num_rows == 3
        self.handle = 0
        self.reference_checks += 1
        self.free_everything([], [])
        self.make_references()

    def record(
        self,
        rpc: str,
        codes: list[grpc.StatusCode],
        *,
        named_reference: bool,
        new_states: Iterable[int] = (),
        new_handles: Iterable[int] = (),
    ) -> None:
        """Checks one example's outcome; cleans up after one that succeeded."""
        self.examples[rpc] += 1
        for code in codes:
            self.codes[rpc][code.name] += 1
        assert self.server.alive(), "the server died:\n" + self.server.log[-3000:]
        undocumented = [code for code in codes if code not in DOCUMENTED]
        assert not undocumented, f"{rpc}: undocumented status {undocumented}"
        if grpc.StatusCode.OK in codes:  # something may have changed: start afresh
            self.free_everything(new_states, new_handles)
            self.make_references()
            return
        assert self.counters() == self.baseline, f"{rpc}: a failed call changed the counters"
        if named_reference:
            self._since_check += 1
            if self._since_check >= CHECK_EVERY:
                self._since_check = 0
                self.check_references()


@pytest.fixture(scope="module")
def harness(mimo_checkpoint):
    server = ManagedServer(mimo_checkpoint, *server_args(600.0))
    h = Harness(server)
    yield h
    h.check_references()
    assert server.health() == health_pb2.HealthCheckResponse.SERVING
    assert server.stop() == 0
    server.assert_no_traceback()
    summary = {
        "examples": dict(h.examples),
        "codes": {rpc: dict(codes) for rpc, codes in sorted(h.codes.items())},
        "reasons": {rpc: dict(r) for rpc, r in sorted(REASONS.items()) if rpc},
        "reference_checks": h.reference_checks,
    }
    print("\nfuzz summary: " + json.dumps(summary))
    if path := os.environ.get("MTPDRAFT_FUZZ_REPORT"):
        with open(path, "w") as f:
            json.dump(summary, f, indent=2)


REASONS: dict[str, Counter] = defaultdict(Counter)  # rpc -> ErrorInfo reason -> count


def code_of(call, request, rpc: str = ""):
    """Calls the stub: (status code, response or None); counts the error's reason."""
    try:
        return grpc.StatusCode.OK, call(request, timeout=TIMEOUT)
    except grpc.RpcError as err:
        REASONS[rpc][from_rpc_error(err).reason or err.code().name] += 1
        return err.code(), None


# ---- strategies ----------------------------------------------------------------------


def mostly(usual: st.SearchStrategy, other: st.SearchStrategy, odds: int = 4) -> st.SearchStrategy:
    """`usual` in odds - 1 draws of odds, else `other` (hypothesis favours the usual one,
    whose choice is the simplest: so that the checks past the first are reached too)."""
    return st.integers(0, odds - 1).flatmap(lambda i: other if i == odds - 1 else usual)


HUGE = [2**31 - 1, 2**31, 2**32, 2**62, 2**63 - 1]
int32s = st.one_of(st.integers(-(2**31), 2**31 - 1), st.sampled_from([-(2**31), -1, 0, 2**31 - 1]))
int64s = st.one_of(st.integers(-(2**63), 2**63 - 1), st.sampled_from([-(2**63), -1, *HUGE]))
uint64s = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2**63, 2**64 - 1]))
dtypes = st.one_of(st.sampled_from([0, 1, 2, 3, 4]), int32s)  # invalid enum values too
dims = st.one_of(
    st.sampled_from([0, 1, 2, 3, H - 1, H, H + 1, WORDS, 2 * H]),
    st.integers(-3, 300),
    st.sampled_from([-(2**63), *HUGE]),
)
ITEMSIZE = {1: 2, 2: 2, 3: 4, 4: 4}


@st.composite
def random_tensors(draw) -> pb.Tensor:
    dtype, shape = draw(dtypes), draw(st.lists(dims, max_size=4))
    size = math.prod(shape) * ITEMSIZE.get(dtype, 4) if all(d >= 0 for d in shape) else -1
    if 0 <= size <= 1 << 16 and draw(st.booleans()):  # a byte count that matches
        data = draw(st.binary(min_size=size, max_size=size))
    else:
        data = draw(st.binary(max_size=512))
    return pb.Tensor(dtype=dtype, shape=shape, data=data)


def _good_hidden(rows: int | None, dtype: int, seed: int) -> pb.Tensor:
    values = hiddens(1, seed)[0] if rows is None else hiddens(rows, seed)
    if dtype == pb.DTYPE_FP32:
        return tensor(values)
    if dtype == pb.DTYPE_FP16:
        data = values.astype("<f2").tobytes()
    else:  # bf16: the high half of each fp32
        data = (values.astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()
    return pb.Tensor(dtype=dtype, shape=list(values.shape), data=data)


def hidden_tensors(rows: int | None = None) -> st.SearchStrategy[pb.Tensor]:
    """Mostly well-formed hiddens (so that later checks are reached), sometimes anything."""
    good = st.builds(
        _good_hidden,
        st.just(rows) if rows is not None else st.sampled_from([None, 1]),
        st.sampled_from([3, 1, 2]),
        st.integers(0, 3),
    )
    special = st.builds(
        lambda v, shape: pb.Tensor(
            dtype=pb.DTYPE_FP32, shape=shape, data=np.full(math.prod(shape), v, "<f4").tobytes()
        ),
        st.sampled_from([np.nan, np.inf, -np.inf, 0.0, 3.4e38, -1e-45]),
        st.sampled_from([[H], [1, H], [2, H], [H, 1]]),
    )
    return mostly(good, st.one_of(special, random_tensors()))


def _mask(rows: list[list[int]], flat: bool) -> pb.Tensor:
    array = np.asarray(rows, dtype="<i4")
    if flat:
        array = array[0]
    return pb.Tensor(dtype=pb.DTYPE_INT32, shape=list(array.shape), data=array.tobytes())


words = st.one_of(st.sampled_from([-1, 0, 1, 2**31 - 1, -(2**31)]), int32s)
bitmasks = st.one_of(
    st.builds(
        _mask,
        st.integers(1, 9).flatmap(
            lambda n: st.lists(
                st.lists(words, min_size=1, max_size=WORDS + 1), min_size=n, max_size=n
            ).filter(lambda rows: len({len(r) for r in rows}) == 1)
        ),
        st.booleans(),
    ),
    random_tensors(),
)
# Mostly the references (so that the checks past NOT_FOUND are reached), sometimes any id.
state_names = mostly(st.sampled_from(["idle", "pending", "empty"]), uint64s, odds=6)
# The position each reference's next row must have (for pending: with no verdict).
NEXT = {"idle": 6, "pending": 6, "empty": 1}


@st.composite
def verdicts(draw, k: int = 3) -> pb.Verdict:
    accepted = draw(mostly(st.integers(0, k), st.one_of(st.integers(-1, k + 2), int32s)))
    verdict = pb.Verdict(num_accepted=accepted)
    if draw(st.integers(0, 2)) == 2:  # a refeed, usually of the right shape
        rows = draw(mostly(st.just(max(0, min(accepted, 8))), st.integers(0, 5)))
        verdict.refeed_hiddens.CopyFrom(draw(hidden_tensors(rows)))
    return verdict


@st.composite
def propose_requests(draw, harness: Harness):
    """Usually plausible for the state it names, with one or more fields gone wrong."""
    name = draw(state_names)
    with_previous = name == "pending"
    if draw(st.integers(0, 4)) == 4:
        with_previous = not with_previous
    previous = draw(verdicts()) if with_previous else None
    position = NEXT.get(name, 1)
    if previous is not None:
        position = 7 + previous.num_accepted
    request = pb.ProposeRequest(
        state_id=harness.state(name),
        token=draw(mostly(st.integers(0, V - 1), int32s)),
        position=draw(mostly(st.just(position), int64s)),
        num_drafts=draw(mostly(st.integers(1, 8), st.one_of(st.sampled_from([0, 9]), int32s))),
        min_confidence=draw(
            mostly(st.just(0.0), st.floats(width=32, allow_nan=True, allow_infinity=True))
        ),
    )
    if draw(st.integers(0, 9)) < 9:
        request.hidden.CopyFrom(draw(hidden_tensors()))
    if draw(st.integers(0, 3)) == 3:
        request.bitmask.CopyFrom(draw(bitmasks))
    if previous is not None:
        request.previous.CopyFrom(previous)
    return request, name in harness.refs


def _counts(draw, usual: list[int]) -> list[int]:
    """A column of row counts: usually `usual`, sometimes of any length and values."""
    return draw(mostly(st.just(usual), st.lists(st.integers(-1, 4), max_size=len(usual) + 1)))


@st.composite
def batch_requests(draw, harness: Harness) -> tuple[pb.ProposeBatchRequest, bool]:
    """Columns of up to 6 rows, each usually plausible for the state it names (as
    propose_requests draws a request), with one or more values gone wrong; the columns
    usually fit together (lengths, tensors' rows), sometimes not."""
    names = draw(st.lists(state_names, min_size=draw(mostly(st.just(1), st.just(0))), max_size=6))
    size = len(names)
    accepted = []
    for name in names:
        with_verdict = (name == "pending") != (draw(st.integers(0, 4)) == 4)
        verdict = mostly(st.integers(0, 3), st.one_of(st.integers(-2, 5), int32s))
        accepted.append(draw(verdict) if with_verdict else -1)
    request = pb.ProposeBatchRequest(
        request_id=draw(uint64s),
        state_ids=[harness.state(n) for n in names],
        tokens=[draw(mostly(st.integers(0, V - 1), int32s)) for _ in names],
        positions=[
            draw(mostly(st.just(NEXT.get(n, 1) if a < 0 else 7 + a), int64s))
            for n, a in zip(names, accepted, strict=True)
        ],
        num_drafts=draw(
            mostly(
                st.lists(st.integers(1, 8), min_size=size, max_size=size),
                st.lists(st.one_of(st.integers(0, 9), int32s), max_size=size + 1),
            )
        ),
        min_confidence=draw(
            mostly(
                st.just([]),
                st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), max_size=7),
            )
        ),
    )
    if draw(st.integers(0, 9)) < 9:
        request.hiddens.CopyFrom(draw(hidden_tensors(size)))
    if any(a >= 0 for a in accepted):
        request.num_accepted.extend(draw(mostly(st.just(accepted), st.lists(int32s, max_size=7))))
    if draw(st.integers(0, 2)) == 2:  # refeeds, each of a state's accepted rows or none
        counts = _counts(draw, [max(a, 0) * draw(st.integers(0, 1)) for a in accepted])
        request.refeed_rows.extend(counts)
        # A verdict's count may be any int32: the rows stay few (a count past them is a
        # mismatch to refuse, not a tensor to allocate).
        request.refeed_hiddens.CopyFrom(draw(hidden_tensors(min(max(sum(counts), 0), 64))))
    if size and draw(st.integers(0, 3)) == 3:  # one state's bitmask
        mask = draw(bitmasks)
        rows = [0] * size
        shape = list(mask.shape)
        rows[draw(st.integers(0, size - 1))] = shape[0] if len(shape) == 2 and shape[0] < 10 else 1
        request.bitmask_rows.extend(_counts(draw, rows))
        request.bitmasks.CopyFrom(mask)
    return request, any(n in harness.refs for n in names)


def answer_codes(answer: pb.ProposeBatchResponse, rpc: str) -> list[grpc.StatusCode]:
    """A batch's answer as a code per row (a failed row's error documented and counted),
    or its error's code for a message that failed as a whole."""
    errors = [answer.error] if answer.HasField("error") else [e.error for e in answer.errors]
    for error in errors:
        assert error.code in DOCUMENTED_VALUES, error
        assert error.code != 0 and error.message
        REASONS[rpc][error.reason] += 1
    if answer.HasField("error"):
        return [next(c for c in DOCUMENTED if c.value[0] == answer.error.code)]
    failed = {e.row: e.error.code for e in answer.errors}
    return [
        next(c for c in DOCUMENTED if c.value[0] == failed.get(row, 0))
        for row in range(len(answer.draft_counts))
    ]


# ---- the RPCs ------------------------------------------------------------------------


def test_get_info_and_alloc_state_repeatedly(harness: Harness) -> None:
    """No fields to fuzz: each is called many times, and changes nothing it should not."""
    for _ in range(EXAMPLES // 3):
        code, _ = code_of(harness.stub.GetInfo, pb.GetInfoRequest(), "GetInfo")
        harness.record("GetInfo", [code], named_reference=False)
    for _ in range(EXAMPLES // 8):  # each success is followed by a full clean-up
        code, resp = code_of(harness.stub.AllocState, pb.AllocStateRequest(), "AllocState")
        new_states = [resp.state_id] if resp is not None else []
        harness.record("AllocState", [code], named_reference=False, new_states=new_states)


@FUZZ
@given(name=state_names)
def test_fuzz_free_state(harness: Harness, name) -> None:
    code, resp = code_of(harness.stub.FreeState, pb.FreeStateRequest(state_id=harness.state(name)))
    assert code == grpc.StatusCode.OK  # idempotent: unknown ids succeed too
    assert resp.existed == (name in harness.refs)
    if resp.existed:
        harness.record("FreeState", [code], named_reference=True)
    else:  # nothing was freed, and nothing may change
        harness.record("FreeState", [], named_reference=False)
        harness.codes["FreeState"][code.name] += 1


@FUZZ
@given(data=st.data())
def test_fuzz_propose(harness: Harness, data) -> None:
    request, named = data.draw(propose_requests(harness))
    code, _ = code_of(harness.stub.Propose, request, "Propose")
    harness.record("Propose", [code], named_reference=named)


@FUZZ
@given(data=st.data())
def test_fuzz_propose_batch(harness: Harness, data) -> None:
    request, named = data.draw(batch_requests(harness))
    code, resp = code_of(harness.stub.ProposeBatch, request, "ProposeBatch")
    codes = [code]
    if resp is not None:
        assert not resp.HasField("error")  # a unary call fails with its status instead
        assert len(resp.draft_counts) == len(request.state_ids)
        codes = answer_codes(resp, "ProposeBatch")
    harness.record("ProposeBatch", codes, named_reference=named)


@FUZZ
@given(data=st.data())
def test_fuzz_propose_stream(harness: Harness, data) -> None:
    drawn = data.draw(st.lists(batch_requests(harness), min_size=1, max_size=4))
    requests = [r for r, _ in drawn]
    for i, request in enumerate(requests):  # distinct ids, so that every answer is matched
        request.request_id = i + 1
    answers, code = [], grpc.StatusCode.OK
    try:
        answers = list(harness.stub.ProposeStream(iter(requests), timeout=TIMEOUT))
    except grpc.RpcError as err:
        code = err.code()
    assert code == grpc.StatusCode.OK, f"the stream ended with {code}"
    ids = sorted(a.request_id for a in answers)
    assert ids == list(range(1, len(requests) + 1)), f"answered {ids} of {len(requests)}"
    codes = [c for answer in answers for c in answer_codes(answer, "ProposeStream")]
    harness.record("ProposeStream", codes, named_reference=any(n for _, n in drawn))


@FUZZ
@given(data=st.data())
def test_fuzz_after_verify(harness: Harness, data) -> None:
    name = data.draw(mostly(st.just("pending"), state_names, odds=3))
    request = pb.AfterVerifyRequest(state_id=harness.state(name))
    if data.draw(st.integers(0, 9)) < 9:
        request.verdict.CopyFrom(data.draw(verdicts()))
    code, _ = code_of(harness.stub.AfterVerify, request, "AfterVerify")
    harness.record("AfterVerify", [code], named_reference=name in harness.refs)


@FUZZ
@given(name=state_names)
def test_fuzz_take_kv(harness: Harness, name) -> None:
    request = pb.TakeKVRequest(state_id=harness.state(name))
    code, resp = code_of(harness.stub.TakeKV, request, "TakeKV")
    handles = [resp.handle_id] if resp is not None else []
    harness.record("TakeKV", [code], named_reference=name in harness.refs, new_handles=handles)


@FUZZ
@given(name=state_names, handle=mostly(st.just("ref"), uint64s, odds=3))
def test_fuzz_install_kv(harness: Harness, name, handle) -> None:
    request = pb.InstallKVRequest(state_id=harness.state(name), handle_id=harness.handle_id(handle))
    code, _ = code_of(harness.stub.InstallKV, request, "InstallKV")
    named = name in harness.refs or handle == "ref"
    harness.record("InstallKV", [code], named_reference=named)


@st.composite
def prefill_chunks(draw, harness: Harness) -> tuple[list[pb.PrefillChunk], bool]:
    """Chunk sequences, mostly plausible (so that deep checks are reached), often broken."""
    name = draw(state_names)
    start = draw(mostly(st.just(NEXT.get(name, 1)), int64s))
    chunks = []
    for i in range(draw(mostly(st.integers(1, 4), st.just(0), odds=10))):
        chunk = pb.PrefillChunk()
        if i == 0 or draw(st.integers(0, 3)) == 3:  # later chunks: usually unset
            later = draw(mostly(st.just(name), state_names)) if i else name
            chunk.state_id = harness.state(later)
            chunk.start_position = draw(mostly(st.just(start), int64s))
        n = draw(st.integers(0, 6))
        tokens = st.lists(mostly(st.integers(0, V - 1), int32s, odds=8), min_size=n, max_size=n)
        chunk.tokens.extend(draw(tokens))
        if draw(st.integers(0, 7)) < 7:
            chunk.hiddens.CopyFrom(
                draw(hidden_tensors(draw(mostly(st.just(n), st.integers(0, 8)))))
            )
        chunks.append(chunk)
    return chunks, name in harness.refs


@FUZZ
@given(data=st.data())
def test_fuzz_prefill(harness: Harness, data) -> None:
    chunks, named = data.draw(prefill_chunks(harness))
    code, _ = code_of(harness.stub.Prefill, iter(chunks), "Prefill")
    harness.record("Prefill", [code], named_reference=named)


# ---- pinned cases --------------------------------------------------------------------


def test_an_oversized_prefill_chunk_is_refused_and_changes_nothing(harness: Harness) -> None:
    rows = 16 * 1024 * 1024 // (H * 4) + 16  # just over the 16 MiB message limit
    chunk = pb.PrefillChunk(state_id=harness.refs["idle"], start_position=6)
    chunk.tokens.extend([1] * rows)
    chunk.hiddens.CopyFrom(tensor(np.zeros((rows, H), np.float32)))
    code, _ = code_of(harness.stub.Prefill, iter([chunk]))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    harness.record("Prefill", [code], named_reference=True)
    harness.check_references()


HUGE_EMPTY = pb.Tensor(dtype=pb.DTYPE_FP32, shape=[0, 2**63 - 1, 2**63 - 1], data=b"")


@pytest.fixture(scope="module")
def plain_server(mimo_checkpoint):
    """A server of its own for the pinned bug below (it logs the bug's tracebacks)."""
    server = ManagedServer(mimo_checkpoint, *server_args(600.0))
    yield server
    server.stop()


@pytest.mark.parametrize("rpc", ["Propose", "ProposeBatch", "ProposeStream", "Prefill"])
def test_huge_empty_shapes_are_invalid_argument(plain_server: ManagedServer, rpc: str) -> None:
    stub = plain_server.stub
    with DrafterClient(plain_server.address, timeout=TIMEOUT) as c:
        state = prefilled(c, 5, 1)
        request = pb.ProposeRequest(
            state_id=state, token=1, hidden=HUGE_EMPTY, position=6, num_drafts=2
        )
        batch = pb.ProposeBatchRequest(
            request_id=7, state_ids=[state], tokens=[1], positions=[6], num_drafts=[2],
            hiddens=HUGE_EMPTY,
        )  # fmt: skip
        try:
            if rpc == "Propose":
                code, _ = code_of(stub.Propose, request)
                assert code == grpc.StatusCode.INVALID_ARGUMENT, code
            elif rpc == "ProposeBatch":
                code, _ = code_of(stub.ProposeBatch, batch)
                assert code == grpc.StatusCode.INVALID_ARGUMENT, code
            elif rpc == "ProposeStream":
                answers = list(stub.ProposeStream(iter([batch]), timeout=TIMEOUT))
                assert [a.request_id for a in answers] == [7], "the message was never answered"
                assert answers[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            else:
                chunk = pb.PrefillChunk(state_id=state, start_position=6, hiddens=HUGE_EMPTY)
                code, _ = code_of(stub.Prefill, iter([chunk]))
                assert code == grpc.StatusCode.INVALID_ARGUMENT, code
        finally:
            c.free_state(state)
