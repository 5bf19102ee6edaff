"""What the proxy in front of the replicas costs: direct against through nginx, one run.

One replica (`mtpdraft serve`, the embedded default model unless --model) and Debian's
nginx in front of it, configured as deploy/local.py configures it for three (one upstream
here, so that only the extra hop differs). Every figure is measured both ways, the two
alternating round by round (--rounds), and the medians kept:

1. batch 1: one verifier, one state, closed loop, K drafts a step, each step carrying
   the previous step's verdict (0 accepted: the same rows every step), over ProposeStream
   and over unary Propose: the round trip's p50 and mean, and what the proxy adds;
2. a verifier of B states (--columns) stepping them as one ProposeBatch message:
   its step's p50, direct and proxied;
3. many verifiers (--streams concurrent ProposeStreams, one state each, each its own
   affinity key): drafts per second for --seconds, and the proxy's throughput ratio,
   with the nginx worker's CPU time per proxied message.

The clients are the package's asyncio client, in this process. On a small CPU the
server, nginx and the clients share the cores, so (3) charges nginx's CPU to the
throughput; where the proxy has cores of its own, it costs latency, not drafts/s.
Writes proxy.json and proxy.md to --out-dir (bench/results by default).

    python bench/bench_proxy.py [--model DIR] [--device cpu|cuda] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "deploy"))
import grpc  # noqa: E402
import grpc_floor  # noqa: E402
import local  # noqa: E402  (deploy/local.py)
from results_file import write_results  # noqa: E402

from mtpdraft.client import AFFINITY_HEADER, AsyncDrafterClient, Verdict  # noqa: E402

PROMPT = 64
K = 4
# Each step keeps one row (0 accepted: the proposed token's): a state is renewed before it
# holds this many more, far below the model's max_position_embeddings.
RENEW_AFTER = 2000
FLOOR_HIDDEN = 4096  # the floor's messages are MiMo-7B's: a bf16 hidden of 4096
CALL_TIMEOUT = 120.0
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _rows(rng: np.random.Generator, n: int, hidden: int) -> tuple[list[int], np.ndarray]:
    return rng.integers(0, 100, n).tolist(), rng.standard_normal((n, hidden), np.float32)


async def _new_state(client: AsyncDrafterClient, hidden: int, seed: int) -> int:
    tokens, hiddens = _rows(np.random.default_rng(seed), PROMPT - 1, hidden)
    state = await client.alloc_state()
    await client.prefill(state, tokens, hiddens, 1)
    return state


class _State:
    """A state stepped with 0 accepted: each step one row more, renewed now and then."""

    def __init__(self, client: AsyncDrafterClient, hidden: int, seed: int) -> None:
        self.client, self.hidden, self.seed = client, hidden, seed
        self.id, self.position, self.previous = 0, PROMPT, None

    async def renewed(self) -> _State:
        """A fresh state where there is none or this one has grown long (not timed)."""
        if self.id and self.position < PROMPT + RENEW_AFTER:
            return self
        if self.id:
            await self.client.free_state(self.id)
        self.id = await _new_state(self.client, self.hidden, self.seed)
        self.position, self.previous = PROMPT, None
        return self

    def stepped(self) -> None:
        self.position, self.previous = self.position + 1, Verdict(0)


async def batch1(targets: dict[str, str], hidden: int, steps: int, unary: bool) -> dict:
    """Round trips (s) of one verifier's closed-loop steps on one state, for each target,
    the targets taking turns step by step (whatever else the machine does falls on all)."""
    clients = {n: AsyncDrafterClient(t, affinity_key="batch-1", timeout=CALL_TIMEOUT)
               for n, t in targets.items()}  # fmt: skip
    h = np.random.default_rng(2).standard_normal(hidden, np.float32)
    states = {n: _State(c, hidden, 1) for n, c in clients.items()}
    streams = {n: c.stream() for n, c in clients.items()}
    times: dict[str, list[float]] = {n: [] for n in targets}
    for step in range(steps + 20):
        for n, c in clients.items():
            s = await states[n].renewed()
            propose = c.propose if unary else streams[n].propose
            t = time.perf_counter()
            await propose(s.id, 7, h, s.position, K, previous=s.previous)
            if step >= 20:  # the first steps warm both sides up
                times[n].append(time.perf_counter() - t)
            s.stepped()
    for n, c in clients.items():
        await streams[n].close()
        await c.free_state(states[n].id)
        await c.close()
    return times


async def columns(targets: dict[str, str], hidden: int, steps: int, size: int) -> dict:
    """Step times (s) of one verifier of `size` states, a ProposeBatch message a step,
    for each target, taking turns."""
    clients = {n: AsyncDrafterClient(t, affinity_key="columns", timeout=CALL_TIMEOUT)
               for n, t in targets.items()}  # fmt: skip
    states = {n: [await _new_state(c, hidden, 10 + i) for i in range(size)]
              for n, c in clients.items()}  # fmt: skip
    h = np.random.default_rng(3).standard_normal((size, hidden), np.float32)
    times: dict[str, list[float]] = {n: [] for n in targets}
    for step in range(steps + 10):  # steps < RENEW_AFTER: no state grows too long
        for n, c in clients.items():
            accepted = [0] * size if step else None
            t = time.perf_counter()
            await c.propose_batch(
                states[n], [7] * size, [PROMPT + step] * size, h, K, num_accepted=accepted
            )
            if step >= 10:
                times[n].append(time.perf_counter() - t)
    for n, c in clients.items():
        for state in states[n]:
            await c.free_state(state)
        await c.close()
    return times


async def streams(target: str, hidden: int, count: int, seconds: float) -> dict:
    """`count` closed-loop verifiers (a stream and a key each) on one channel: drafts/s."""
    async with AsyncDrafterClient(target, timeout=CALL_TIMEOUT) as c:
        keyed = [c.keyed(f"verifier-{i}") for i in range(count)]
        states = [await _State(k, hidden, 100 + i).renewed() for i, k in enumerate(keyed)]
        h = np.random.default_rng(4).standard_normal(hidden, np.float32)
        counts, sent = [0] * count, [0] * count
        step_times: list[float] = []
        start = stop = 0.0

        async def verifier(i: int) -> None:
            async with keyed[i].stream() as stream:
                while time.perf_counter() < stop:
                    s = await states[i].renewed()
                    now = time.perf_counter()
                    p = await stream.propose(s.id, 7, h, s.position, K, previous=s.previous)
                    sent[i] += 1
                    if now >= start:
                        counts[i] += len(p.tokens)
                        step_times.append(time.perf_counter() - now)
                    s.stepped()

        start = time.perf_counter() + 1.0  # a second of warm-up, not counted
        stop = start + seconds
        await asyncio.gather(*(verifier(i) for i in range(count)))
        elapsed = time.perf_counter() - start
        for k, s in zip(keyed, states, strict=True):
            await k.free_state(s.id)
    return {
        "drafts_per_s": sum(counts) / elapsed,
        "messages": sum(sent),  # the warm-up's too: nginx's CPU is per message of them all
        "step_p50_ms": statistics.median(step_times) * 1e3,
    }


# --- the floor: a canned-reply server (bench/grpc_floor.py), no engine -----------------


def _floor_request() -> bytes:
    """A verifier's ProposeStream message of MiMo-7B's shape, one state (a batch of one): a
    bf16 hidden of 4096."""
    from mtpdraft.client import messages as m

    h = np.random.default_rng(5).standard_normal((1, FLOOR_HIDDEN), np.float32)
    request = m.batch_request([1], [7], [2048], h.astype(np.float16), K, num_accepted=[0])
    request.hiddens.dtype = m.pb.DTYPE_BF16  # the same bytes: only their size matters here
    return request.SerializeToString()


async def floor_batch1(targets: dict[str, str], steps: int) -> dict:
    """Round trips (s) of one stream's messages to the canned-reply server, for each
    target, taking turns."""
    request, channels, calls = _floor_request(), {}, {}
    metadata = ((AFFINITY_HEADER, "batch-1"),)
    for n, t in targets.items():
        channels[n] = grpc.aio.insecure_channel(t)
        calls[n] = channels[n].stream_stream(f"/{grpc_floor.SERVICE}/{grpc_floor.METHOD}")(
            metadata=metadata
        )
    times: dict[str, list[float]] = {n: [] for n in targets}
    for step in range(steps + 50):
        for n, call in calls.items():
            t = time.perf_counter()
            await call.write(request)
            await call.read()
            if step >= 50:
                times[n].append(time.perf_counter() - t)
    for n, call in calls.items():
        await call.done_writing()
        await channels[n].close()
    return times


async def floor_streams(target: str, count: int, seconds: float) -> dict:
    """`count` streams (a key each) sending back to back for `seconds`: messages/s."""
    request, metadata = _floor_request(), [((AFFINITY_HEADER, f"v{i}"),) for i in range(count)]
    done, sent = [0] * count, [0] * count
    async with grpc.aio.insecure_channel(target) as channel:
        open_call = channel.stream_stream(f"/{grpc_floor.SERVICE}/{grpc_floor.METHOD}")
        start = time.perf_counter() + 0.5
        stop = start + seconds

        async def run(i: int) -> None:
            call = open_call(metadata=metadata[i])
            while (now := time.perf_counter()) < stop:
                await call.write(request)
                await call.read()
                done[i] += now >= start
                sent[i] += 1
            await call.done_writing()

        await asyncio.gather(*(run(i) for i in range(count)))
        elapsed = time.perf_counter() - start
    return {"messages_per_s": sum(done) / elapsed, "messages": sum(sent)}


def _nginx_cpu_s(proxy: local.Proxy) -> float:
    """CPU seconds of nginx's master and workers so far."""
    total, pids = 0.0, [proxy.process.pid]
    children = Path(f"/proc/{proxy.process.pid}/task/{proxy.process.pid}/children")
    if children.exists():
        pids += [int(p) for p in children.read_text().split()]
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    return total


