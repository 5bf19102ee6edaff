"""mtpdraft client: blocking and asyncio clients of the ``mtpdraft.v1.Drafter`` service.

    from mtpdraft.client import DrafterClient, Verdict

    with DrafterClient("localhost:50051", timeout=5.0) as c:
        s = c.alloc_state()
        c.prefill(s, prompt_tokens, prompt_hiddens, start_position=1)
        p = c.propose(s, last_token, last_hidden, position, num_drafts=3)
        p = c.propose(s, bonus, hidden, position + a + 1, 3, previous=Verdict(a))
        c.free_state(s)

Hiddens are numpy (float32/float16) or torch (bfloat16/float16/float32) arrays;
failures raise ``DrafterError`` subclasses. Behind several replicas (deploy/README.md), give
``affinity_key=``; a state whose replica is gone raises ``StateLost``, and ``reprefill``
rebuilds it from the verifier's tokens and hiddens (``move_state`` moves a live one;
``recover_state`` moves it back from the replica that still holds it, ``Replicas``). A
numbered step (``step_number=``) whose outcome is unknown is sent again: ``retry_step``.
"""

from .async_client import AsyncDrafterClient
from .errors import (
    DeadlineExceeded,
    DrafterError,
    DrafterRpcError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    StateLost,
    StateNotFound,
    Unavailable,
    from_rpc_error,
)
from .messages import AFFINITY_HEADER, DEFAULT_CHUNK_BYTES
from .recovery import (
    is_ambiguous,
    is_state_lost,
    move_state,
    move_state_async,
    reprefill,
    reprefill_async,
    retry_step,
    retry_step_async,
)
from .replicas import Recovered, Replicas, epoch_of, recover_state
from .stream import AsyncProposeStream, ProposeStream
from .sync_client import DrafterClient
from .types import (
    BatchResult,
    Grammar,
    InstallResult,
    KVHandle,
    PrefillResult,
    Proposal,
    ProposeArgs,
    SamplingParams,
    ServerInfo,
    Verdict,
    VerifyResult,
)

__all__ = [
    "AFFINITY_HEADER",
    "DEFAULT_CHUNK_BYTES",
    "AsyncDrafterClient",
    "AsyncProposeStream",
    "BatchResult",
    "DeadlineExceeded",
    "DrafterClient",
    "DrafterError",
    "DrafterRpcError",
    "FailedPrecondition",
    "Grammar",
    "InstallResult",
    "InvalidArgument",
    "KVHandle",
    "NotFound",
    "PrefillResult",
    "Proposal",
    "ProposeArgs",
    "ProposeStream",
    "Recovered",
    "Replicas",
    "ResourceExhausted",
    "SamplingParams",
    "ServerInfo",
    "StateLost",
    "StateNotFound",
    "Unavailable",
    "Verdict",
    "VerifyResult",
    "epoch_of",
    "from_rpc_error",
    "is_ambiguous",
    "is_state_lost",
    "move_state",
    "move_state_async",
    "recover_state",
    "reprefill",
    "reprefill_async",
    "retry_step",
    "retry_step_async",
]
