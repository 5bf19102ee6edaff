"""README.md's Python examples, run as written against servers on loopback.

Each example is read from README.md itself, so an edit that breaks one fails here.
The first-drafts example is checked against the float64 oracle: its random stand-ins
for the target's tokens and hiddens are recorded as it draws them and replayed to the
oracle. The TLS example runs against a server with mutual TLS and tokens whose files
are made here; the tracing example in a process of its own.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from certificates import cert, new_key, pem
from drafting import Expected
from mtp_reference import Reference
from opentelemetry.trace import SpanKind
from servers import InProcessServer, recording_tracer, small_engine, start_server

from mtpdraft.client import DrafterClient
from mtpdraft.service.telemetry import Telemetry

README = Path(__file__).resolve().parents[2] / "README.md"
TOKEN = "readme-token-0123456789"


def example(heading: str, index: int = 0) -> str:
    """The `index`th ```python block of README.md's section `heading`."""
    text = README.read_text()
    section = text[text.index(f"\n## {heading}\n") + 1 :]
    section = section[: section.find("\n## ")]
    return re.findall(r"```python\n(.*?)```", section, re.S)[index]


def test_every_python_block_is_one_run_here() -> None:
    blocks = re.findall(r"```python\n", README.read_text())
    run = [("First drafts", 0), ("Many sequences per step", 0), ("Sampled drafts", 0)]
    run += [("Operations", 0)]
    run += [("Operations", 1)]
    assert len(blocks) == len(run)
    assert {example(h, i) for h, i in run} == set(
        re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    )


class RecordingRng:
    """A numpy Generator that keeps what it drew, in order."""

    def __init__(self, seed: int) -> None:
        self.rng, self.drawn = np.random.default_rng(seed), []

    def integers(self, *args, **kwargs):
        self.drawn.append(self.rng.integers(*args, **kwargs))
        return self.drawn[-1]

    def standard_normal(self, *args, **kwargs):
        self.drawn.append(self.rng.standard_normal(*args, **kwargs))
        return self.drawn[-1]


def _exec(code: str, where: str, **names) -> dict:
    namespace: dict = {"__name__": "readme", **names}
    exec(compile(code, f"README.md: {where}", "exec"), namespace)
    return namespace


def _live_states(address: str) -> int:
    with DrafterClient(address, timeout=30) as c:
        return c.info().live_states


@pytest.fixture(scope="module")
def served(mimo_checkpoint):
    tracer_provider, exporter = recording_tracer()
    server = InProcessServer(small_engine(mimo_checkpoint), telemetry=Telemetry(tracer_provider))
    yield server, exporter
    server.stop()


def test_the_first_drafts_example_drafts_what_the_oracle_does(
    served, mimo_checkpoint, capsys
) -> None:
    server, _ = served
    code = example("First drafts").replace("localhost:50051", server.address)
    assert "rng = np.random.default_rng(0)" in code
    rng = RecordingRng(0)
    namespace = _exec(
        code.replace("np.random.default_rng(0)", "recording_rng"), "First drafts", recording_rng=rng
    )
    printed = [line for line in capsys.readouterr().out.splitlines() if line]
    # The oracle, fed what the example drew: the prompt, its hiddens, then per step the
    # bonus token and the target's hiddens.
    prompt, prompt_hiddens, *steps = rng.drawn
    exp = Expected(Reference(mimo_checkpoint))
    exp.add(prompt.tolist()[1:], torch.from_numpy(prompt_hiddens[:-1]))
    drafts, _ = exp.propose(namespace["sampled"], torch.from_numpy(prompt_hiddens[-1]), 3)
    expected = []
    for bonus, target_hiddens in zip(steps[::2], steps[1::2], strict=True):
        accepted = min(1, len(drafts))
        refeed = torch.from_numpy(target_hiddens[:accepted])
        exp.verdict(accepted, refeed)
        drafts, _ = exp.propose(int(bonus), torch.from_numpy(target_hiddens[accepted]), 3)
        expected.append(drafts)
    got = [
        [int(t) for t in re.match(r"\[(.*?)\]", line).group(1).split(",") if t.strip()]
        for line in printed
    ]
    assert len(expected) == 5 and got == expected
    assert _live_states(server.address) == 0  # the example freed its state


def test_the_many_sequences_example_runs(served, capsys) -> None:
    server, _ = served
    code = example("Many sequences per step").replace("localhost:50051", server.address)
    namespace = _exec(code, "Many sequences per step")
    assert len(capsys.readouterr().out.splitlines()) == 3  # three steps
    assert namespace["drafts"].shape == (8, 4) and namespace["counts"].shape == (8,)
    assert (namespace["counts"] >= 1).all()
    assert _live_states(server.address) == 0  # the example freed its states


def test_the_sampled_drafts_example_runs(served, capsys) -> None:
    server, _ = served
    code = example("Sampled drafts").replace("localhost:50051", server.address)
    namespace = _exec(code, "Sampled drafts")
    assert len(capsys.readouterr().out.splitlines()) == 3  # three steps
    p = namespace["p"]
    assert len(p.q_ids) == len(p.q_probs) == len(p.tokens) == 4
    assert all(abs(sum(q) - 1) < 1e-5 for q in p.q_probs)
    assert _live_states(server.address) == 0


def test_the_tls_example_runs_against_mtls_and_a_token(
    mimo_checkpoint, tmp_path: Path, monkeypatch, capsys
) -> None:
    ca_key, server_key, client_key = new_key(), new_key(), new_key()
    ca = cert("readme CA", ca_key, ca=True)
    files = {
        "ca.pem": pem(ca),
        "server.pem": pem(cert("localhost", server_key, ca, ca_key, server=True)),
        "server.key": pem(server_key),
        "client.pem": pem(cert("verifier", client_key, ca, ca_key)),
        "client.key": pem(client_key),
        "tokens": TOKEN.encode(),
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    secure = start_server(
        mimo_checkpoint,
        *("--tls-cert", str(tmp_path / "server.pem"), "--tls-key", str(tmp_path / "server.key")),
        *("--tls-client-ca", str(tmp_path / "ca.pem")),
        *("--auth-token-file", str(tmp_path / "tokens")),
    )
    try:
        monkeypatch.chdir(tmp_path)
        monkeypatch.setenv("MTPDRAFT_TOKEN", TOKEN)
        port = secure.address.rsplit(":", 1)[1]
        code = example("Operations", 0).replace("drafter.internal:50051", f"localhost:{port}")
        namespace = _exec(code, "Operations (TLS)")
        namespace["drafter"].close()
        assert capsys.readouterr().out.split() == ["mimo"]
    finally:
        assert secure.stop() == 0


TRACED = """
import json, sys
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from mtpdraft.client import DrafterClient

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
{example}
(span,) = exporter.get_finished_spans()
print(json.dumps([span.name, span.context.trace_id, span.context.span_id]))
"""


def test_the_traced_client_example_parents_the_server_span(served) -> None:
    """In a process of its own: the example uses the global tracer provider."""
    server, exporter = served
    code = TRACED.format(
        example=example("Operations", 1).replace("localhost:50051", server.address)
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    name, trace_id, span_id = json.loads(done.stdout.strip().splitlines()[-1])
    assert name == "/mtpdraft.v1.Drafter/GetInfo"
    (served_span,) = [
        s
        for s in exporter.get_finished_spans()
        if s.kind == SpanKind.SERVER and s.context.trace_id == trace_id
    ]
    assert served_span.name == name and served_span.parent.span_id == span_id