def _summary(times: list[float]) -> dict:
    us = np.asarray(times) * 1e6
    return {"p50_us": float(np.median(us)), "mean_us": float(us.mean()),
            "p90_us": float(np.percentile(us, 90))}  # fmt: skip


def _compared(times: dict[str, list[float]]) -> dict:
    """Each target's summary, and what the proxy adds to the direct figures."""
    out = {n: _summary(t) for n, t in times.items()}
    out["added"] = {k: out["proxy"][k] - out["direct"][k] for k in ("p50_us", "mean_us")}
    return out


async def _windows(run, proxy: local.Proxy, targets: dict[str, str], rounds: int) -> dict:
    """`run(target)` for each target in turn, `rounds` times: each figure's median, the
    proxy's throughput ratio and nginx's CPU per message proxied."""
    got: dict[str, list[dict]] = {n: [] for n in targets}
    for _ in range(rounds):
        for n, t in targets.items():
            cpu = _nginx_cpu_s(proxy)
            result = await run(t)
            if n == "proxy":
                spent = _nginx_cpu_s(proxy) - cpu
                result["nginx_cpu_us_per_message"] = spent / max(result["messages"], 1) * 1e6
            got[n].append(result)
    out = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in got.items()}
    rate = next(k for k in out["direct"] if k.endswith("_per_s"))
    out["ratio"] = out["proxy"][rate] / out["direct"][rate]
    out["rounds"] = got
    return out


