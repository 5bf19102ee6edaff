"""README.md's Python examples, run as written against a server on loopback.

Each example is read from README.md itself (the first Python block under its
heading), so an edit that breaks one fails here. The names an example leaves to
the reader (the prompt, the verifier's `verify`) are given by the test, which
checks the drafts it gets against the float64 oracle.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from drafting import Expected, hiddens, tokens
from mtp_reference import Reference
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from servers import InProcessServer, small_engine

from mtpdraft.client import DrafterClient
from mtpdraft.service.telemetry import Telemetry

README = Path(__file__).resolve().parents[2] / "README.md"


def example(heading: str) -> str:
    """The first ```python block of README.md's section `heading`."""
    text = README.read_text()
    section = text[text.index(f"\n## {heading}\n") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture(scope="module")
def served(mimo_checkpoint):
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    server = InProcessServer(small_engine(mimo_checkpoint), telemetry=Telemetry(tracer_provider))
    yield server, exporter
    server.stop()


def test_the_client_example_drafts_what_the_oracle_does(served, mimo_checkpoint) -> None:
    server, _ = served
    code = example("Client example").replace("localhost:50051", server.address)
    prompt, prompt_hiddens, sampled = tokens(9, 1), hiddens(9, 1), 17
    exp = Expected(Reference(mimo_checkpoint))
    exp.add(prompt[1:], prompt_hiddens[:-1])
    expected = [exp.propose(sampled, prompt_hiddens[-1], 3)[0]]
    verdicts = [0, 3, 1, 2]  # one step per verdict, then done
    namespace: dict = dict(prompt=prompt, prompt_hiddens=prompt_hiddens, sampled=sampled)

    def verify(drafts: list[int]):
        """The target: accepts the next verdict's count of drafts, checked first."""
        assert drafts == expected[-1]
        step = len(expected) - 1
        accepted, bonus = verdicts[step], tokens(1, 100 + step)[0]
        target_hiddens = hiddens(4, 100 + step)
        exp.verdict(accepted, target_hiddens[:accepted])
        expected.append(exp.propose(bonus, target_hiddens[accepted], 3)[0])
        namespace["done"] = len(expected) > len(verdicts)
        return accepted, bonus, target_hiddens

    namespace |= dict(verify=verify, done=False)
    exec(compile(code, "README.md: Client example", "exec"), namespace)
    assert namespace["done"] and namespace["proposal"].tokens == expected[-1]
    with DrafterClient(server.address, timeout=30) as c:
        assert c.info().live_states == 0  # the example freed its state


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
drafter.info()
(span,) = exporter.get_finished_spans()
print(json.dumps([span.name, span.context.trace_id, span.context.span_id]))
"""


def test_the_traced_client_example_parents_the_server_span(served) -> None:
    """In a process of its own: the example uses the global tracer provider."""
    server, exporter = served
    code = TRACED.format(
        example=example("Observability").replace("localhost:50051", server.address)
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
