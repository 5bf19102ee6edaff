"""`mtpdraft loadtest` against a real server on loopback: reports, modes, tracing, refusals,
targets of every kind (HOST:PORT, unix:PATH) with the clients' TLS, mutual TLS and token.

Runs are short (1-2 s, a few verifiers, short prompts and sequences) so that the
whole file stays well under a minute on two cores. Every run must leave the
shared server as it found it: no live states.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind
from secured_servers import TOKEN, SecuredServers
from servers import InProcessServer, ServerProcess, recording_tracer, small_engine

from mtpdraft.client import DrafterClient
from mtpdraft.client.loadtest import (
    LoadTestConfig,
    LoadTestError,
    add_loadtest_parser,
    run_load,
    run_loadtest,
)
from mtpdraft.client.loadtest.report import MAX_PLOT_POINTS
from mtpdraft.client.loadtest.verifier import Acceptance, IntRange
from mtpdraft.service.telemetry import Telemetry

# Small enough for the shared test server (32 states, 1024 KV rows, K <= 8).
SHORT = ("--verifiers", "4", "--prompt-len", "4:24", "--seq-len", "6", "--num-drafts", "3")


def _cli(*argv: str) -> int:
    """`mtpdraft loadtest ARGV` as the mtpdraft command will dispatch it."""
    parser = argparse.ArgumentParser(prog="mtpdraft")
    add_loadtest_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["loadtest", *argv])
    return run_loadtest(args)


def _config(server: ServerProcess, **options) -> LoadTestConfig:
    base = dict(
        target=server.address,
        verifiers=4,
        prompt_len=IntRange(4, 24),
        seq_len=6,
        num_drafts=3,
        duration=1.5,
    )
    return LoadTestConfig(**(base | options))


def _check_report(report: dict, *, k: int = 3) -> None:
    """What every clean run must report."""
    assert report["cut_short"] is None and report["server_answered_at_end"]
    assert report["errors"] == {} and report["error_count"] == 0
    assert report["steps"] > 0 and report["drafts"] > 0
    assert report["drafts_per_s"] > 0 and report["steps_per_s"] > 0
    assert report["steps"] <= report["drafts"] <= k * report["steps"]
    assert 0 <= report["accepted"] <= report["drafts"]
    for stats in report["latency_ms"].values():
        assert stats["count"] == report["steps"]
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"]
    warmup, verifiers = report["warmup"], report["config"]["verifiers"]
    assert warmup["steps_per_verifier"] == report["config"]["warmup_steps"]
    # Closed or open loop, every verifier answers its warm-up steps before the window opens.
    assert warmup["steps"] >= warmup["steps_per_verifier"] * verifiers
    assert (warmup["seconds"] > 0) == (warmup["steps_per_verifier"] > 0)
    batches = report["server_batches"]
    # Every Propose (unary or stream message) runs in exactly one batched forward. After a
    # warm-up the server's count starts at a GetInfo at its end: the steps in flight
    # around it may fall on either side.
    slack = 4 * verifiers if warmup["steps_per_verifier"] else 0
    assert abs(batches["requests"] - report["steps"]) <= slack
    assert sum(batches["counts"].values()) == batches["batches"] > 0
    assert max(int(size) for size in batches["counts"]) <= report["config"]["verifiers"]
    assert report["live_states_after"] == 0, "a state leaked"
    assert sum(bin["steps"] for bin in report["timeline"]) == report["steps"]


def _check_plot(fig, report: dict, plot: Path) -> None:
    """The figure shows the report's run in four titled panels: every step's latency with
    the timeline's p50 and p99, the latency histogram, throughput over time and the
    server's batch sizes; the PNG is that figure, read back."""
    import matplotlib.image
    import numpy as np
    from matplotlib.colors import to_rgb

    ax_lat, ax_hist, ax_rate, ax_batch = fig.axes
    c = report["config"]
    assert fig.get_suptitle().startswith(
        f"mtpdraft loadtest: {c['verifiers']} verifiers, stream, closed loop, "
        f"K={c['num_drafts']}: {report['drafts_per_s']:.0f} drafts/s"
    )
    seconds = "seconds since the first measured step"
    labels = [(ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) for ax in fig.axes]
    assert labels == [
        ("propose latency over time", seconds, "latency (ms)"),
        ("propose latency histogram", "latency (ms)", "steps"),
        ("throughput over time", seconds, "per second"),
        (
            f"server batch sizes (mean {report['server_batches']['mean_batch']:.2f})",
            "requests per batched forward",
            "batches",
        ),
    ]
    (scatter,) = ax_lat.collections
    sent, latency = np.asarray(scatter.get_offsets()).T
    stats = report["latency_ms"]["propose"]
    assert stats["count"] == report["steps"]
    assert len(latency) == min(report["steps"], MAX_PLOT_POINTS)
    if len(latency) == report["steps"]:  # every step drawn, none sampled away
        assert latency.max() == pytest.approx(stats["max"])
        assert np.percentile(latency, 50) == pytest.approx(stats["p50"])
    assert sent.min() >= 0 and sent.max() <= report["elapsed_s"]
    bins = [b for b in report["timeline"] if b["steps"]]
    middles = [b["t"] + report["timeline_bin_s"] / 2 for b in bins]
    lines = {line.get_label(): line for line in ax_lat.get_lines()}
    assert set(lines) == {"p50", "p99"}
    for name, line in lines.items():
        assert list(line.get_ydata()) == pytest.approx([b[f"{name}_ms"] for b in bins])
        assert list(line.get_xdata()) == pytest.approx(middles)
    legend = [t.get_text() for t in ax_lat.get_legend().get_texts()]
    assert legend == ["propose round trip", "p50", "p99"]
    # The histogram holds every step once.
    assert sum(bar.get_height() for bar in ax_hist.patches) == report["steps"]
    # Throughput per bin; no errors line on a clean run.
    rate = {line.get_label(): list(line.get_ydata()) for line in ax_rate.get_lines()}
    assert set(rate) == {"drafts/s", "steps/s"}
    assert rate["drafts/s"] == pytest.approx([b["drafts_per_s"] for b in report["timeline"]])
    assert sum(rate["steps/s"]) * report["timeline_bin_s"] == pytest.approx(report["steps"])
    counts = report["server_batches"]["counts"]
    bars = {round(bar.get_x() + bar.get_width() / 2): bar.get_height() for bar in ax_batch.patches}
    assert bars == {int(size): n for size, n in counts.items()}
    # The file is this figure: its size at 100 dpi, with the bars' and the p99 line's colours.
    image = matplotlib.image.imread(plot)[..., :3]
    assert image.shape[:2] == (round(fig.get_figheight() * 100), round(fig.get_figwidth() * 100))
    for colour in ("tab:orange", "tab:red"):
        assert (np.abs(image - to_rgb(colour)).max(-1) < 0.02).sum() > 20, colour


