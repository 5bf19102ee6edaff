"""`mtpdraft loadtest` over a run's life: warm-up, progress, open-loop latency from the
scheduled arrival, the plot's panels, and the end: a server killed or draining mid-run,
or Ctrl-C, ends the run cleanly with a report of what was measured.

The servers that are killed or drained here are the test's own; the shared one is only
loaded, and left with no live states.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from servers import PATIENCE, SERVER_ARGS, ServerProcess, start_server

from mtpdraft.client.loadtest import (
    EXIT_CUT_SHORT,
    EXIT_INTERRUPTED,
    LoadTestConfig,
    add_loadtest_parser,
    run_load,
    run_loadtest,
)
from mtpdraft.client.loadtest.report import build_report, plot_figure, summary
from mtpdraft.client.loadtest.verifier import (
    Acceptance,
    HiddenPool,
    IntRange,
    Pacer,
    Samples,
    Verifier,
    VerifierSettings,
    WarmUp,
    Window,
)
from mtpdraft.client.types import Proposal, ServerInfo

SHORT = ("--verifiers", "4", "--prompt-len", "4:24", "--seq-len", "6", "--num-drafts", "3")
PNG = b"\x89PNG\r\n\x1a\n"
# A measured progress line (warm-up lines say "warm-up" instead of the seconds).
PROGRESS = re.compile(
    r"mtpdraft loadtest: +(\d+\.\d) s: steps (\d+), drafts/s (\d+), p50 [\d.]+ ms, errors (\d+)"
)
WARMUP = re.compile(
    r"mtpdraft loadtest: warm-up: \d+ steps, \d+ of \d+ verifiers through their \d+, errors \d+"
)


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="mtpdraft")
    add_loadtest_parser(parser.add_subparsers(dest="command", required=True))
    return run_loadtest(parser.parse_args(["loadtest", *argv]))


def _is_code_name(name: str) -> bool:
    return name in grpc.StatusCode.__members__


@pytest.mark.parametrize("mode", ["stream", "unary"])
def test_server_killed_mid_run_ends_it_with_what_was_measured(
    mimo_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture, mode: str
) -> None:
    server = start_server(mimo_checkpoint, *SERVER_ARGS)
    out, plot = tmp_path / "report.json", tmp_path / "report.png"
    killer = threading.Timer(2.5, server.process.kill)  # SIGKILL: no goodbye to anyone
    began = time.monotonic()
    killer.start()
    try:
        rc = _cli(
            "--target", server.address, *SHORT, "--mode", mode, "--duration", "120",
            "--warmup-steps", "2", "--out", str(out), "--plot", str(plot),
        )  # fmt: skip
    finally:
        killer.cancel()
        server.stop()
    assert rc == EXIT_CUT_SHORT
    assert time.monotonic() - began < 60, "the run went on without its server"
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    (line,) = [line for line in captured.err.splitlines() if "cut short" in line]
    assert "the server stopped answering (UNAVAILABLE)" in line and str(out) in line

    report = json.loads(out.read_text())
    assert report["cut_short"] == "the server stopped answering (UNAVAILABLE)"
    assert report["window"]["note"].startswith("cut short after ")
    assert report["steps"] > 0 and report["drafts"] > 0
    assert report["latency_ms"]["propose"]["count"] == report["steps"]
    # Errors by status code name: the refused connections, nothing else's name.
    assert report["errors"].get("UNAVAILABLE", 0) > 0
    assert all(_is_code_name(code) for code in report["errors"]), report["errors"]
    assert report["error_count"] == sum(report["errors"].values())
    assert sum(b["errors"] for b in report["timeline"]) > 0  # when they came, for the plot
    # The server's side up to the last GetInfo it answered.
    assert not report["server_answered_at_end"] and report["live_states_after"] is None
    assert report["server_batches"]["requests"] > 0
    assert "cut short: the server stopped answering" in captured.out
    data = plot.read_bytes()
    assert data[:8] == PNG and len(data) > 20_000


def test_server_draining_ends_the_run_and_gets_its_states_back(
    mimo_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # A long grace period: the server stops early only if the load test frees its states.
    server = start_server(mimo_checkpoint, *SERVER_ARGS, "--grace-period", "100")
    out = tmp_path / "report.json"
    drain = threading.Timer(2.5, server.process.terminate)
    drain.start()
    try:
        rc = _cli(
            "--target", server.address, *SHORT, "--duration", "120", "--warmup-steps", "2",
            "--out", str(out), "--quiet",
        )  # fmt: skip
        assert server.process.wait(60) == 0, "the server waited out its grace period"
    finally:
        drain.cancel()
        server.stop()
    assert rc == EXIT_CUT_SHORT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cut short, the server is draining" in err  # --quiet
    report = json.loads(out.read_text())
    assert report["cut_short"] == "the server is draining"
    assert report["steps"] > 0
    assert all(_is_code_name(code) for code in report["errors"]), report["errors"]
    assert "freed 0 live states" in "".join(server.lines) + server.process.stdout.read()


def test_ctrl_c_ends_the_run_with_a_report(server: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "mtpdraft", "loadtest", "--target", server.address, *SHORT]
    cmd += ["--duration", "120", "--warmup-steps", "1", "--out", str(out)]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in process.stderr:  # progress on stderr: interrupt once steps are measured
            lines.append(line)
            if PROGRESS.match(line):
                break
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=PATIENCE)
    finally:
        process.kill()
    assert process.returncode == EXIT_INTERRUPTED, "".join(lines) + stderr
    assert "Traceback" not in stderr
    assert "cut short, interrupted (Ctrl-C)" in stderr
    report = json.loads(out.read_text())
    assert report["cut_short"] == "interrupted (Ctrl-C)"
    assert report["steps"] > 0 and report["errors"] == {}
    assert report["live_states_after"] == 0  # the verifiers freed their states
    assert "cut short: interrupted" in stdout


def test_progress_lines_go_to_stderr_unless_quiet(
    server: ServerProcess, capsys: pytest.CaptureFixture
) -> None:
    common = ("--target", server.address, *SHORT, "--warmup-steps", "2", "--duration", "3.2")
    assert _cli(*common) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    # A slow start may show the warm-up first; every other line is measured progress.
    warmup = [line for line in lines if WARMUP.match(line)]
    assert lines[: len(warmup)] == warmup, captured.err
    progress = [PROGRESS.match(line) for line in lines[len(warmup) :]]
    assert len(progress) >= 2 and all(progress), captured.err
    seconds = [float(m[1]) for m in progress]
    steps = [int(m[2]) for m in progress]
    assert seconds == sorted(seconds) and steps == sorted(steps) and steps[-1] > 0
    assert all(int(m[3]) > 0 for m in progress) and all(m[4] == "0" for m in progress)
    assert "errors: none" in captured.out
    assert _cli(*common, "--quiet") == 0
    assert capsys.readouterr() == ("", "")


def test_warmup_steps_are_left_out_of_the_figures(server: ServerProcess) -> None:
    config = LoadTestConfig(
        target=server.address, verifiers=4, prompt_len=IntRange(4, 24), seq_len=6,
        num_drafts=3, requests=40, warmup_steps=3,
    )  # fmt: skip
    result = run_load(config)
    report, samples = result.report, result.samples
    assert report["steps"] == 40  # --requests counts after the warm-up
    warmup = report["warmup"]
    assert warmup["steps_per_verifier"] == 3 and warmup["steps"] >= 3 * 4
    assert warmup["seconds"] > 0
    assert min(samples.sent) >= samples.warmup_until  # no warm-up step among the figures
    assert report["latency_ms"]["propose"]["count"] == 40
    assert sum(b["steps"] for b in report["timeline"]) == 40
    assert report["live_states_after"] == 0
    assert "warm-up of" in summary(report)


class _SlowServer:
    """A stand-in for AsyncDrafterClient whose Propose takes SERVICE_S: one verifier
    serves at most 1 / SERVICE_S steps a second, whatever the machine."""

    SERVICE_S = 0.02

    async def alloc_state(self) -> int:
        return 1

    async def free_state(self, state: int) -> bool:
        return True

    async def propose(self, state, token, hidden, position, k, previous=None) -> Proposal:
        await asyncio.sleep(self.SERVICE_S)
        return Proposal(state, [0] * k, [1.0] * k, 1.0, position + 1)


def test_open_loop_latency_counts_from_the_scheduled_arrival() -> None:
    """Arrivals at 4x what one verifier serves: the queue grows, so the latency from the
    scheduled arrival grows with it while the round trip from the send stays put. Measured
    from the send only, the overload would not show (coordinated omission)."""

    async def run() -> Samples:
        samples = Samples()
        settings = VerifierSettings(
            mode="unary", num_drafts=2, seq_len=1000, prompt_len=IntRange(1, 1),
            accept=Acceptance("fixed", 1), refeed=False, vocab_size=100, timeout=5.0, seed=0,
        )  # fmt: skip
        start = time.monotonic()
        samples.warmup_until = start + 0.2
        window = Window(1.8)
        window.open(samples.warmup_until)  # as a warm-up that ended then would
        pacer = Pacer(
            window=window, requests=None,
            rate=4 / _SlowServer.SERVICE_S, verify_s=0.0, verifiers=1, samples=samples, seed=0,
        )  # fmt: skip
        hiddens = HiddenPool(8, 64, "fp32", 0)
        verifier = Verifier(0, _SlowServer(), settings, pacer, hiddens, samples, None)
        pacer.start()
        await verifier.run()
        await pacer.stop()
        return samples

    samples = asyncio.run(run())
    propose = np.asarray(samples.propose)
    waited = np.asarray(samples.waited)
    assert len(propose) > 10 and samples.warmup_steps > 0
    assert np.median(propose) < 3 * _SlowServer.SERVICE_S
    assert np.all(waited >= propose)
    # Half a second into the overload, an arrival waits for hundreds of others.
    assert np.median(waited) > 5 * np.median(propose)
    assert samples.arrivals_unserved > 0
    info = _server_info()
    report = build_report({"rate": 200.0, "warmup_steps": 8}, info, info, samples, [], [])
    lat = report["latency_ms"]
    assert lat["from_arrival"]["p50"] > 5 * lat["propose"]["p50"]
    text = summary(_full(report))
    assert "from the scheduled arrival" in text and "from the send" in text


class _SlowPrefill(_SlowServer):
    """A stand-in whose prefill takes PREFILL_S, many steps' time: a slow machine's start."""

    PREFILL_S = 0.6

    async def prefill(self, state, tokens, hiddens, start_position) -> None:
        await asyncio.sleep(self.PREFILL_S)


def test_the_warmup_ends_after_every_verifiers_prefill_and_first_steps() -> None:
    """The window opens once every verifier has answered its warm-up steps, however long
    their first prefill took: the measured second holds steps only, none of the start."""
    verifiers, steps, seconds = 3, 4, 1.0

    async def run() -> tuple[float, Window, Samples]:
        samples, window = Samples(), Window(seconds)
        settings = VerifierSettings(
            mode="unary", num_drafts=2, seq_len=1000, prompt_len=IntRange(8, 8),
            accept=Acceptance("fixed", 1), refeed=False, vocab_size=100, timeout=5.0, seed=0,
        )  # fmt: skip
        pacer = Pacer(
            window=window, requests=None, rate=None, verify_s=0.0, verifiers=verifiers,
            samples=samples, seed=0,
        )  # fmt: skip
        warmup = WarmUp(verifiers, steps, lambda: window.open(time.monotonic()))
        hiddens = HiddenPool(8, 64, "fp32", 0)
        start = time.monotonic()
        pacer.start()
        await asyncio.gather(
            *(
                Verifier(i, _SlowPrefill(), settings, pacer, hiddens, samples, None, warmup).run()
                for i in range(verifiers)
            )
        )
        await pacer.stop()
        return start, window, samples

    start, window, samples = asyncio.run(run())
    assert window.opens >= start + _SlowPrefill.PREFILL_S + steps * _SlowServer.SERVICE_S
    assert samples.warmup_steps >= verifiers * steps
    assert min(samples.sent) >= window.opens
    # The measured steps fill the window: from its start to its end, a step apart at most.
    assert samples.started - window.opens < 0.1
    assert abs(samples.finished - window.closes) < 0.1
    assert len(samples.sent) > verifiers * seconds / _SlowServer.SERVICE_S / 4


def _record(samples: Samples, at: float, seconds: float = 0.01) -> None:
    samples.record(
        scheduled=at, started=at, sent=at, done=at + seconds, drafts=2, accepted=1,
        verdict=False, first=False,
    )  # fmt: skip


def test_the_report_explains_a_window_that_is_not_the_duration() -> None:
    info = _server_info()

    def window(samples: Samples, cut_short: str | None = None, **config) -> dict:
        config = {"rate": None, "warmup_steps": 8, "duration": 2.0} | config
        report = build_report(config, info, info, samples, [], [], cut_short=cut_short)
        text = summary(_full(report))
        note = report["window"]["note"]
        assert (f"  window: {note}" in text) if note else ("window:" not in text)
        return report["window"]

    samples = Samples()
    samples.warmup_until = 100.0
    for i in range(200):
        _record(samples, 100.0 + i / 100)
    assert window(samples) == {"planned_s": 2.0, "measured_s": pytest.approx(2.0), "note": None}
    # A step answered 1.5 s after the window closed: the window is longer, and says why.
    _record(samples, 101.995, seconds=1.505)
    note = window(samples)["note"]
    assert note.startswith("3.50 s measured of --duration 2 s") and "+1.50 s from its end" in note
    assert window(samples, requests=201)["note"] == "--requests 201 answered in 3.50 s"
    cut = window(samples, cut_short="the server is draining")["note"]
    assert cut == "cut short after 3.50 s of the 2 s planned: the server is draining"
    assert window(Samples())["note"] == "no step was answered in the 2 s of --duration"


def test_open_loop_plot_shows_latency_from_the_arrival(server: ServerProcess) -> None:
    config = LoadTestConfig(
        target=server.address, mode="unary", rate=150.0, verifiers=4, prompt_len=IntRange(4, 24),
        seq_len=6, num_drafts=3, duration=1.5, warmup_steps=2,
    )  # fmt: skip
    result = run_load(config)
    report = result.report
    lat = report["latency_ms"]
    for name in ("p50", "p90", "p99", "max"):
        assert lat["from_arrival"][name] >= lat["step"][name] > 0
    fig = plot_figure(report, result.samples)
    assert len(fig.axes) == 4
    ax_lat, ax_hist = fig.axes[:2]
    lines = {line.get_label(): line for line in ax_lat.get_lines()}
    assert set(lines) == {"p50", "p99", "p99 from arrival"}
    bins = [b for b in report["timeline"] if b["steps"]]
    assert list(lines["p99 from arrival"].get_ydata()) == pytest.approx(
        [b["from_arrival_p99_ms"] for b in bins]
    )
    legend = [t.get_text() for t in ax_hist.get_legend().get_texts()]
    assert legend[:2] == ["from the send", "from the scheduled arrival"]
    assert "open loop 150/s" in fig.get_suptitle()


def test_a_run_with_nothing_measured_still_reports_and_plots(tmp_path: Path) -> None:
    samples = Samples()
    samples.warmup_steps = 3
    samples.error(
        "AllocState",
        grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata()),
    )
    info = _server_info()
    report = build_report(
        {"rate": None, "warmup_steps": 8}, info, info, samples, [], [],
        cut_short="the server stopped answering (UNAVAILABLE)", answered_after=False,
    )  # fmt: skip
    assert report["steps"] == 0 and report["timeline"] == []
    assert report["errors"] == {"UNAVAILABLE": 1} and report["warmup"]["steps"] == 3
    text = summary(_full(report))
    assert "cut short: the server stopped answering" in text
    fig = plot_figure(_full(report), samples)
    assert [ax.get_title() for ax in fig.axes][:3] == [
        "propose latency over time",
        "propose latency histogram",
        "throughput over time",
    ]
    fig.savefig(tmp_path / "empty.png", dpi=100)
    assert (tmp_path / "empty.png").read_bytes()[:8] == PNG


def _server_info() -> ServerInfo:
    return ServerInfo(
        model_family="mimo", hidden_size=8, vocab_size=100, num_attention_heads=1,
        num_key_value_heads=1, head_dim=8, compute_dtype="float32", hidden_dtypes=("float32",),
        device="cpu", max_drafts=8, max_batch=8, max_states=32, live_states=0, kv_block_size=4,
        kv_blocks_total=256, kv_blocks_free=256, kv_handles=0, state_ttl_seconds=60.0,
        max_message_bytes=1 << 20, bitmask_words=0, draining=False,
    )  # fmt: skip


def _full(report: dict) -> dict:
    """A report built from a partial config, completed as the load test's would be."""
    config = {"verifiers": 1, "mode": "unary", "num_drafts": 2, "accept": "fixed:1"}
    return report | {"config": config | report["config"]}
