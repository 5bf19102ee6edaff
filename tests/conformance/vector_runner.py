"""Replays the conformance vector (vector.json beside this file) with the Python client.

The vector is one list of operations that the Python, Node.js, Go and C++ runners all
replay in order against one live server (`python3 -m mtpdraft serve --device cpu`,
the embedded default model). Each operation names its RPC (`op`), its inputs and
either `expect` (output fields, compared exactly except `probs` and `confidence`,
which are compared within `prob_tolerance`) or `expect_error` (a gRPC status code
name) with `expect_reason` (its google.rpc.ErrorInfo reason) and, where the server
names one, `expect_field` (the request field at fault). States and KV handles are
named ("A", "H1"): AllocState and TakeKV bind a name to the id the server returns (an
AllocState's optional `grammar` is one key, the kind: "json_schema", "ebnf", "regex" or
"structural_tag", to its source text; its optional `sampling` the SamplingParams fields,
temperature, top_k, top_p, min_p and seed, each absent 0);
the other operations look the name up. Tensors
are `{"dtype": "DTYPE_FP32" | "DTYPE_INT32", "shape": [...], "data": base64}`, the raw
little-endian bytes sent as they are. A Proposal's `state_id` must equal the state's
id, and every id the server returns must be non-zero.

A Propose may carry `sampling` and `grammar` (the state's from this step on; a grammar
as AllocState's, or `{"none": true}`: none) and, with num_drafts 0,
`draft_cap` and `verify_token_cost`; its expect may list `q_support`, `q_ids` and
`q_probs` ([K][support]).

ProposeBatch sends one ProposeBatchRequest built from its columns (`states` names the
rows' states; `sampling_rows` with `sampling`, `grammar_rows` with `grammars`,
`draft_caps` and `verify_token_costs` among them); its expect holds the answer's columns
(`drafts` and `probs` as B rows of `width` values; `q_support`, and `q_ids` and
`q_probs` as [B][width][support], where listed) and the failed rows' `errors` (row, code
name, reason, field), or `expect_error` for a message that fails as a whole (the call's
status).

A sampled draft is the server's draw, which depends on the state's id: an expect whose
answer has more than one possible value lists them all as `one_of`, and the answer must
match one of them.

ProposeStream opens one stream and sends its `messages` (each shaped as a ProposeBatch
operation without `op`) one at a time, each answered before the next; a message that
fails as a whole is answered with its error value (`expect_error`, `expect_reason`,
`expect_field`: its code name, reason and field), and the stream stays open.

A runner refuses a malformed vector before any call (check_vector): a wrong
`format`, a missing `prob_tolerance`, missing or empty `operations`, an unknown `op`,
a ProposeStream without messages, a ProposeBatch or a stream message without states
or without hiddens.

`Replayer(client, tolerance=t).run(ops)` checks (`variant` gives the operations and the
tolerance for the vector's server or its float32 variant); as a command it replays a
vector against a server:

    python3 tests/conformance/vector_runner.py --address HOST:PORT [--vector PATH]
"""

from __future__ import annotations

import argparse
import base64
import functools
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mtpdraft.client import (
    BatchResult,
    DrafterClient,
    DrafterError,
    Grammar,
    SamplingParams,
    Verdict,
)
from mtpdraft.client import messages as client_messages

VECTOR_PATH = Path(__file__).with_name("vector.json")
FORMAT = "mtpdraft-conformance/4"
OPERATIONS = frozenset(
    {"GetInfo", "AllocState", "Prefill", "Propose", "ProposeBatch", "ProposeStream"}
    | {"AfterVerify", "TakeKV", "InstallKV", "FreeState"}
)