def test_stream_closed_loop_writes_json_and_png(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch
) -> None:
    from matplotlib.figure import Figure

    saved = []
    savefig = Figure.savefig

    def keep(fig, *args, **kwargs):  # the figure the loadtest saves, for _check_plot
        saved.append(fig)
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    out, plot = tmp_path / "report.json", tmp_path / "report.png"
    rc = _cli(
        "--target", server.address, *SHORT, "--duration", "2", "--out", str(out),
        "--plot", str(plot), "--accept", "geometric:0.7",
    )  # fmt: skip
    assert rc == 0
    assert "errors: none" in capsys.readouterr().out
    report = json.loads(out.read_text())
    _check_report(report)
    assert report["config"]["mode"] == "stream" and report["config"]["rate"] is None
    assert "from_arrival" not in report["latency_ms"]
    assert report["sequences"] >= 4
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = saved
    _check_plot(fig, report, plot)


def test_unary_open_loop_with_refeed(server: ServerProcess) -> None:
    config = _config(
        server, mode="unary", rate=150.0, refeed=True, dtype="bf16", accept=Acceptance("uniform")
    )
    report = run_load(config).report
    _check_report(report)
    assert report["latency_ms"]["from_arrival"]["count"] == report["steps"]
    assert report["verdicts"] > 0 and report["accepted"] > 0
    # Poisson at 150/s for 1.5 s: about 225 arrivals, served or reported.
    arrivals = report["steps"] + report["arrivals_dropped"] + report["arrivals_unserved"]
    assert 120 < arrivals < 340


def test_split_mode_counts_requests_over_two_processes(server: ServerProcess) -> None:
    config = _config(
        server, mode="split", requests=60, duration=None, accept=Acceptance("fixed", 2),
        processes=2, warmup_steps=0,
    )  # fmt: skip
    report = run_load(config).report
    _check_report(report)
    assert report["steps"] == 60
    # fixed:2 of 3 drafts; every step but each sequence's first sends an AfterVerify.
    assert report["accepted"] == 2 * report["steps"]
    assert report["verdicts"] == report["steps"] - report["sequences"]
    step, propose = report["latency_ms"]["step"], report["latency_ms"]["propose"]
    assert step["mean"] > propose["mean"]  # two round trips per step


