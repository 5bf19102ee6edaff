"""`mtpdraft serve`'s configuration (one ServeConfig, its parser generated from it) and the
options that change the serving process itself."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from servers import PATIENCE, SERVER_ARGS, start_server

from mtpdraft.client import DrafterClient, InvalidArgument
from mtpdraft.client import messages as m
from mtpdraft.service import cli
from mtpdraft.service.config import ServeConfig
from mtpdraft.service.serving.runner import GIL_SWITCH_INTERVAL_S
from mtpdraft.service.telemetry import Telemetry


def test_the_parser_fills_a_serve_config_with_its_defaults() -> None:
    """Each default is written once, in ServeConfig: no flag given is the dataclass's
    defaults, and every field has its flag."""
    assert cli.parse_serve([]) == ServeConfig()
    given = cli.parse_serve(
        [
            *("--max-queue", "7", "--batch-wait-us", "0", "--max-inflight", "3", "--no-reflection"),
            *("--no-cuda-graphs", "--dtype", "float32", "--state-ttl", "2.5", "--host", "::1"),
            *("--auth-token-file", "tokens"),
        ]
    )
    assert given == dataclasses.replace(
        ServeConfig(),
        max_queue=7,
        batch_wait_us=0.0,
        max_inflight=3,
        reflection=False,
        cuda_graphs=False,
        dtype="float32",
        state_ttl=2.5,
        host="::1",
        auth_token_file="tokens",
    )
    assert given.batch_wait == 0.0 and ServeConfig().batch_wait == pytest.approx(2e-3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        given.port = 1  # type: ignore[misc]


def test_removed_flags_are_refused(capsys) -> None:
    for flag in ("--front-ends", "--torch-threads", "--gil-switch-us"):
        with pytest.raises(SystemExit) as exit_:
            cli.parse_serve([flag, "2"])
        assert exit_.value.code == 2
        assert f"unrecognized arguments: {flag}" in capsys.readouterr().err


def test_help_shows_the_defaults() -> None:
    cmd = [sys.executable, "-m", "mtpdraft", "serve", "--help"]
    usage = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    shown = " ".join(usage.split("options:", 1)[1].split())  # each flag's line, its help
    for flag, default in [
        ("--max-queue N", "(default: 4096)"),
        ("--batch-wait-us US", "(default: 2000.0)"),
        ("--max-message-bytes B", f"(default: {16 << 20})"),
        ("--state-ttl SECONDS", "(default: 600.0)"),
        ("--max-batch N", "(default: 64)"),
        ("--model DIR", "(default: the embedded default model)"),
    ]:
        assert flag in shown
        assert default in shown.split(flag, 1)[1].split(" --", 1)[0], flag


def test_every_serve_option_shows_its_default() -> None:
    _, serve_parser = cli._parser(["serve"])
    for action in serve_parser._actions:
        if action.dest not in ("help", "version"):
            assert "(default: " in action.help, action.option_strings


@pytest.mark.parametrize("argv", [["--version"], ["serve", "--version"]])
def test_version_prints_the_packages(argv: list[str]) -> None:
    cmd = [sys.executable, "-m", "mtpdraft", *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=PATIENCE)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"mtpdraft {importlib.metadata.version('mtpdraft')}\n"


def test_help_and_version_import_no_torch_grpc_or_triton() -> None:
    """The parser runs before the serving stack is imported (a second and more)."""
    script = (
        "import sys\n"
        "from mtpdraft.service.cli import main\n"
        "for argv in (['--help'], ['serve', '--help'], ['--version'], ['serve', '--version']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as exit_:\n"
        "        assert exit_.code == 0, argv\n"
        "heavy = {'torch', 'triton', 'grpc', 'numpy'}\n"
        "print('imported:', sorted(heavy & {name.split('.')[0] for name in sys.modules}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=PATIENCE
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "imported: []"


def test_loadtest_is_still_a_subcommand() -> None:
    cmd = [sys.executable, "-m", "mtpdraft", "loadtest", "--help"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=PATIENCE)
    assert done.returncode == 0, done.stderr
    assert "--verifiers" in done.stdout


@pytest.mark.parametrize(("level", "shown"), [("info", True), ("warning", False)])
def test_log_level_applies_to_the_services_loggers(mimo_checkpoint, level, shown) -> None:
    """The lease reaper logs its frees at info: shown at info, not at warning."""
    server = start_server(mimo_checkpoint, *SERVER_ARGS, "--state-ttl", "1", "--log-level", level)
    try:
        with DrafterClient(server.address, timeout=PATIENCE) as c:
            c.alloc_state()
            deadline = time.monotonic() + PATIENCE
            while c.info().live_states:
                assert time.monotonic() < deadline, "the state was not reaped"
                time.sleep(0.1)
    finally:
        assert server.stop() == 0
    output = "".join(server.lines) + server.process.stdout.read()
    assert ("lease expired: freed 1 states" in output) == shown, output
    assert " DEBUG " not in output, output  # --log-level debug's lines alone


def test_log_level_debug_logs_lifecycles_refusals_and_every_address(
    mimo_checkpoint, tmp_path
) -> None:
    """At debug: a line per event of a state's or a KV handle's life, a line per refused
    request (code, reason, field, the client), the configuration; every address the
    server listens on is printed at start, its Unix socket's too."""
    path = tmp_path / "drafter.sock"
    argv = ("--log-level", "debug", "--state-ttl", "5", "--unix-socket", str(path))
    server = start_server(mimo_checkpoint, *SERVER_ARGS, *argv)
    try:
        with DrafterClient(f"unix:{path}", timeout=PATIENCE) as c:
            taken = c.alloc_state()
            c.prefill(taken, [1, 2, 3], torch.zeros(3, 64), 1)
            handle = c.take_kv(taken).handle_id
            kv = c.export_kv(handle, keep_handle=True)
            imported = c.alloc_state()
            c.import_kv(imported, kv)
            c.install_kv(taken, handle)
            with pytest.raises(InvalidArgument):
                c.propose(taken, 1, torch.zeros(64), 0, 2)
            header = next(m.kv_chunks(kv))
            header.ClearField("k")
            header.ClearField("v")
            cut = c.alloc_state()
            with pytest.raises(InvalidArgument):  # the rows it announces never come
                c.import_kv(cut, [header])
            for state in (taken, imported, cut):
                c.free_state(state)
            idle = c.alloc_state()
            deadline = time.monotonic() + PATIENCE
            while c.info().live_states:
                assert time.monotonic() < deadline, "the idle state was not reaped"
                time.sleep(0.1)
    finally:
        assert server.stop() == 0
    output = "".join(server.lines) + server.process.stdout.read()
    lines = [
        f"mtpdraft: listening on unix:{path}",
        "DEBUG mtpdraft.cli: configuration: ServeConfig(",
        f"state {taken} allocated for ",
        f"state {taken}: KV taken into handle {handle}, 3 rows in 1 blocks",
        f"KV handle {handle} exported, 3 rows; kept",
        f"state {imported}: KV imported, 3 rows",
        f"state {taken}: KV handle {handle} installed, 3 rows",
        "refused INVALID_ARGUMENT POSITION_OUT_OF_RANGE (field position) from unix:",
        f"state {cut}: KV import undone after 0 of 3 rows",
        f"state {imported} freed with 3 rows",
        f"state {idle}: lease expired, freed with 0 rows",
    ]
    for line in lines:
        assert line in output, f"{line!r} not in:\n{output}"