#: Server environments under which torch runs the kernels of other x86-64 CPUs: oneDNN's
#: (the bf16 GEMMs), MKL's (the fp32 ones) and ATen's own vectorized kernels.
OTHER_CPUS = {
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    | {"ATEN_CPU_CAPABILITY": "avx2"},
    "baseline": {"ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}
    | {"ATEN_CPU_CAPABILITY": "default"},
}

_STORAGE = {"DTYPE_FP32": "<f4", "DTYPE_FP16": "<f2", "DTYPE_INT32": "<i4"}
_DTYPE_ENUM = {"bfloat16": "DTYPE_BF16", "float16": "DTYPE_FP16", "float32": "DTYPE_FP32"}
_FLOAT_KEYS = frozenset({"probs", "confidence", "confidences", "q_probs"})

#: GetInfo fields fixed by the model and the server's default options (not live counters).
STATIC_INFO_FIELDS = (
    "model_family",
    "hidden_size",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "compute_dtype",
    "hidden_dtypes",
    "device",
    "max_drafts",
    "max_batch",
    "max_states",
    "kv_block_size",
    "kv_blocks_total",
    "state_ttl_seconds",
    "max_message_bytes",
    "bitmask_words",
    "draining",
)


class VectorError(ValueError):
    """A vector no runner may replay."""


def check_vector(vector: Any) -> None:
    """Raises VectorError, naming the fault, unless `vector` is one a runner may replay."""
    if not isinstance(vector, dict):
        raise VectorError("the vector is not a JSON object")
    if vector.get("format") != FORMAT:
        raise VectorError(f"format is {vector.get('format')!r}, not {FORMAT!r}")
    tol = vector.get("prob_tolerance")
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 <= tol < math.inf:
        raise VectorError(f"prob_tolerance is {tol!r}, not a non-negative number")
    ops = vector.get("operations")
    if not isinstance(ops, list) or not ops:
        raise VectorError("operations is missing or empty")
    for i, op in enumerate(ops):
        name = op.get("op") if isinstance(op, dict) else None
        if name not in OPERATIONS:
            raise VectorError(f"operation {i}: unknown op {name!r}")
        if name == "ProposeStream" and not _nonempty(op, "messages"):
            raise VectorError(f"operation {i}: ProposeStream without messages")
        batches = {"ProposeBatch": [op], "ProposeStream": op.get("messages")}.get(name, [])
        for batch in batches:
            if not isinstance(batch, dict) or not _nonempty(batch, "states"):
                raise VectorError(f"operation {i}: a {name} batch without states")
            if not isinstance(batch.get("hiddens"), dict):
                raise VectorError(f"operation {i}: a {name} batch without hiddens")


def _nonempty(op: dict[str, Any], key: str) -> bool:
    return isinstance(op.get(key), list) and bool(op[key])


def load_vector(path: Path = VECTOR_PATH) -> dict[str, Any]:
    """The vector at `path`, checked (VectorError if no runner may replay it)."""
    try:
        vector = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise VectorError(f"{path} is not JSON: {e}") from e
    check_vector(vector)
    return vector


def variant(vector: dict[str, Any], name: str | None = None) -> tuple[list[dict], float]:
    """(operations, tolerance) for the vector's server, or for its variant `name` (e.g.
    "float32"): the variant's GetInfo fields replace the vector's."""
    if name is None:
        return vector["operations"], vector["prob_tolerance"]
    var = vector[name]
    ops = [
        op | {"expect": op["expect"] | var["info"]} if op["op"] == "GetInfo" else op
        for op in vector["operations"]
    ]
    return ops, var["prob_tolerance"]


def static_info(info: Any) -> dict[str, Any]:
    """A GetInfo answer's fixed fields (STATIC_INFO_FIELDS), named as in the vector."""
    out = {k: getattr(info, k) for k in STATIC_INFO_FIELDS}
    out["hidden_dtypes"] = [_DTYPE_ENUM[d] for d in info.hidden_dtypes]
    return out


def encode_tensor(arr: np.ndarray) -> dict[str, Any]:
    """A vector tensor: dtype name, shape and base64 of the raw little-endian bytes."""
    names = {np.dtype("float32"): "DTYPE_FP32", np.dtype("int32"): "DTYPE_INT32"}
    dtype = names[arr.dtype]
    data = np.ascontiguousarray(arr, dtype=_STORAGE[dtype]).tobytes()
    return {"dtype": dtype, "shape": list(arr.shape), "data": base64.b64encode(data).decode()}


def decode_tensor(t: dict[str, Any]) -> np.ndarray:
    raw = base64.b64decode(t["data"], validate=True)
    return np.frombuffer(raw, dtype=_STORAGE[t["dtype"]]).reshape(t["shape"]).copy()


def chunk_bytes_for(hidden_size: int, chunk_rows: int) -> int:
    """The Python client's `chunk_bytes` that makes chunks of `chunk_rows` fp32 rows."""
    row_bytes = hidden_size * 4 + 5  # fp32 row + a non-negative int32 token varint
    return client_messages.CHUNK_OVERHEAD + chunk_rows * row_bytes


@dataclass
class Outcome:
    index: int
    label: str
    ok: bool
    message: str

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.index:02d} {self.label}: {self.message}"