def test_errors_are_counted_and_fail_only_when_asked(server: ServerProcess) -> None:
    # All of the server's state slots but one are held here: the verifiers' allocations
    # are refused while another verifier holds the last one, however fast the server.
    with DrafterClient(server.address, timeout=30) as c:
        held = [c.alloc_state() for _ in range(c.info().max_states - 1)]
        try:
            many = ("--verifiers", "8", "--prompt-len", "2", "--seq-len", "4", "--num-drafts", "2")
            common = (
                "--target", server.address, *many, "--mode", "unary", "--duration", "1", "--quiet"
            )  # fmt: skip
            assert _cli(*common) == 0
            assert _cli(*common, "--fail-on-error") == 1
            report = run_load(
                _config(server, verifiers=8, prompt_len=IntRange(2, 2), seq_len=4, duration=1.0)
            ).report
            assert report["errors"].get("RESOURCE_EXHAUSTED", 0) > 0
            assert set(report["errors_by_rpc"]) == {"AllocState RESOURCE_EXHAUSTED"}
            assert report["steps"] > 0  # the free slot served
            assert report["live_states_after"] == len(held)  # the verifiers freed theirs
        finally:
            for state in held:
                c.free_state(state)


def test_step_spans_are_ancestors_of_server_spans(mimo_checkpoint: Path) -> None:
    tracer_provider, exporter = recording_tracer()
    server = InProcessServer(
        small_engine(mimo_checkpoint), telemetry=Telemetry(tracer_provider, None)
    )
    try:
        config = LoadTestConfig(
            target=server.address, mode="unary", verifiers=2, requests=8, seq_len=4,
            prompt_len=IntRange(6, 6), num_drafts=2, warmup_steps=0,
        )  # fmt: skip
        report = run_load(config, tracer_provider=tracer_provider).report
    finally:
        server.stop()
    _check_report(report, k=2)
    spans = exporter.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}

    def ancestors(span: ReadableSpan) -> list[str]:
        names = []
        while span.parent is not None and span.parent.span_id in by_id:
            span = by_id[span.parent.span_id]
            names.append(span.name)
        return names

    served = [
        s for s in spans if s.name == "/mtpdraft.v1.Drafter/Propose" and s.kind == SpanKind.SERVER
    ]
    assert len(served) == report["steps"] == 8
    for span in served:
        chain = ancestors(span)
        assert chain[:2] == ["/mtpdraft.v1.Drafter/Propose", "loadtest.step"], chain
        assert chain[-1] == "loadtest.sequence"
    steps = [s for s in spans if s.name == "loadtest.step"]
    assert len(steps) == 8
    assert all(s.attributes["mtpdraft.loadtest.drafts"] == 2 for s in steps)
    assert not [s for s in spans if s.name.endswith("GetInfo") and s.kind == SpanKind.CLIENT]


