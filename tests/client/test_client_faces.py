"""The blocking and the asyncio clients are one core's two faces: every method is a
``messages`` call, with its arguments and docstring, a coroutine function on the asyncio
client; what ``help`` and ``inspect`` show of a method is the call's own."""

from __future__ import annotations

import asyncio
import inspect

import numpy as np
import pytest

from mtpdraft.client import AsyncDrafterClient, DrafterClient, messages
from mtpdraft.client.base import ClientBase, Method

METHODS = [name for name, value in vars(ClientBase).items() if isinstance(value, Method)]


def test_every_rpc_of_the_service_is_a_method() -> None:
    assert set(METHODS) == {
        "info", "alloc_state", "prefill", "propose", "propose_batch", "propose_many",
        "after_verify", "take_kv", "install_kv", "export_kv_chunks", "export_kv", "import_kv",
        "free_state",
    }  # fmt: skip


@pytest.mark.parametrize("client", [DrafterClient, AsyncDrafterClient])
@pytest.mark.parametrize("name", METHODS)
def test_a_method_is_its_call_signed_and_documented(client: type, name: str) -> None:
    method, call = getattr(client, name), getattr(messages, name)
    assert method.__doc__ == call.__doc__ and method.__doc__.strip()
    assert method.__qualname__ == f"{client.__name__}.{name}"
    own, calls = inspect.signature(method).parameters, inspect.signature(call).parameters
    assert list(own) == ["self", *calls]
    assert [(p.kind, p.default) for p in own.values()][1:] == [
        (p.kind, p.default) for p in calls.values()
    ]
    assert "timeout" in own and own["timeout"].default is messages.DEFAULT
    streamed = vars(ClientBase)[name].streamed
    awaited = client is AsyncDrafterClient and not streamed
    assert inspect.iscoroutinefunction(method) == awaited


def test_a_blocking_client_refuses_async_chunks_before_sending() -> None:
    class Channel:
        def unary_unary(self, *args: object, **kwargs: object) -> object:
            return lambda *a, **k: pytest.fail("sent")

        unary_stream = stream_unary = stream_stream = unary_unary

    async def chunks():  # an asyncio client's ExportKV chunks
        yield messages.pb.KVChunk()

    with pytest.raises(TypeError, match="ImportKV: a blocking client"):
        DrafterClient(channel=Channel()).import_kv(1, chunks())


def test_bad_arguments_fail_in_the_caller_on_either_client() -> None:
    """The core checks arguments as it builds the Call, before either client sends it."""

    class Channel:
        def unary_unary(self, *args: object, **kwargs: object) -> object:
            return lambda *a, **k: pytest.fail("sent")

        unary_stream = stream_unary = stream_stream = unary_unary

    hidden = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match="state -1 is not a uint64"):
        DrafterClient(channel=Channel()).propose(-1, 2, hidden, 3, 1)

    async def propose() -> None:
        async with AsyncDrafterClient("127.0.0.1:1") as client:  # nothing listens: none sent
            await client.propose(-1, 2, hidden, 3, 1)

    with pytest.raises(ValueError, match="state -1 is not a uint64"):
        asyncio.run(propose())


def test_a_subclass_keeps_its_own_methods() -> None:
    class Counting(DrafterClient):
        def propose(self, *args: object, **kwargs: object) -> str:  # type: ignore[override]
            return "its own"

    assert Counting.propose(None) == "its own"  # type: ignore[arg-type]
    assert Counting.info is DrafterClient.info