def _proxied(targets: list[str], run) -> dict:
    """`run(targets, proxy)` with nginx in front of `targets`."""
    with tempfile.TemporaryDirectory(prefix="bench-proxy-") as tmp:
        proxy = local.start_proxy(targets, Path(tmp))
        try:
            return asyncio.run(run({"direct": targets[0], "proxy": proxy.address}, proxy))
        finally:
            proxy.stop()


def measure(args: argparse.Namespace) -> dict:
    async def floor(targets: dict[str, str], proxy: local.Proxy) -> dict:
        return {
            "batch1": _compared(await floor_batch1(targets, args.steps * 4)),
            "streams": await _windows(
                lambda t: floor_streams(t, args.streams, args.seconds), proxy, targets,
                args.rounds,
            ),
        }  # fmt: skip

    async def served(targets: dict[str, str], proxy: local.Proxy) -> dict:
        async with AsyncDrafterClient(targets["direct"], timeout=CALL_TIMEOUT) as c:
            info = await c.info()
        hidden = info.hidden_size
        return {
            "model": {"family": info.model_family, "hidden_size": hidden,
                      "compute_dtype": info.compute_dtype, "device": info.device},
            "stream": _compared(await batch1(targets, hidden, args.steps, unary=False)),
            "unary": _compared(await batch1(targets, hidden, args.steps, unary=True)),
            "columns": _compared(await columns(targets, hidden, args.steps // 4, args.columns)),
            "streams": await _windows(
                lambda t: streams(t, hidden, args.streams, args.seconds), proxy, targets,
                args.rounds,
            ),
        }  # fmt: skip

    canned = grpc_floor.start_server(K, 0.0)
    try:
        result = {"floor": _proxied([canned.target], floor)}
    finally:
        canned.stop()
    serve = ["--device", args.device, "--max-batch", "64", "--max-states", "512"]
    serve += shlex.split(args.serve_args)
    if args.model:
        serve += ["--model", args.model]
    (replica,) = local.start_replicas(1, serve)
    try:
        result["served"] = _proxied([replica.address], served)
    finally:
        replica.stop()
    return result


def _environment(args: argparse.Namespace) -> dict:
    nginx = local.find_nginx()
    version = subprocess.run([nginx, "-v"], capture_output=True, text=True).stderr.strip()
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "command": shlex.join(["python", "bench/bench_proxy.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "grpcio": importlib.metadata.version("grpcio"),
        "nginx": version.removeprefix("nginx version: "),
        "k": K,
        "prompt_rows": PROMPT,
        "rounds": args.rounds,
        "steps": args.steps,
        "columns": args.columns,
        "streams": args.streams,
        "seconds": args.seconds,
    }


def _latency_rows(rows: list[tuple[str, dict]]) -> list[str]:
    out = [
        "| per call | direct p50 | proxy p50 | added p50 | direct mean | proxy mean | added mean |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, r in rows:
        d, p, a = r["direct"], r["proxy"], r["added"]
        out.append(
            f"| {label} | {d['p50_us']:.0f} us | {p['p50_us']:.0f} us | {a['p50_us']:+.0f} us | "
            f"{d['mean_us']:.0f} us | {p['mean_us']:.0f} us | {a['mean_us']:+.0f} us |"
        )
    return out


def render(data: dict) -> str:
    env, floor, served = data["environment"], data["floor"], data["served"]
    m = served["model"]
    fs, ss = floor["streams"], served["streams"]
    lines = [
        "# The proxy's cost (bench/bench_proxy.py)",
        "",
        f"`{env['command']}` on {env['cpu']} ({env['cores']} cores), {env['date']}; "
        f"{env['nginx']}, grpcio {env['grpcio']}, K = {env['k']}. nginx in front of one "
        "server, configured as deploy/local.py configures it; at batch 1 the direct and "
        "proxied calls take turns, call by call; many streams: windows taking turns, "
        f"medians of {env['rounds']}. Server, nginx and clients share the cores.",
        "",
        "## The transport alone: a canned-reply server (bench/grpc_floor.py), no engine",
        "",
        "ProposeStream messages of MiMo-7B's shape (a bf16 hidden of 4096: 8 KB).",
        "",
        *_latency_rows([("batch 1, ProposeStream", floor["batch1"])]),
        "",
        f"| {env['streams']} streams back to back ({env['seconds']:g} s) | direct | proxy |",
        "|---|---|---|",
        f"| messages/s | {fs['direct']['messages_per_s']:.0f} | "
        f"{fs['proxy']['messages_per_s']:.0f} ({fs['ratio']:.2f}x) |",
        f"| nginx CPU per message | | {fs['proxy']['nginx_cpu_us_per_message']:.0f} us |",
        "",
        f"## Served: `mtpdraft serve` ({m['family']}, hidden {m['hidden_size']}, "
        f"{m['compute_dtype']}, {m['device']}), {env['prompt_rows']}-row prompts",
        "",
        *_latency_rows(
            [
                ("batch 1, ProposeStream", served["stream"]),
                ("batch 1, unary Propose", served["unary"]),
                (f"{env['columns']} states, one ProposeBatch", served["columns"]),
            ]
        ),
        "",
        f"| {env['streams']} verifiers, a stream each ({env['seconds']:g} s) | direct | proxy |",
        "|---|---|---|",
        f"| drafts/s | {ss['direct']['drafts_per_s']:.0f} | "
        f"{ss['proxy']['drafts_per_s']:.0f} ({ss['ratio']:.2f}x) |",
        f"| step p50 | {ss['direct']['step_p50_ms']:.2f} ms | "
        f"{ss['proxy']['step_p50_ms']:.2f} ms |",
        f"| nginx CPU per message | | {ss['proxy']['nginx_cpu_us_per_message']:.0f} us |",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint folder (default: the embedded model)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--serve-args", default="", help="more `mtpdraft serve` flags, e.g. '--dtype float32'"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400, help="batch-1 steps a round")
    parser.add_argument("--columns", type=int, default=64, help="states of the columns run")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=5.0, help="of each streams run")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    if local.find_nginx() is None:
        print("bench_proxy: nginx is not installed (apt-get install nginx)", file=sys.stderr)
        return 2
    data = measure(args) | {"environment": _environment(args)}
    text = render(data)
    write_results(args.out_dir, "proxy", data, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
