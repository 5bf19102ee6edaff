"""End-to-end tests of examples/tiny_mimo on the CPU.

The checkpoint is the trained tiny MiMo when present (examples/tiny_mimo/checkpoint,
or the service's default checkpoint once it holds that model), else a tiny
random one written by the example's own model code. They check that the
service's loader reads it, that the example model's MTP conventions are the
service's (same chained drafts), that the reference verifier's speculative
decoding over gRPC reproduces plain greedy decoding token for token, and that
in-process drafts equal gRPC drafts bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from proposing import ProposeArgs, propose

from examples.tiny_mimo.model import (
    TinyMiMoConfig,
    TinyMiMoForCausalLM,
    load_checkpoint,
    read_tensors,
    save_checkpoint,
)
from examples.tiny_mimo.verify import (
    Drafts,
    GrpcDrafter,
    LocalDrafter,
    Server,
    find_trained_checkpoint,
    greedy_decode,
    held_out_prompts,
    run_config,
    speculative_decode,
    start_server,
)
from mtpdraft.client import DrafterClient
from mtpdraft.service.config import ServeConfig
from mtpdraft.service.engine.engine import DraftEngine
from mtpdraft.service.model.checkpoint import load_mtp_weights
from mtpdraft.service.model.mtp_head import MTPHead

TINY = TinyMiMoConfig(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
)
NEW_TOKENS = 24


def random_checkpoint(folder: Path, seed: int) -> Path:
    model = TinyMiMoForCausalLM(TINY).randomize_(seed)
    return save_checkpoint(model, folder, torch.float32)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread here: tiny ops, and a loaded CI machine punishes oversubscription."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    trained = find_trained_checkpoint()
    if trained is not None:
        return trained
    return random_checkpoint(tmp_path_factory.mktemp("tiny_mimo"), seed=5)


@pytest.fixture(scope="module")
def target(checkpoint: Path) -> TinyMiMoForCausalLM:
    return load_checkpoint(checkpoint, torch.float64)


@pytest.fixture(scope="module")
def prompts() -> list[tuple[str, list[int]]]:
    return held_out_prompts(2, 48, seed=0)


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[Server]:
    server = start_server(checkpoint)
    yield server
    server.stop()


def test_checkpoint_loads_with_the_service_loader(checkpoint: Path) -> None:
    weights = load_mtp_weights(checkpoint)
    model = load_checkpoint(checkpoint)
    c = model.config
    assert weights.family == "mimo"
    assert weights.pass_normed_hidden and not weights.embed_first
    assert (weights.config.hidden_size, weights.config.vocab_size) == (c.hidden_size, 256)
    assert weights.config.num_key_value_heads == c.num_key_value_heads
    assert weights.config.num_mtp_layers == 1
    assert weights.config.dtype == next(model.parameters()).dtype
    tensors = read_tensors(checkpoint)
    for key, name in [
        ("embed", "model.embed_tokens.weight"),
        ("lm_head", "lm_head.weight"),
        ("input_proj", "model.mtp_layers.0.input_proj.weight"),
        ("q_proj_bias", "model.mtp_layers.0.self_attn.q_proj.bias"),
        ("final_norm", "model.mtp_layers.0.final_layernorm.weight"),
    ]:
        assert torch.equal(weights.tensors[key], tensors[name]), name


def test_example_mtp_matches_the_service_forward(tmp_path: Path) -> None:
    """Chained drafts of the service's MTPHead equal the example model's MTP forward."""
    folder = random_checkpoint(tmp_path, seed=3)
    model = load_checkpoint(folder, torch.float64)
    head = MTPHead(load_mtp_weights(folder), torch.device("cpu"))
    engine = DraftEngine(head, ServeConfig(kv_blocks=64))
    tokens = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    n, k = tokens.shape[1], 4
    with torch.no_grad():
        h = model.forward_target(tokens)
        state = engine.alloc_state()
        session = engine.begin_prefill(state, 1)
        session.append(tokens[0, 1 : n - 1].tolist(), h[0, : n - 2].float())
        session.finish()
        got = propose(engine, ProposeArgs(state, int(tokens[0, -1]), h[0, -2].float(), n - 1, k))
        # Rows (x_(i+1), h_i); then speculative rows (d_j, m of the previous row).
        row_tokens, row_hiddens = tokens[:, 1:], h[:, :-1]
        drafts, probs = [], []
        for _ in range(k):
            m = model.forward_mtp(row_tokens, row_hiddens)
            logits = model.mtp_logits(m[:, -1])
            drafts.append(int(logits.argmax()))
            probs.append(float(torch.softmax(logits, -1).max()))
            row_tokens = torch.cat([row_tokens, torch.tensor([[drafts[-1]]])], dim=1)
            row_hiddens = torch.cat([row_hiddens, m[:, -1:]], dim=1)
    assert got.tokens == drafts
    assert got.probs == pytest.approx(probs, rel=1e-4)


class OracleDrafter:
    """Proposes the reference continuation, wrong from draft ``correct + 1`` on."""

    def __init__(self, prompt: list[int], reference: list[int], correct: int) -> None:
        self.text = prompt + reference
        self.correct = correct

    def alloc_state(self) -> int:
        return 1

    def prefill(self, state: int, tokens: list[int], hiddens: torch.Tensor, start: int) -> None:
        assert start == 1 and len(tokens) == hiddens.shape[0]

    def propose(
        self,
        state: int,
        token: int,
        hidden: torch.Tensor,
        position: int,
        k: int,
        accepted: int | None,
        refeed: torch.Tensor | None,
    ) -> Drafts:
        assert self.text[position] == token
        truth = (self.text[position + 1 : position + 1 + k] + [0] * k)[:k]
        drafts = [t if j < self.correct else (t + 1) % 256 for j, t in enumerate(truth)]
        return Drafts(drafts, [1.0] * k)

    def free_state(self, state: int) -> None:
        pass


@pytest.mark.parametrize("correct", [0, 1, 3])
def test_verifier_bookkeeping_with_oracle_drafts(
    target: TinyMiMoForCausalLM, prompts: list[tuple[str, list[int]]], correct: int
) -> None:
    prompt = prompts[0][1]
    reference = greedy_decode(target, prompt, NEW_TOKENS)
    drafter = OracleDrafter(prompt, reference, correct)
    result = speculative_decode(target, drafter, prompt, NEW_TOKENS, 3, refeed=True)
    assert result.tokens == reference
    assert set(result.accepted[:-1]) == {correct}


def test_lossless_over_grpc_and_in_process_equals_grpc(
    checkpoint: Path,
    target: TinyMiMoForCausalLM,
    prompts: list[tuple[str, list[int]]],
    server: Server,
) -> None:
    references = [greedy_decode(target, p, NEW_TOKENS) for _, p in prompts]
    with DrafterClient(server.address, timeout=30.0) as client:
        drafters = {"grpc": GrpcDrafter(client), "local": LocalDrafter(checkpoint, 512)}
        for k, refeed in [(1, False), (2, True), (4, False), (4, True)]:
            r = run_config(target, drafters, prompts, references, NEW_TOKENS, k, refeed)
            assert r.lossless, (k, refeed)
            assert r.grpc_equals_local, (k, refeed)
            assert r.proposals_compared == r.steps > 0
        assert client.info().live_states == 0
