"""A verifier process for test_reliability_cleanup: it takes states, a KV handle, an open
ProposeStream and a half-sent Prefill stream, prints what it holds, then waits to be killed.

    python reliability_killed_client.py ADDRESS

It prints one line `HOLDS {"states": {id: rows}, "handles": {id: rows}, "prefilling":
{id: rows}}` once every call it made has been answered (the open Prefill's first chunk
may still be on its way), and then sleeps until SIGKILL.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import grpc
import numpy as np

from mtpdraft.client import DrafterClient, Verdict
from mtpdraft.v1 import drafter_pb2 as pb
from mtpdraft.v1 import drafter_pb2_grpc as pb_grpc

H, V = 64, 200


def hiddens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, H), dtype=np.float32)


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed + 1).integers(0, V, n).tolist()


def main(address: str) -> None:
    client = DrafterClient(address, timeout=30)
    states: dict[int, int] = {}

    s1 = client.alloc_state()  # 9 committed rows
    client.prefill(s1, tokens(9, 1), hiddens(9, 1), 1)
    states[s1] = 9
    s2 = client.alloc_state()  # 5 rows and a pending proposal of 4 drafts
    client.prefill(s2, tokens(5, 2), hiddens(5, 2), 1)
    client.propose(s2, 3, hiddens(1, 3)[0], 6, 4)
    states[s2] = 5 + 4
    donor = client.alloc_state()  # its 7 rows go to a KV handle; it stays, empty
    client.prefill(donor, tokens(7, 4), hiddens(7, 4), 1)
    handle = client.take_kv(donor)
    states[donor] = 0

    # The hot path, left open: one answered step per state.
    stream = client.stream()
    stream.propose(s1, 5, hiddens(1, 5)[0], 10, 3)
    states[s1] = 9 + 3
    stream.propose(s2, 6, hiddens(1, 6)[0], 6 + 2 + 1, 2, previous=Verdict(2))
    states[s2] = 5 + 1 + 2 + 2

    # A Prefill stream that declares 12 rows, sends its first chunk of 6 and never finishes.
    s3 = client.alloc_state()
    states[s3] = 0
    never = threading.Event()

    def chunks():
        yield pb.PrefillChunk(
            state_id=s3,
            start_position=1,
            tokens=tokens(6, 7),
            hiddens=pb.Tensor(dtype=pb.DTYPE_FP32, shape=[6, H], data=hiddens(6, 7).tobytes()),
            total_rows=12,  # it means to send 12 rows, as clients declare
        )
        never.wait()

    channel = grpc.insecure_channel(address)
    pending_prefill = pb_grpc.DrafterStub(channel).Prefill.future(chunks(), timeout=600)

    holds = {
        "states": {str(k): v for k, v in states.items()},
        "handles": {str(handle.handle_id): handle.num_rows},
        "prefilling": {str(s3): 6},
    }
    print("HOLDS " + json.dumps(holds), flush=True)
    time.sleep(600)  # until killed
    pending_prefill.cancel()


if __name__ == "__main__":
    main(sys.argv[1])
