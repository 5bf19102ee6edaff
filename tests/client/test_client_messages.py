"""Request building (Prefill chunking, Propose, batches) and response parsing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mtpdraft.client import KVHandle, ProposeArgs, StateNotFound, Verdict, messages, wire
from mtpdraft.v1 import drafter_pb2 as pb


def _reassemble(chunks: list[pb.PrefillChunk]) -> tuple[list[int], np.ndarray]:
    tokens = [t for c in chunks for t in c.tokens]
    hiddens = np.concatenate([wire.decode(c.hiddens) for c in chunks])
    return tokens, hiddens


def test_prefill_chunk_count_and_sizes() -> None:
    h, n = 64, 10
    row = h * 4 + 5  # fp32 hidden + worst-case token varint
    chunk_bytes = messages.CHUNK_OVERHEAD + 3 * row  # exactly three rows
    hiddens = np.random.default_rng(0).standard_normal((n, h)).astype(np.float32)
    tokens = list(range(100, 100 + n))
    chunks = list(messages.prefill_chunks(7, tokens, hiddens, 1, chunk_bytes=chunk_bytes))
    assert [len(c.tokens) for c in chunks] == [3, 3, 3, 1]
    assert all(c.ByteSize() <= chunk_bytes for c in chunks)
    assert all(c.state_id == 7 and c.start_position == 1 for c in chunks)
    assert all(tuple(c.hiddens.shape) == (len(c.tokens), h) for c in chunks)
    got_tokens, got_hiddens = _reassemble(chunks)
    assert got_tokens == tokens
    np.testing.assert_array_equal(got_hiddens, hiddens)
    # One byte less fits only two rows per message.
    fewer = list(messages.prefill_chunks(7, tokens, hiddens, 1, chunk_bytes=chunk_bytes - 1))
    assert [len(c.tokens) for c in fewer] == [2] * 5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("chunk_bytes", [300, 1000, 4097, 65536])
@pytest.mark.parametrize("n", [1, 2, 37])
def test_prefill_chunks_never_exceed_bound_or_split_rows(
    dtype: torch.dtype, chunk_bytes: int, n: int
) -> None:
    h = 40
    x = torch.randn(n, h).to(dtype)
    # Worst-case varints: the largest ids and positions.
    tokens = [2**31 - 1 - i for i in range(n)]
    chunks = list(messages.prefill_chunks(2**64 - 1, tokens, x, 2**62, chunk_bytes=chunk_bytes))
    assert all(c.ByteSize() <= chunk_bytes for c in chunks)
    assert all(len(c.hiddens.data) == len(c.tokens) * h * x.element_size() for c in chunks)
    assert sum(len(c.tokens) for c in chunks) == n
    per = len(chunks[0].tokens)
    assert len(chunks) == -(-n // per)
    assert [t for c in chunks for t in c.tokens] == tokens
    back = torch.cat([wire.decode_torch(c.hiddens) for c in chunks])
    assert torch.equal(back, x)


def test_prefill_negative_tokens_still_fit() -> None:
    hiddens = np.zeros((20, 8), np.float32)
    chunks = list(messages.prefill_chunks(1, [-1] * 20, hiddens, 1, chunk_bytes=300))
    assert all(c.ByteSize() <= 300 for c in chunks)


def test_prefill_default_chunk_bytes_for_a_long_bf16_prompt() -> None:
    n, h = 1100, 4096
    x = torch.zeros(n, h, dtype=torch.bfloat16)
    chunks = list(messages.prefill_chunks(3, np.arange(n, dtype=np.int64), x, 1))
    assert messages.DEFAULT_CHUNK_BYTES == 4 * 1024 * 1024
    assert all(c.ByteSize() <= messages.DEFAULT_CHUNK_BYTES for c in chunks)
    assert len(chunks) == 3  # 511 rows of 8 KiB + 5 B per 4 MiB message


def test_prefill_empty_sends_one_empty_chunk() -> None:
    chunks = list(messages.prefill_chunks(5, [], np.zeros((0, 16), np.float32), 1))
    assert len(chunks) == 1
    assert chunks[0].state_id == 5 and chunks[0].start_position == 1
    assert list(chunks[0].tokens) == [] and tuple(chunks[0].hiddens.shape) == (0, 16)
    (bare,) = messages.prefill_chunks(5, [], None, 4)
    assert bare.state_id == 5 and bare.start_position == 4 and not bare.HasField("hiddens")


@pytest.mark.parametrize(
    ("tokens", "hiddens", "chunk_bytes", "error"),
    [
        ([1, 2], np.zeros((3, 4), np.float32), 4096, ValueError),  # row count mismatch
        ([1, 2], np.zeros(4, np.float32), 4096, ValueError),  # 1-D hiddens
        ([1, 2], None, 4096, ValueError),  # rows without hiddens
        ([1, 2], np.zeros((2, 4), np.float32), 64 + 20, ValueError),  # one row does not fit
        ([1.5, 2.0], np.zeros((2, 4), np.float32), 4096, TypeError),  # float tokens
        ([[1, 2]], np.zeros((2, 4), np.float32), 4096, ValueError),  # 2-D tokens
        ([2**31, 0], np.zeros((2, 4), np.float32), 4096, ValueError),  # token beyond int32
        ([1, 2], np.zeros((2, 4), np.float64), 4096, TypeError),  # fp64 hiddens
    ],
)
def test_prefill_bad_arguments_raise_eagerly(
    tokens: object, hiddens: object, chunk_bytes: int, error: type[Exception]
) -> None:
    with pytest.raises(error):
        messages.prefill_chunks(1, tokens, hiddens, 1, chunk_bytes=chunk_bytes)  # type: ignore[arg-type]


def test_prefill_accepts_token_arrays() -> None:
    h = np.zeros((3, 2), np.float32)
    for tokens in ([4, 5, 6], (4, 5, 6), np.array([4, 5, 6], np.int32), torch.tensor([4, 5, 6])):
        (chunk,) = messages.prefill_chunks(1, tokens, h, 1)
        assert list(chunk.tokens) == [4, 5, 6]


def test_propose_request_fields() -> None:
    hidden = torch.randn(32).to(torch.bfloat16)
    mask = np.full((2, 3), -1, np.int32)
    refeed = np.ones((2, 32), np.float32)
    req = messages.propose_request(
        9, 42, hidden, 17, 3, bitmask=mask, min_confidence=0.25, previous=Verdict(2, refeed)
    )
    assert (req.state_id, req.token, req.position, req.num_drafts) == (9, 42, 17, 3)
    assert req.min_confidence == pytest.approx(0.25)
    assert torch.equal(wire.decode_torch(req.hidden), hidden)
    np.testing.assert_array_equal(wire.decode(req.bitmask), mask)
    assert req.previous.num_accepted == 2
    np.testing.assert_array_equal(wire.decode(req.previous.refeed_hiddens), refeed)


def test_propose_request_optional_fields_absent() -> None:
    req = messages.propose_request(1, 2, np.zeros((1, 8), np.float16), 3, 1)
    assert not req.HasField("bitmask") and not req.HasField("previous")
    assert req.min_confidence == 0.0
    fused = messages.propose_request(1, 2, np.zeros(8, np.float16), 3, 1, previous=0)
    assert fused.HasField("previous") and fused.previous.num_accepted == 0
    assert not fused.previous.HasField("refeed_hiddens")


def test_propose_request_rejects_bad_arguments() -> None:
    h = np.zeros(8, np.float32)
    with pytest.raises(ValueError):
        messages.propose_request(-1, 2, h, 3, 1)
    with pytest.raises(TypeError):
        messages.propose_request(1, 2.5, h, 3, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        messages.propose_request(1, 2, h, 3, 1, bitmask=np.zeros(4, np.int64))
    with pytest.raises(ValueError):  # a refeed is [a, H], or [H] for one row
        messages.propose_request(
            1, 2, h, 3, 1, previous=Verdict(1, np.zeros((1, 1, 8), np.float32))
        )
    flat = messages.propose_request(1, 2, h, 3, 1, previous=Verdict(1, np.zeros(8, np.float32)))
    assert tuple(flat.previous.refeed_hiddens.shape) == (8,)


def test_batch_request_of_states_given_one_by_one() -> None:
    """Row i is requests[i]'s: hiddens stacked (bf16 beside fp32 widened to fp32, exactly),
    refeeds and bitmasks one after another with their row counts (fewer words padded with
    zero words), verdicts -1 where none."""
    h = np.arange(4, dtype=np.float32)
    bf16 = torch.tensor([1.5, -2.0, 0.25, 3.0]).to(torch.bfloat16)
    refeed = np.ones((2, 4), np.float32)
    args = [
        ProposeArgs(3, 13, h, 5, 2, previous=Verdict(2, refeed)),
        ProposeArgs(1, 11, bf16.reshape(1, 4), 6, 3, bitmask=np.array([7], np.int32)),
        ProposeArgs(8, 1, h, 2, 4, np.full((2, 2), -1, np.int32), 0.5, previous=1),
    ]
    req = messages.batch_request_of(args)
    assert list(req.state_ids) == [3, 1, 8] and list(req.tokens) == [13, 11, 1]
    assert list(req.positions) == [5, 6, 2] and list(req.num_drafts) == [2, 3, 4]
    assert req.hiddens.dtype == pb.DTYPE_FP32
    np.testing.assert_array_equal(wire.decode(req.hiddens), [h, bf16.float().numpy(), h])
    assert list(req.num_accepted) == [2, -1, 1]
    assert list(req.refeed_rows) == [2, 0, 0]
    np.testing.assert_array_equal(wire.decode(req.refeed_hiddens), refeed)
    assert list(req.bitmask_rows) == [0, 1, 2]
    np.testing.assert_array_equal(wire.decode(req.bitmasks), [[7, 0], [-1, -1], [-1, -1]])
    assert list(req.min_confidence) == [0.0, 0.0, 0.5]
    # No refeed: a bare count, or an empty tensor with none accepted.
    empty = [ProposeArgs(3, 1, h, 5, 2, previous=Verdict(0, np.zeros(0, np.float32)))]
    empty.append(ProposeArgs(4, 1, h, 5, 2, previous=Verdict(0, np.zeros((0, 4), np.float32))))
    none = messages.batch_request_of(empty)
    assert list(none.num_accepted) == [0, 0] and not none.refeed_rows
    assert not none.HasField("refeed_hiddens")
    plain = messages.batch_request_of([ProposeArgs(3, 13, bf16, 5, 2)])
    assert plain.hiddens.dtype == pb.DTYPE_BF16 and list(plain.hiddens.shape) == [1, 4]
    assert not (plain.num_accepted or plain.refeed_rows or plain.bitmask_rows)
    assert not plain.min_confidence and not plain.HasField("bitmasks")


def test_batch_request_of_rejects_bad_arguments() -> None:
    h = np.zeros(4, np.float32)
    with pytest.raises(ValueError):
        messages.batch_request_of([])
    with pytest.raises(TypeError):
        messages.batch_request_of([(1, 2, h, 3, 1)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"requests\[1\].hidden"):  # one row each
        messages.batch_request_of(
            [ProposeArgs(1, 2, h, 3, 1), ProposeArgs(2, 2, h[None, :].repeat(2, 0), 3, 1)]
        )
    with pytest.raises(ValueError, match="hidden"):  # rows of one width
        messages.batch_request_of([ProposeArgs(1, 2, h, 3, 1), ProposeArgs(2, 2, h[:3], 3, 1)])
    with pytest.raises(ValueError, match="num_accepted"):
        messages.batch_request_of([ProposeArgs(1, 2, h, 3, 1, previous=-1)])
    with pytest.raises(TypeError, match=r"requests\[0\].bitmask"):
        messages.batch_request_of([ProposeArgs(1, 2, h, 3, 1, bitmask=np.zeros(2, np.float32))])


def test_batch_request_columns() -> None:
    req = messages.batch_request(
        np.array([5, 6], np.uint64), [1, 2], torch.tensor([3, 4]), np.zeros((2, 4), np.float16), 3,
        num_accepted=[-1, 0], min_confidence=0.25,
    )  # fmt: skip
    assert list(req.state_ids) == [5, 6] and list(req.positions) == [3, 4]
    assert list(req.num_drafts) == [3] and list(req.min_confidence) == [0.25]
    assert list(req.num_accepted) == [-1, 0] and not req.HasField("refeed_hiddens")
    with pytest.raises(ValueError, match="tokens"):
        messages.batch_request([5, 6], [1], [3, 4], np.zeros((2, 4), np.float32), 3)
    with pytest.raises(ValueError, match="positions"):
        messages.batch_request([5], [1], [2**63], np.zeros(4, np.float32), 3)


def test_other_requests() -> None:
    req = messages.after_verify_request(4, 2, refeed_hiddens=np.zeros((2, 8), np.float32))
    assert req.state_id == 4 and req.verdict.num_accepted == 2
    assert tuple(req.verdict.refeed_hiddens.shape) == (2, 8)
    assert not messages.after_verify_request(4, 0).verdict.HasField("refeed_hiddens")
    assert messages.install_kv_request(3, KVHandle(11, 5, 30.0)).handle_id == 11
    assert messages.install_kv_request(3, 12).handle_id == 12
    assert messages.take_kv_request(np.uint64(6)).state_id == 6
    assert messages.free_state_request(6).state_id == 6


def test_parse_responses() -> None:
    p = messages.parse_proposal(
        pb.Proposal(state_id=3, tokens=[5, 6], probs=[0.5, 0.25], confidence=0.25, first_position=9)
    )
    assert p.tokens == [5, 6] and p.probs == [0.5, 0.25] and p.confidence == 0.25
    assert type(p.tokens) is list and type(p.probs[0]) is float
    assert (p.state_id, p.first_position) == (3, 9)
    answer = pb.ProposeBatchResponse(
        width=2, drafts=[5, 6, -1, -1], probs=[0.5, 0.25, 0, 0], draft_counts=[2, 0],
        confidences=[0.25, 0], first_positions=[9, 0],
        errors=[pb.RowError(row=1, error=pb.Error(code=5, reason="STATE_NOT_FOUND"))],
    )  # fmt: skip
    batch = messages.parse_batch(answer, [3, 4])
    assert len(batch) == 2 and batch.drafts.shape == (2, 2)
    assert batch.proposal(0) == p
    assert batch.errors[1].reason == "STATE_NOT_FOUND"
    with pytest.raises(StateNotFound):
        batch.proposal(1)
    with pytest.raises(StateNotFound):
        batch.proposals()
    r = messages.parse_prefill(pb.PrefillResponse(num_rows=4, next_position=5))
    assert (r.num_rows, r.next_position) == (4, 5)
    k = messages.parse_take_kv(pb.TakeKVResponse(handle_id=2, num_rows=4, ttl_seconds=60))
    assert k == KVHandle(2, 4, 60.0)
    assert messages.parse_free_state(pb.FreeStateResponse(existed=True)) is True
    assert messages.parse_alloc_state(pb.AllocStateResponse(state_id=2**64 - 1)) == 2**64 - 1


def test_parse_info() -> None:
    info = messages.parse_info(
        pb.GetInfoResponse(
            model_family="mimo",
            hidden_size=4096,
            compute_dtype="bfloat16",
            hidden_dtypes=[pb.DTYPE_BF16, pb.DTYPE_FP32],
            max_drafts=8,
            max_batch=64,
            state_ttl_seconds=120.0,
            max_message_bytes=4 << 20,
            bitmask_words=4740,
            draining=True,
        )
    )
    assert info.model_family == "mimo" and info.hidden_size == 4096
    assert info.hidden_dtypes == ("bfloat16", "float32")
    assert (info.max_drafts, info.max_batch, info.bitmask_words) == (8, 64, 4740)
    assert info.max_message_bytes == 4 << 20 and info.draining is True


def test_resolve_timeout() -> None:
    assert messages.resolve_timeout(messages.DEFAULT, 5.0) == 5.0
    assert messages.resolve_timeout(None, 5.0) is None
    assert messages.resolve_timeout(0.5, 5.0) == 0.5