def mismatches(expected: dict[str, Any], actual: dict[str, Any], tol: float) -> list[str]:
    """Fields of `expected` that `actual` does not match (probs and confidences within
    tol); with `one_of`, none where `actual` matches one of its answers."""
    if "one_of" in expected:
        tries = [mismatches(e, actual, tol) for e in expected["one_of"]]
        if all(tries):
            return [f"none of {len(tries)} answers: " + "; ".join(tries[0])]
        return []
    out = []
    for key, want in expected.items():
        got = actual.get(key)
        same = _close(want, got, tol) if key in _FLOAT_KEYS else got == want
        if not same:
            out.append(f"{key}: expected {want!r}, got {got!r}")
    return out


def _close(want: Any, got: Any, tol: float) -> bool:
    """Whether `got` has the shape of `want` (a number or nested lists of numbers) and
    each of its floats is finite and within tol of want's."""
    if isinstance(want, list):
        return (
            isinstance(got, list)
            and len(got) == len(want)
            and all(_close(w, g, tol) for w, g in zip(want, got, strict=False))
        )
    return isinstance(got, float) and math.isfinite(got) and abs(got - want) <= tol


def error_text(code: str, reason: str | None, field: str | None) -> str:
    """An error as the runners print it: "CODE (reason R, field F)"."""
    return f"{code} (reason {reason or ''}, field {field or ''})"


def expected_error(op: dict[str, Any]) -> str | None:
    """The error `op` expects, as error_text prints it; None for a success."""
    if "expect_error" not in op:
        return None
    return error_text(op["expect_error"], op.get("expect_reason"), op.get("expect_field"))