def test_a_run_over_mutual_tls_with_a_token(
    secured_servers: SecuredServers, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    s, out = secured_servers, tmp_path / "report.json"
    tls = ("--tls-ca", str(s.ca), "--tls-cert", str(s.client_cert), "--tls-key", str(s.client_key))
    common = ("--target", s.tls_address, *SHORT, "--duration", "1", "--warmup-steps", "2")
    token = ("--token-file", str(s.token_file))
    assert _cli(*common, *tls, *token, "--tls-server-name", "localhost", "--out", str(out)) == 0
    report = json.loads(out.read_text())
    _check_report(report)
    assert report["config"]["security"] == "mutual TLS, bearer token"
    assert TOKEN not in out.read_text() and "PRIVATE KEY" not in out.read_text()
    capsys.readouterr()
    # Each missing part is refused by the server, in one line: no token, no certificate.
    assert _cli(*common, *tls, "--quiet") == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert _cli(*common, "--tls-ca", str(s.ca), *token, "--quiet") == 1
    assert f"cannot use the server at {s.tls_address}: " in capsys.readouterr().err
    assert _cli(*common, "--tls-cert", str(s.client_cert), "--quiet") == 2
    assert "--tls-cert and --tls-key go together" in capsys.readouterr().err
    assert _cli(*common, *tls, "--token-file", str(tmp_path / "none")) == 2
    assert "--token-file" in capsys.readouterr().err


def test_a_run_over_a_unix_socket_in_two_processes(
    secured_servers: SecuredServers, tmp_path: Path
) -> None:
    out = tmp_path / "report.json"
    rc = _cli(
        "--target", secured_servers.unix_target, *SHORT, "--requests", "40", "--processes", "2",
        "--warmup-steps", "1", "--token-file", str(secured_servers.token_file), "--quiet",
        "--out", str(out),
    )  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    _check_report(report)
    assert report["steps"] == 40 and report["config"]["target"] == secured_servers.unix_target
    # A token without TLS goes only to a Unix socket or a loopback address.
    assert report["config"]["security"] == "plaintext, bearer token"
    assert report["window"]["note"] == f"--requests 40 answered in {report['elapsed_s']:.2f} s"


@pytest.mark.parametrize(
    "target",
    ["127.0.0.1:50051", "localhost:9", "[::1]:50051", "10.0.0.1:50051", "example.com:50051",
     "drafter-0.drafter.mtpdraft.svc.cluster.local:50051", "[2001:db8::1]:1",
     "unix:/tmp/sock", "unix:///tmp/sock", "dns:///drafter.internal:50051",
     "ipv4:10.0.0.1:1,10.0.0.2:1"],
)  # fmt: skip
def test_any_target_a_client_reaches_is_accepted(target: str) -> None:
    LoadTestConfig(target=target).validate()


@pytest.mark.parametrize("target", ["127.0.0.1", "example.com", "", "host:0", "host:port"])
def test_a_target_without_a_port_is_refused(target: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(LoadTestError, match="give HOST:PORT"):
        run_load(LoadTestConfig(target=target, duration=1.0))
    assert _cli("--target", target, "--duration", "1") == 2
    assert "give HOST:PORT" in capsys.readouterr().err


def test_bounds_are_defaults_a_user_can_raise(capsys: pytest.CaptureFixture) -> None:
    for options, bound in (
        ({"duration": 601.0}, "--max-duration"),
        ({"verifiers": 1025}, "--max-verifiers"),
        ({"duration": 30.0, "max_duration": 20.0}, "--max-duration"),
    ):
        with pytest.raises(LoadTestError, match=bound):
            LoadTestConfig(**options).validate()
    LoadTestConfig(duration=3600.0, max_duration=3600.0).validate()
    LoadTestConfig(verifiers=2048, max_verifiers=2048).validate()
    assert LoadTestConfig(requests=10).run_seconds == 600.0
    assert LoadTestConfig(requests=10, max_duration=900.0).run_seconds == 900.0
    # Raised from the command line too: refused (2) below the bound, past the check above it.
    assert _cli("--target", "127.0.0.1:1", "--duration", "900") == 2
    assert "--max-duration" in capsys.readouterr().err
    assert _cli("--target", "127.0.0.1:1", "--duration", "900", "--max-duration", "900") == 1
    assert "cannot use the server at 127.0.0.1:1" in capsys.readouterr().err


def test_bounds_and_arguments_are_checked(capsys: pytest.CaptureFixture) -> None:
    for options in (
        {"verifiers": 0},
        {"processes": 5, "verifiers": 4},
        {"rate": 0.0},
        {"mode": "batch"},
        {"warmup_steps": -1},
    ):
        with pytest.raises(LoadTestError):
            LoadTestConfig(**options).validate()
    assert LoadTestConfig().run_seconds == 10.0
    with pytest.raises(SystemExit):
        _cli("--accept", "geometric:1.5")
    with pytest.raises(SystemExit):
        _cli("--prompt-len", "64:8")
    assert "--accept" in capsys.readouterr().err


def test_help_shows_every_default() -> None:
    parser = argparse.ArgumentParser(prog="mtpdraft")
    add_loadtest_parser(parser.add_subparsers(dest="command"))
    (loadtest,) = parser._subparsers._group_actions[0].choices.values()
    options = [a for a in loadtest._actions if a.dest != "help"]
    assert {"--max-duration", "--max-verifiers", "--warmup-steps", "--tls-ca", "--token-file"} <= {
        flag for a in options for flag in a.option_strings
    }
    for action in options:
        assert "(default: " in action.help, action.option_strings
    shown = " ".join(loadtest.format_help().split("options:", 1)[1].split())
    for flag, default in [
        ("--verifiers N", "(default: 4)"),
        ("--duration SECONDS", "(default: 10;"),
        ("--max-duration SECONDS", "(default: 600.0)"),
        ("--max-verifiers N", "(default: 1024)"),
        ("--warmup-steps N", "(default: 8)"),
        ("--target HOST:PORT", "(default: 127.0.0.1:50051)"),
    ]:
        assert default in shown.split(flag, 1)[1].split(" --", 1)[0], flag


def test_acceptance_distributions() -> None:
    import random

    rng = random.Random(0)
    assert Acceptance.parse("fixed:2").draw(rng, 4) == 2
    assert Acceptance.parse("fixed:9").draw(rng, 4) == 4
    assert {Acceptance.parse("uniform").draw(rng, 3) for _ in range(200)} == {0, 1, 2, 3}
    geometric = Acceptance.parse("geometric:0.5")
    draws = [geometric.draw(rng, 50) for _ in range(4000)]
    assert abs(sum(draws) / len(draws) - 1.0) < 0.1  # mean p / (1 - p)
    assert Acceptance.parse("geometric:0").draw(rng, 4) == 0
    assert Acceptance.parse("geometric:1").draw(rng, 4) == 4
    assert str(Acceptance.parse("geometric:0.7")) == "geometric:0.7"
    assert IntRange.parse("64:512", "--prompt-len", 1, 1000) == IntRange(64, 512)
    assert str(IntRange.parse("128", "--prompt-len", 1, 1000)) == "128"
