"""Writes tests/conformance/vector.json: the conformance vector every client replays.

    python3 tests/conformance/make_vector.py [--check]

The inputs (tokens, fp32 hiddens, a bitmask) come from a seeded generator; the
expected outputs come from the real service: a `python3 -m mtpdraft serve --device
cpu` server of the embedded default model, driven by the Python client. The
structural expectations written below (row counts, next positions, error codes)
are the contract's and are checked against the server while recording. Two more
checks guard the recording: drafts after TakeKV / InstallKV equal those of a
state that kept its KV, and a float32 server drafts the same tokens as the
bfloat16 one, so that the drafts are not near ties that another CPU could flip.
Regenerate when the default checkpoint or the contract changes; `--check` only
compares a fresh recording with the file.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from vector_runner import (
    VECTOR_PATH,
    DefaultServer,
    Replayer,
    decode_tensor,
    encode_tensor,
    load_vector,
    mismatches,
)

from mtpdraft.client import DrafterClient
from mtpdraft.service.model.default_model import DEFAULT_CHECKPOINT

SEED = 7
_CONFIG = json.loads((DEFAULT_CHECKPOINT / "config.json").read_text())
HIDDEN = _CONFIG["hidden_size"]
VOCAB = _CONFIG["vocab_size"]
PROB_TOLERANCE = 1e-3
# Between the bfloat16 server and a float32 one only the tokens must agree.
FP32_PROB_TOLERANCE = 0.1

RULES = [
    "Replay the operations in order against one server started as `server`.",
    "AllocState binds `state` to the returned id; TakeKV binds `handle`; the other "
    "operations look these names up. Ids are uint64 and non-zero.",
    "Tensors: dtype (proto enum name), shape, data = base64 of the raw little-endian "
    "bytes, sent unchanged.",
    "Prefill streams rows in chunks of at most chunk_rows rows; the first chunk carries "
    "state_id and start_position. `chunks` in expect is the number of chunks sent.",
    "Propose: `previous` is the fused verdict on the pending proposal. A Proposal's "
    "state_id must equal the state's id.",
    "ProposeStream: open one stream and send its `messages` (each a Propose operation "
    "without `op`) one at a time, each answered before the next; an error comes as an "
    "answer (expect_error, expect_reason, expect_field: its Error value's code name, "
    "reason and field) and the stream stays open. "
    "Close the stream after the last answer.",
    "expect: every listed field must match, exactly except probs and confidence "
    "(absolute tolerance prob_tolerance). expect_error: the gRPC status code name; "
    "expect_reason: its google.rpc.ErrorInfo reason; expect_field: the first "
    "google.rpc.BadRequest field violation's field (absent: none). Compare all three.",
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


def scenario(seed: int) -> list[dict[str, Any]]:
    """The operations with their inputs and the contract's structural expectations."""
    rng = np.random.default_rng(seed)

    def hiddens(n: int) -> dict[str, Any]:
        return encode_tensor(rng.standard_normal((n, HIDDEN)).astype(np.float32))

    def hidden() -> dict[str, Any]:
        return encode_tensor(rng.standard_normal(HIDDEN).astype(np.float32))

    def token() -> int:
        return int(rng.integers(0, VOCAB))

    def propose(state: str, position: int, k: int, **extra: Any) -> dict[str, Any]:
        op = {"op": "Propose", "state": state, "token": token(), "position": position}
        op |= {"num_drafts": k, "hidden": hidden()}
        if "expect_error" not in extra:
            op["expect"] = {"first_position": position + 1}
        return op | extra

    def message(state: str, position: int, k: int, **extra: Any) -> dict[str, Any]:
        """A ProposeStream message: a Propose operation without its `op`."""
        return {k: v for k, v in propose(state, position, k, **extra).items() if k != "op"}

    def verify(state: str, a: int, rows: int, refeed: bool = False) -> dict[str, Any]:
        op: dict[str, Any] = {"op": "AfterVerify", "state": state, "num_accepted": a}
        if refeed:
            op["refeed_hiddens"] = hiddens(a)
        return op | {"expect": {"num_rows": rows, "next_position": rows + 1}}

    prompt = [token() for _ in range(8)]  # x0..x7; rows (x1, h0) .. (x6, h5) are prefilled
    first = propose("A", 7, 3)  # (x7, h6) at position 7 drafts d1..d3 at 8..10
    first["token"] = prompt[7]
    mask = bitmask([rng.random(VOCAB) < 0.25, rng.random(VOCAB) < 0.25])
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
            "expect_error": "INVALID_ARGUMENT",
        },
        first,
        {k: v for k, v in first.items() if k != "expect"} | {"expect_error": "FAILED_PRECONDITION"},
        verify("A", 1, rows=8),  # rows of x7 and d1: positions 7, 8
        {
            "op": "AfterVerify",
            "state": "A",
            "num_accepted": 0,
            "expect_error": "FAILED_PRECONDITION",
        },
        propose("A", 10, 4, expect_error="INVALID_ARGUMENT"),  # the next position is 9
        propose("A", 9, 4, bitmask=encode_tensor(mask)),
        verify("A", 2, rows=11, refeed=True),
        propose("A", 12, 3),
        propose("A", 16, 2, previous={"num_accepted": 3}),  # a = K: 11 + 1 + 3 = 15 rows
        propose("A", 18, 3, previous={"num_accepted": 1, "refeed_hiddens": hiddens(1)}),
        verify("A", 0, rows=18),
        {"op": "TakeKV", "state": "A", "handle": "H1", "expect": {"num_rows": 18}},
        propose("A", 19, 3, expect_error="INVALID_ARGUMENT"),  # A is empty: next is 1
        {"op": "AllocState", "state": "B"},
        {
            "op": "InstallKV",
            "state": "B",
            "handle": "H1",
            "expect": {"num_rows": 18, "next_position": 19},
        },
        {"op": "InstallKV", "state": "A", "handle": "H1", "expect_error": "NOT_FOUND"},  # used
        propose("B", 19, 3),
        verify("B", 3, rows=22, refeed=True),
        {  # the hot path: each message carries the verdict on the one before
            "op": "ProposeStream",
            "messages": [
                message("B", 23, 3),
                # a = 1 leaves 22 + 1 + 1 rows: position 26 does not continue B, and
                # the refused message changes nothing (its verdict is not applied)
                message("B", 26, 2, previous={"num_accepted": 1}, expect_error="INVALID_ARGUMENT"),
                message("B", 25, 2, previous={"num_accepted": 1}),
                message("B", 28, 4, previous={"num_accepted": 2, "refeed_hiddens": hiddens(2)}),
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
        {"op": "InstallKV", "state": "B", "handle": "H2", "expect_error": "FAILED_PRECONDITION"},
        {
            "op": "InstallKV",
            "state": "C",
            "handle": "H2",
            "expect": {"num_rows": 1, "next_position": 2},
        },
        {"op": "FreeState", "state": "A", "expect": {"existed": True}},
        {"op": "FreeState", "state": "A", "expect": {"existed": False}},
        propose("A", 1, 3, expect_error="NOT_FOUND"),
        {
            "op": "Prefill",
            "state": "A",
            "start_position": 1,
            "tokens": [token()],
            "chunk_rows": 4,
            "hiddens": hiddens(1),
            "expect_error": "NOT_FOUND",
        },
        {"op": "FreeState", "state": "B", "expect": {"existed": True}},
        {"op": "AfterVerify", "state": "B", "num_accepted": 0, "expect_error": "NOT_FOUND"},
        {"op": "FreeState", "state": "C", "expect": {"existed": True}},
    ]


def replay(address: str, ops: list[dict[str, Any]], *, record: bool, tol: float) -> list:
    with DrafterClient(address, timeout=60.0) as client:
        outcomes = Replayer(client, record=record, tolerance=tol).run(ops)
    failed = [o.line() for o in outcomes if not o.ok]
    if failed:
        raise SystemExit("make_vector: the server disagrees:\n" + "\n".join(failed))
    return outcomes


def check_bitmask(ops: list[dict[str, Any]]) -> None:
    """Every masked draft is a token its bitmask row (the last row past the end) allows."""
    for op in ops:
        if "bitmask" in op and "expect" in op:
            words = decode_tensor(op["bitmask"]).view(np.uint32).reshape(-1, VOCAB // 32)
            for i, t in enumerate(op["expect"]["tokens"]):
                row = words[min(i, len(words) - 1)]
                if not row[t // 32] >> np.uint32(t % 32) & 1:
                    raise SystemExit(f"make_vector: draft {i} ({t}) is not allowed by its mask")


def check_take_install(address: str, ops: list[dict[str, Any]]) -> None:
    """B's drafts after InstallKV equal those of a state that kept A's KV all along."""
    take = next(i for i, op in enumerate(ops) if op["op"] == "TakeKV")
    b_propose = next(op for op in ops if op["op"] == "Propose" and op["state"] == "B")
    control = [{"op": "AllocState", "state": "A"}]
    control += [
        copy.deepcopy(op)
        for op in ops[:take]
        if op.get("state") == "A" and "expect_error" not in op and op["op"] != "AllocState"
    ]
    control.append(copy.deepcopy(b_propose) | {"state": "A"})
    replay(address, control, record=False, tol=0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the file only")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--out", type=Path, default=VECTOR_PATH)
    args = parser.parse_args()

    ops = scenario(args.seed)
    with DefaultServer() as server:
        replay(server.address, ops, record=True, tol=PROB_TOLERANCE)
        check_take_install(server.address, ops)
    check_bitmask(ops)
    with DefaultServer("--dtype", "float32") as server:
        fp32 = copy.deepcopy(ops)
        for op in fp32:
            if op["op"] == "GetInfo":
                op["expect"].pop("compute_dtype")
                op["expect"].pop("kv_blocks_total")
        replay(server.address, fp32, record=False, tol=FP32_PROB_TOLERANCE)

    vector = {
        "format": "mtpdraft-conformance/1",
        "about": "Operations every mtpdraft client replays against a live server; "
        "written by tests/conformance/make_vector.py from the real service.",
        "server": "python3 -m mtpdraft serve --port 0 --device cpu",
        "checkpoint": {"path": "service/model/default_checkpoint", "sha256": checkpoint_digests()},
        "seed": args.seed,
        "prob_tolerance": PROB_TOLERANCE,
        "rules": RULES,
        "operations": ops,
    }
    text = dump(vector)
    if args.check:
        diffs = differences(load_vector(args.out), vector)
        print("\n".join(diffs) or f"make_vector: {args.out} is up to date")
        return 1 if diffs else 0
    args.out.write_text(text)
    print(f"make_vector: wrote {args.out} ({len(ops)} operations, {len(text)} bytes)")
    return 0


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Where `new` departs from `old`: inputs exactly, expected outputs within tolerance."""
    out = [f"{k} differs" for k in new if k != "operations" and old.get(k) != new[k]]
    olds, news = _checked(old["operations"]), _checked(new["operations"])
    if [label for label, _ in olds] != [label for label, _ in news]:
        return [*out, "the operations differ"]
    for (label, was), (_, now) in zip(olds, news, strict=True):
        if {k: v for k, v in was.items() if k != "expect"} != {
            k: v for k, v in now.items() if k != "expect"
        }:
            out.append(f"{label}: inputs differ")
        elif was.get("expect", {}).keys() != now.get("expect", {}).keys():
            out.append(f"{label}: expected fields differ")
        else:
            bad = mismatches(was.get("expect", {}), now.get("expect", {}), PROB_TOLERANCE)
            out += [f"{label}: {b}" for b in bad]
    return out


def _checked(ops: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(label, item) for every operation, and for every message of a ProposeStream."""
    items = []
    for i, op in enumerate(ops):
        if op["op"] == "ProposeStream":
            items += [(f"{i:02d} ProposeStream[{j}]", m) for j, m in enumerate(op["messages"])]
        else:
            items.append((f"{i:02d} {op['op']}", op))
    return items


def dump(vector: dict[str, Any]) -> str:
    """Pretty JSON with one line per operation (short diffs, a readable file)."""
    head = {k: v for k, v in vector.items() if k != "operations"}
    lines = json.dumps(head, indent=2).rstrip("}").rstrip() + ',\n  "operations": [\n'
    lines += ",\n".join("    " + json.dumps(op) for op in vector["operations"])
    return lines + "\n  ]\n}\n"


if __name__ == "__main__":
    sys.exit(main())