class Replayer:
    """Interprets the vector's operations against a server through a DrafterClient."""

    def __init__(self, client: DrafterClient, *, tolerance: float):
        self.client = client
        self.tolerance = tolerance
        self.states: dict[str, int] = {}
        self.handles: dict[str, int] = {}

    def run(self, ops: list[dict[str, Any]]) -> list[Outcome]:
        outcomes = []
        try:
            for i, op in enumerate(ops):
                outcomes.append(self.step(i, op))
        finally:
            for state in self.states.values():  # leave nothing behind, even after a failure
                self.client.free_state(state)
        return outcomes

    def step(self, index: int, op: dict[str, Any]) -> Outcome:
        if op["op"] == "ProposeStream":
            return self.stream_step(index, op)
        label = op["op"] + (f" {op['state']}" if "state" in op else "")
        if op["op"] == "ProposeBatch":
            label += " " + ",".join(op["states"])
        ok, message = self.judge(op, lambda: self.call(op))
        return Outcome(index, label, ok, message)

    def stream_step(self, index: int, op: dict[str, Any]) -> Outcome:
        """One stream, its messages sent one by one; ok when every answer is as expected."""
        results = []
        with self.client.stream() as stream:

            def send(msg: dict[str, Any]) -> dict[str, Any]:
                return _batch_result(stream.step(**self.batch(msg)))

            for msg in op["messages"]:
                results.append(self.judge(msg, functools.partial(send, msg)))
        ok = all(good for good, _ in results)
        lines = "; ".join(f"[{j}] {text}" for j, (_, text) in enumerate(results))
        return Outcome(index, f"ProposeStream ({len(results)} messages)", ok, lines)

    def batch(self, op: dict[str, Any]) -> dict[str, Any]:
        """The client's propose_batch arguments for a batch, its states' names looked up."""
        return _batch(op, [self.states[s] for s in op["states"]])

    def judge(self, op: dict[str, Any], call: Any) -> tuple[bool, str]:
        """Runs `call` and compares its result (or its error) with what `op` expects."""
        try:
            actual = call()
        except DrafterError as e:
            got = error_text(e.code.name, e.reason, e.field)
            want = expected_error(op)
            if want == got:
                return True, f"{got} as expected"
            return False, f"expected {want or 'success'}, got {e}"
        if "expect_error" in op:
            return False, f"expected {op['expect_error']}, got {actual}"
        bad = mismatches(op.get("expect", {}), actual, self.tolerance)
        if bad:
            return False, "; ".join(bad)
        return True, json.dumps(actual, sort_keys=True)

    def call(self, op: dict[str, Any]) -> dict[str, Any]:
        c = self.client
        name = op["op"]
        if name == "GetInfo":
            out = static_info(c.info())
            return {k: out.get(k) for k in op.get("expect", {})}  # the fields the vector lists
        if name == "ProposeBatch":
            return _batch_result(c.propose_batch(**self.batch(op)))
        if name == "AllocState":
            state = c.alloc_state(
                Grammar(**op["grammar"]) if "grammar" in op else None,
                sampling=SamplingParams(**op["sampling"]) if "sampling" in op else None,
            )
            if state == 0:
                raise AssertionError("AllocState returned state id 0")
            self.states[op["state"]] = state
            return {}
        state = self.states[op["state"]]
        if name == "Prefill":
            hiddens = decode_tensor(op["hiddens"])
            chunk_bytes = chunk_bytes_for(hiddens.shape[1], op["chunk_rows"])
            args = (state, op["tokens"], hiddens, op["start_position"])
            chunks = list(client_messages.prefill_chunks(*args, chunk_bytes=chunk_bytes))
            r = c.prefill(*args, chunk_bytes=chunk_bytes)
            return {"num_rows": r.num_rows, "next_position": r.next_position, "chunks": len(chunks)}
        if name == "Propose":
            return _proposal(c.propose(**_propose(op, state)), state)
        if name == "AfterVerify":
            refeed = op.get("refeed_hiddens")
            r = c.after_verify(
                state, op["num_accepted"], refeed_hiddens=refeed and decode_tensor(refeed)
            )
            return {"num_rows": r.num_rows, "next_position": r.next_position}
        if name == "TakeKV":
            h = c.take_kv(state)
            if h.handle_id == 0:
                raise AssertionError("TakeKV returned handle id 0")
            self.handles[op["handle"]] = h.handle_id
            return {"num_rows": h.num_rows}
        if name == "InstallKV":
            r = c.install_kv(state, self.handles[op["handle"]])
            return {"num_rows": r.num_rows, "next_position": r.next_position}
        if name == "FreeState":
            return {"existed": c.free_state(state)}
        raise ValueError(f"unknown operation {name!r}")


def _propose(op: dict[str, Any], state: int) -> dict[str, Any]:
    """The client's propose arguments for a Propose operation (or a stream message)."""
    previous = None
    if "previous" in op:
        prev = op["previous"]
        refeed = prev.get("refeed_hiddens")
        previous = Verdict(prev["num_accepted"], refeed and decode_tensor(refeed))
    bitmask = op.get("bitmask")
    return dict(
        state=state,
        token=op["token"],
        hidden=decode_tensor(op["hidden"]),
        position=op["position"],
        num_drafts=op["num_drafts"],
        bitmask=None if bitmask is None else decode_tensor(bitmask),
        min_confidence=op.get("min_confidence", 0.0),
        previous=previous,
        sampling=SamplingParams(**op["sampling"]) if "sampling" in op else None,
        grammar=Grammar(**op["grammar"]) if "grammar" in op else None,
        draft_cap=op.get("draft_cap", 0),
        verify_token_cost=op.get("verify_token_cost", 0.0),
    )


def _batch(op: dict[str, Any], state_ids: list[int]) -> dict[str, Any]:
    """The client's propose_batch arguments for a batch (a ProposeBatch operation or a
    ProposeStream message): every column as the vector gives it, the optional ones None
    where it gives none."""

    def tensor(key: str) -> np.ndarray | None:
        return decode_tensor(op[key]) if key in op else None

    return dict(
        state_ids=state_ids,
        tokens=op["tokens"],
        positions=op["positions"],
        hiddens=decode_tensor(op["hiddens"]),
        num_drafts=op["num_drafts"],
        num_accepted=op.get("num_accepted"),
        refeed_rows=op.get("refeed_rows"),
        refeed_hiddens=tensor("refeed_hiddens"),
        bitmask_rows=op.get("bitmask_rows"),
        bitmasks=tensor("bitmasks"),
        min_confidence=op.get("min_confidence"),
        sampling={
            row: SamplingParams(**s)
            for row, s in zip(op.get("sampling_rows", []), op.get("sampling", []), strict=True)
        },
        grammars={
            row: Grammar(**g)
            for row, g in zip(op.get("grammar_rows", []), op.get("grammars", []), strict=True)
        },
        draft_caps=op.get("draft_caps"),
        verify_token_costs=op.get("verify_token_costs"),
    )