def test_a_second_ctrl_c_while_draining_exits_at_once(mimo_checkpoint) -> None:
    """A live state holds the drain for its 600 s grace; a second SIGINT ends it."""
    server = start_server(mimo_checkpoint, *SERVER_ARGS, "--grace-period", "600")
    try:
        with DrafterClient(server.address, timeout=PATIENCE) as c:
            c.alloc_state()
            server.process.send_signal(signal.SIGINT)
            for line in server.process.stdout:  # blocks until the drain has begun
                if "draining" in line:
                    break
            started = time.monotonic()
            server.process.send_signal(signal.SIGINT)
            assert server.process.wait(PATIENCE) == 130
            assert time.monotonic() - started < PATIENCE / 2
    finally:
        server.stop()
    rest = server.process.stdout.read()
    assert rest.count("interrupted again while draining; exiting now") == 1, rest
    assert "stopped" not in rest and "Traceback" not in rest


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-memory-fraction", "0"], "--kv-memory-fraction 0: must be in (0, 1]"),
        (["--kv-memory-fraction", "1.5"], "--kv-memory-fraction 1.5: must be in (0, 1]"),
        (["--kv-memory-fraction", "-0.2"], "--kv-memory-fraction -0.2: must be in (0, 1]"),
        (["--kv-memory-fraction", "0.5", "--kv-blocks", "64"], "give one"),
        (["--kv-memory-fraction", "0.25", "--kv-blocks", "64"], "give one"),
    ],
)
def test_kv_memory_fraction_is_refused_by_name(flags, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.parse_serve(flags)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_kv_memory_fraction_sizes_the_pool_from_the_free_gpu_memory(monkeypatch) -> None:
    """The GPU path on any machine: a head on "cuda" and a fake free-memory figure. A block
    of 16 rows, 8 KV heads of 128 in bfloat16: 2 x 16 x 8 x 128 x 2 B = 64 KiB."""
    head = SimpleNamespace(
        kv_row_values=2 * 8 * 128,  # K and V of 8 heads of 128
        dtype=torch.bfloat16,
        device=torch.device("cuda"),
    )
    free = 40 << 30
    monkeypatch.setattr(cli.torch.cuda, "mem_get_info", lambda device: (free, 80 << 30))
    assert cli._kv_blocks(cli.parse_serve([]), head) == (10 << 30) // (64 << 10)  # a quarter
    given = cli.parse_serve(["--kv-memory-fraction", "0.9"])
    assert cli._kv_blocks(given, head) == int(free * 0.9) // (64 << 10)
    assert cli._kv_blocks(cli.parse_serve(["--kv-blocks", "7"]), head) == 7
    cpu = SimpleNamespace(**{**vars(head), "device": torch.device("cpu")})
    assert cli._kv_blocks(given, cpu) == (256 << 20) // (64 << 10)  # 256 MiB of host memory


def test_kv_pool_blocks_is_at_least_one() -> None:
    assert cli.kv_pool_blocks(10 << 20, 0.5, 1 << 20) == 5
    assert cli.kv_pool_blocks(100, 0.5, 1 << 20) == 1


def test_the_server_sets_the_gil_switch_interval(mimo_checkpoint: Path) -> None:
    config = cli.parse_serve(["--model", str(mimo_checkpoint), "--device", "cpu", "--port", "0"])
    engine = cli.build_engine(config)
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)  # Python's default: the server, not the process, sets it

    async def serve() -> float:
        server = cli.build_server(config, engine, Telemetry())
        try:
            await server.start()
            interval = sys.getswitchinterval()
            # It serves: the setting is made where the server is built, not instead of it.
            with DrafterClient(f"127.0.0.1:{server.port}") as client:
                info = await asyncio.to_thread(client.info)
            assert info.max_batch == config.max_batch
            return interval
        finally:
            await server.drain(0)

    try:
        assert asyncio.run(serve()) == pytest.approx(GIL_SWITCH_INTERVAL_S)
    finally:
        sys.setswitchinterval(before)


@pytest.mark.parametrize("env, expected", [(None, 1), ("2", "unchanged")])
def test_the_server_gives_torch_one_thread_unless_omp_num_threads_is_set(
    monkeypatch: pytest.MonkeyPatch, env: str | None, expected: int | str
) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        if env is None:
            monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        else:
            monkeypatch.setenv("OMP_NUM_THREADS", env)
        cli.limit_cpu_threads()
        assert torch.get_num_threads() == (3 if expected == "unchanged" else expected)
    finally:
        torch.set_num_threads(before)