def _batch_result(r: BatchResult) -> dict[str, Any]:
    """A BatchResult as the vector's expect writes it."""
    return {
        "width": int(r.drafts.shape[1]),
        "drafts": r.drafts.tolist(),
        "probs": r.probs.astype(float).tolist(),
        "draft_counts": r.counts.tolist(),
        "confidences": r.confidences.astype(float).tolist(),
        "first_positions": r.first_positions.tolist(),
        "errors": [
            {"row": row, "code": e.code.name, "reason": e.reason or "", "field": e.field or ""}
            for row, e in sorted(r.errors.items())
        ],
        "q_support": 0 if r.q_ids is None else int(r.q_ids.shape[2]),
        "q_ids": [] if r.q_ids is None else r.q_ids.tolist(),
        "q_probs": [] if r.q_probs is None else r.q_probs.astype(float).tolist(),
    }


def _proposal(p: Any, state: int) -> dict[str, Any]:
    if p.state_id != state:
        raise AssertionError(f"Proposal.state_id {p.state_id} != state {state}")
    return {
        "tokens": p.tokens,
        "probs": p.probs,
        "confidence": p.confidence,
        "first_position": p.first_position,
        "q_support": len(p.q_ids[0]) if p.q_ids else 0,
        "q_ids": p.q_ids or [],
        "q_probs": p.q_probs or [],
    }


class DefaultServer:
    """`python3 -m mtpdraft serve --port 0 --device cpu [extra]` (the embedded default model)
    in a subprocess; `address` is where it listens."""

    def __init__(
        self, *extra: str, env: dict[str, str] | None = None, timeout: float = 120.0
    ) -> None:
        cmd = [sys.executable, "-m", "mtpdraft", "serve", "--port", "0", "--device", "cpu", *extra]
        self.process = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=None if env is None else os.environ | env,
        )
        self.lines: list[str] = []
        deadline = time.monotonic() + timeout
        for line in self.process.stdout:
            self.lines.append(line)
            match = re.search(r"listening on (\S+):(\d+)", line)
            if match:
                self.address = f"127.0.0.1:{match.group(2)}"
                # Keep reading its log so that a full pipe never blocks it.
                threading.Thread(target=self._drain, daemon=True).start()
                return
            if time.monotonic() > deadline:
                break
        self.stop()
        raise RuntimeError("the server did not start:\n" + "".join(self.lines))

    def _drain(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> DefaultServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def replay(address: str, ops: list[dict[str, Any]], tolerance: float) -> list[Outcome]:
    """The outcome of every operation, replayed in order against the server at `address`."""
    with DrafterClient(address, timeout=30.0) as client:
        return Replayer(client, tolerance=tolerance).run(ops)


def main() -> int:
    parser = argparse.ArgumentParser(description="Replays the conformance vector.")
    parser.add_argument("--address", default=os.environ.get("MTPDRAFT_CONFORMANCE_ADDRESS"))
    parser.add_argument("--vector", type=Path, default=VECTOR_PATH)
    args = parser.parse_args()
    if not args.address:
        parser.error("give --address HOST:PORT")
    try:
        vector = load_vector(args.vector)
    except (OSError, VectorError) as e:
        print(f"python: bad vector: {e}", file=sys.stderr)
        return 2
    outcomes = replay(args.address, vector["operations"], vector["prob_tolerance"])
    for o in outcomes:
        print(o.line())
    failed = sum(not o.ok for o in outcomes)
    print(f"python: {len(outcomes) - failed} passed, {failed} failed")
    return 1 if failed or len(outcomes) != len(vector["operations"]) else 0


if __name__ == "__main__":
    sys.exit(main())
