"""Reference verifier: lossless greedy speculative decoding with drafts from mtpdraft.

    python3 -m examples.tiny_mimo.verify [--model DIR] [--address HOST:PORT]

The target runs here in torch (CPU, fp64 by default so that verifying K + 1
tokens in one forward and decoding one token per forward pick the same argmax).
Per prompt it

1. runs plain greedy decoding of the target (the reference output);
2. runs speculative decoding: prefills the drafter with the prompt's rows
   (token at position p with target hidden h_(p-1), first row at position 1),
   then per step gets K drafts, verifies them with ONE target forward over
   [last token, d1..dK], accepts the longest prefix matching the target's greedy
   tokens plus the target's bonus token, and passes the verdict (with or
   without refeed hiddens h_p..h_(p+a-1)) along with the next Propose: one round
   trip per step;
3. checks that the output equals (1) token for token.

Drafts come from a gRPC server (started here as ``python3 -m mtpdraft serve
--port 0 --device cpu`` unless ``--address`` is given) and, for comparison, from
an in-process ``DraftEngine`` on the same checkpoint: both must propose the same
tokens with the same probabilities, bit for bit. It reports per K (1..4) and
refeed on/off the acceptance rate per draft position (fraction of steps whose
draft j was accepted), the mean number of accepted drafts per step and the
tokens per target forward, in ``REPORT.md`` and ``report.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from mtpdraft.client import DrafterClient
from mtpdraft.client import Verdict as ClientVerdict
from mtpdraft.service.config import ServeConfig
from mtpdraft.service.engine.engine import DraftEngine
from mtpdraft.service.engine.step import single
from mtpdraft.service.engine.types import Verdict as EngineVerdict
from mtpdraft.service.model.checkpoint import load_mtp_weights
from mtpdraft.service.model.default_model import DEFAULT_CHECKPOINT
from mtpdraft.service.model.mtp_head import MTPHead

from .data import split, stdlib_files, stdlib_root
from .model import DTYPES, KVCache, TinyMiMoForCausalLM, load_checkpoint

HERE = Path(__file__).parent
TRAINED_CHECKPOINT = HERE / "checkpoint"
SERVER_START_TIMEOUT = 120.0


def has_target(folder: Path) -> bool:
    """Whether a checkpoint folder holds a whole target (not only an MTP layer)."""
    for file in folder.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            if "model.layers.0.self_attn.q_proj.weight" in f.keys():  # noqa: SIM118
                return True
    return False


def find_trained_checkpoint() -> Path | None:
    """The trained tiny MiMo: here, or as the service's embedded default once moved there."""
    for folder in (TRAINED_CHECKPOINT, DEFAULT_CHECKPOINT):
        if (folder / "config.json").is_file() and has_target(folder):
            return folder
    return None


# ---- the target -------------------------------------------------------------


class Target:
    """The target model with a KV cache for one sequence; greedy tokens and hiddens."""

    def __init__(self, model: TinyMiMoForCausalLM, max_len: int) -> None:
        self.model = model.eval()
        dtype = next(model.parameters()).dtype
        self.cache = KVCache(model.config, 1, max_len, dtype)
        self.forwards = 0

    @torch.no_grad()
    def forward(self, tokens: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Appends tokens at the cache's end: (hiddens [n, H] fp32, greedy next tokens [n])."""
        self.forwards += 1
        h = self.model.forward_target(torch.tensor([tokens]), self.cache)[0]
        greedy = self.model.target_logits(h).argmax(-1).tolist()
        return h.float(), greedy

    def truncate(self, length: int) -> None:
        self.cache.truncate(length)


def greedy_decode(model: TinyMiMoForCausalLM, prompt: list[int], new_tokens: int) -> list[int]:
    """Plain greedy decoding: one target forward per token."""
    target = Target(model, len(prompt) + new_tokens + 1)
    _, greedy = target.forward(prompt)
    out = [greedy[-1]]
    while len(out) < new_tokens:
        _, greedy = target.forward(out[-1:])
        out.append(greedy[-1])
    return out


# ---- drafters: over gRPC, or in process ---------------------------------------


@dataclass
class Drafts:
    tokens: list[int]
    probs: list[float]


class Drafter(Protocol):
    def alloc_state(self) -> int: ...
    def prefill(self, state: int, tokens: list[int], hiddens: torch.Tensor, start: int) -> None: ...
    def propose(
        self,
        state: int,
        token: int,
        hidden: torch.Tensor,
        position: int,
        k: int,
        accepted: int | None,
        refeed: torch.Tensor | None,
    ) -> Drafts: ...
    def free_state(self, state: int) -> None: ...


class GrpcDrafter:
    """Drafts from the service over gRPC; the verdict rides on the next Propose."""

    def __init__(self, client: DrafterClient) -> None:
        self.client = client

    def alloc_state(self) -> int:
        return self.client.alloc_state()

    def prefill(self, state: int, tokens: list[int], hiddens: torch.Tensor, start: int) -> None:
        self.client.prefill(state, tokens, hiddens, start_position=start)

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
        previous = None if accepted is None else ClientVerdict(accepted, refeed_hiddens=refeed)
        p = self.client.propose(state, token, hidden, position, k, previous=previous)
        return Drafts(list(p.tokens), list(p.probs))

    def free_state(self, state: int) -> None:
        self.client.free_state(state)


class LocalDrafter:
    """The same drafts from a DraftEngine in this process (no gRPC)."""

    def __init__(self, model_dir: Path, kv_blocks: int = 4096) -> None:
        head = MTPHead(load_mtp_weights(model_dir), torch.device("cpu"))
        self.engine = DraftEngine(head, ServeConfig(kv_blocks=kv_blocks))

    def alloc_state(self) -> int:
        return self.engine.alloc_state()

    def prefill(self, state: int, tokens: list[int], hiddens: torch.Tensor, start: int) -> None:
        session = self.engine.begin_prefill(state, start)
        session.append(tokens, hiddens)
        session.finish()

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
        previous = None if accepted is None else EngineVerdict(accepted, refeed)
        step = single(
            state, token, hidden, position, k, previous=previous, shape=self.engine.step_shape
        )
        result = self.engine.step(step)  # a step of one row: this state's
        if result.errors:
            raise result.errors[0]
        p = result.proposal(0, state)
        return Drafts(p.tokens, p.probs)

    def free_state(self, state: int) -> None:
        self.engine.free_state(state)


# ---- speculative decoding -------------------------------------------------------


@dataclass
class SpecResult:
    tokens: list[int]
    accepted: list[int] = field(default_factory=list)  # drafts accepted per verify step
    proposals: list[Drafts] = field(default_factory=list)
    target_forwards: int = 0


def speculative_decode(
    model: TinyMiMoForCausalLM,
    drafter: Drafter,
    prompt: list[int],
    new_tokens: int,
    k: int,
    refeed: bool,
) -> SpecResult:
    """Greedy speculative decoding of new_tokens tokens after prompt (see the docstring)."""
    target = Target(model, len(prompt) + new_tokens + k + 2)
    hiddens, greedy = target.forward(prompt)  # h_0 .. h_(n-1)
    n = len(prompt)
    state = drafter.alloc_state()
    try:
        drafter.prefill(state, prompt[1:], hiddens[:-1], 1)
        token, position, hidden = greedy[-1], n, hiddens[-1]  # token x_n, its hidden h_(n-1)
        result = SpecResult([token])
        accepted: int | None = None
        refeed_rows: torch.Tensor | None = None
        while len(result.tokens) < new_tokens:
            drafts = drafter.propose(state, token, hidden, position, k, accepted, refeed_rows)
            result.proposals.append(drafts)
            # One forward over [x_p, d1..dK] at positions p..p+K: h_p..h_(p+K), greedy.
            hiddens, greedy = target.forward([token, *drafts.tokens])
            a = 0
            while a < len(drafts.tokens) and drafts.tokens[a] == greedy[a]:
                a += 1
            result.accepted.append(a)
            result.tokens += [*drafts.tokens[:a], greedy[a]]
            target.truncate(position + a + 1)  # keep x_p, d1..da
            token, hidden = greedy[a], hiddens[a]
            accepted = a
            refeed_rows = hiddens[:a] if refeed and a > 0 else None
            position += a + 1
        result.target_forwards = target.forwards
        result.tokens = result.tokens[:new_tokens]
        return result
    finally:
        drafter.free_state(state)


# ---- prompts, server, report ------------------------------------------------------


def held_out_prompts(count: int, length: int, seed: int) -> list[tuple[str, list[int]]]:
    """count prompts of length bytes, each from a different held-out file, at a line start."""
    _, held = split(stdlib_files())
    rng = random.Random(seed)
    files = [f for f in held if len(f.data) >= 4 * length]
    chosen = rng.sample(files, min(count, len(files)))
    prompts = []
    for f in sorted(chosen, key=lambda f: f.path):
        starts = [m.end() for m in re.finditer(rb"\n", f.data[: len(f.data) - 2 * length])]
        start = rng.choice(starts) if starts else 0
        prompts.append((f"{f.path}@{start}", list(f.data[start : start + length])))
    return prompts


@dataclass
class Server:
    process: subprocess.Popen
    address: str

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_server(model_dir: Path, *extra: str) -> Server:
    """Starts ``python3 -m mtpdraft serve --port 0 --device cpu`` and waits for its port."""
    cmd = [sys.executable, "-m", "mtpdraft", "serve", "--model", str(model_dir), "--port", "0"]
    cmd += ["--device", "cpu", "--kv-blocks", "4096", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    process = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines = []
    deadline = time.time() + SERVER_START_TIMEOUT
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line)
        match = re.search(r"listening on (\S+):(\d+)", line)
        if match:
            # Drain the rest of its output so that the server never blocks on a full pipe.
            subprocess_drain(process)
            return Server(process, f"127.0.0.1:{match.group(2)}")
        if time.time() > deadline:
            break
    process.kill()
    process.wait()
    raise RuntimeError("the server did not start:\n" + "".join(lines))


def subprocess_drain(process: subprocess.Popen) -> None:
    def drain() -> None:
        assert process.stdout is not None
        for _ in process.stdout:
            pass

    threading.Thread(target=drain, daemon=True).start()


@dataclass
class ConfigResult:
    k: int
    refeed: bool
    steps: int
    accepted_per_position: list[float]
    mean_accepted: float
    tokens_per_forward: float
    lossless: bool
    grpc_equals_local: bool
    proposals_compared: int
    max_prob_diff: float


def run_config(
    model: TinyMiMoForCausalLM,
    drafters: dict[str, Drafter],
    prompts: list[tuple[str, list[int]]],
    references: list[list[int]],
    new_tokens: int,
    k: int,
    refeed: bool,
) -> ConfigResult:
    runs = {
        name: [speculative_decode(model, d, p, new_tokens, k, refeed) for _, p in prompts]
        for name, d in drafters.items()
    }
    first = next(iter(runs.values()))
    lossless = all(
        r.tokens == ref for rs in runs.values() for r, ref in zip(rs, references, strict=True)
    )
    same, compared, max_diff = True, 0, 0.0
    if len(runs) == 2:
        a_runs, b_runs = runs.values()
        for ra, rb in zip(a_runs, b_runs, strict=True):
            same &= len(ra.proposals) == len(rb.proposals)
            for pa, pb in zip(ra.proposals, rb.proposals, strict=False):
                compared += 1
                same &= pa.tokens == pb.tokens and pa.probs == pb.probs
                if len(pa.probs) == len(pb.probs):
                    diffs = [abs(x - y) for x, y in zip(pa.probs, pb.probs, strict=True)]
                    max_diff = max([max_diff, *diffs])
    accepted = [a for r in first for a in r.accepted]
    steps = len(accepted)
    per_pos = [sum(a >= j for a in accepted) / steps for j in range(1, k + 1)]
    mean_a = sum(accepted) / steps
    return ConfigResult(
        k, refeed, steps, per_pos, mean_a, mean_a + 1, lossless, same, compared, max_diff
    )


def markdown_table(results: list[ConfigResult], max_k: int) -> str:
    head = ["K", "refeed", "steps"]
    head += [f"acc@{j}" for j in range(1, max_k + 1)]
    head += ["mean accepted", "tokens/target fwd", "lossless", "in-process == gRPC"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        acc = [f"{x:.3f}" for x in r.accepted_per_position] + ["–"] * (max_k - r.k)
        same = (
            f"yes ({r.proposals_compared} proposals, max Δp {r.max_prob_diff:g})"
            if r.grpc_equals_local
            else "NO"
        )
        row = [str(r.k), "yes" if r.refeed else "no", str(r.steps), *acc]
        row += [f"{r.mean_accepted:.3f}", f"{r.tokens_per_forward:.3f}"]
        row += ["yes" if r.lossless else "NO", same]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, help="checkpoint (default: the trained tiny MiMo)")
    p.add_argument("--address", help="a running mtpdraft server (default: start one)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128, help="bytes per prompt")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--max-k", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target-dtype", choices=["float64", "float32"], default="float64")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads here")
    p.add_argument("--no-local", action="store_true", help="skip the in-process comparison")
    p.add_argument("--report-dir", type=Path, help="write REPORT.md and report.json here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = args.model or find_trained_checkpoint()
    if model_dir is None:
        raise SystemExit("no trained checkpoint found: pass --model DIR")
    dtype = torch.float64 if args.target_dtype == "float64" else DTYPES[args.target_dtype]
    model = load_checkpoint(model_dir, dtype)
    prompts = held_out_prompts(args.prompts, args.prompt_len, args.seed)
    t0 = time.time()
    references = [greedy_decode(model, p, args.new_tokens) for _, p in prompts]
    print(f"{len(prompts)} held-out prompts; greedy references in {time.time() - t0:.1f}s")

    server = None if args.address else start_server(model_dir)
    address = args.address or server.address  # type: ignore[union-attr]
    results = []
    try:
        with DrafterClient(address, timeout=60.0) as client:
            drafters: dict[str, Drafter] = {"grpc": GrpcDrafter(client)}
            if not args.no_local:
                drafters["local"] = LocalDrafter(model_dir)
            for k in range(1, args.max_k + 1):
                for refeed in (False, True):
                    t0 = time.time()
                    r = run_config(model, drafters, prompts, references, args.new_tokens, k, refeed)
                    results.append(r)
                    print(
                        f"K={k} refeed={refeed}: acc "
                        f"{[round(x, 3) for x in r.accepted_per_position]}"
                        f" mean accepted {r.mean_accepted:.3f} lossless {r.lossless} "
                        f"grpc==local {r.grpc_equals_local} ({time.time() - t0:.1f}s)",
                        flush=True,
                    )
    finally:
        if server is not None:
            server.stop()

    ok = all(r.lossless and r.grpc_equals_local for r in results)
    if args.report_dir:
        write_report(args, model_dir, prompts, results, ok)
    return 0 if ok else 1


def write_report(
    args: argparse.Namespace,
    model_dir: Path,
    prompts: list[tuple[str, list[int]]],
    results: list[ConfigResult],
    ok: bool,
) -> None:
    command = "python3 -m examples.tiny_mimo.verify " + shlex.join(sys.argv[1:])
    model_name = str(model_dir)
    if model_dir.resolve().is_relative_to(Path.cwd()):
        model_name = str(model_dir.resolve().relative_to(Path.cwd()))
    report = {
        "command": command,
        "model": model_name,
        "target_dtype": args.target_dtype,
        "held_out_text": f"Python {platform.python_version()} stdlib at {stdlib_root()}",
        "prompts": [name for name, _ in prompts],
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "all_lossless_and_identical": ok,
        "results": [r.__dict__ for r in results],
    }
    args.report_dir.mkdir(parents=True, exist_ok=True)
    (args.report_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.report_dir / "REPORT.md").write_text(
        f"""# Lossless speculative decoding with the tiny MiMo MTP head over gRPC

Produced by (from the repository root):

```
{command}
```

- Checkpoint: `{model_name}`; the target runs in torch ({args.target_dtype}, CPU), the
  MTP head in the service (`mtpdraft serve --device cpu`, the checkpoint's bf16).
- Text: {len(prompts)} prompts of {args.prompt_len} bytes from held-out files of the
  Python {platform.python_version()} standard library (one per file, at a line start),
  {args.new_tokens} new bytes each, greedy.
- Each step: one Propose carrying the previous verdict (with refeed: the target hiddens
  of the accepted drafts), one target forward over [last token, d1..dK].
- acc@j: fraction of verify steps whose draft j was accepted (as vLLM counts it, not
  conditional on drafts 1..j-1); mean accepted: drafts
  accepted per step; tokens/target fwd: tokens produced per verify forward (1 + mean
  accepted). Statistics are those of the gRPC run.
- lossless: the output equals plain greedy decoding of the target, token for token, for
  every prompt (gRPC and in-process runs). in-process == gRPC: every proposal of the
  in-process `DraftEngine` run has the same tokens and the same probabilities as the
  gRPC run's.

{markdown_table(results, args.max_k)}

All lossless and identical: **{"yes" if ok else "NO"}**.
"""
    )


if __name__ == "__main__":
    sys.exit(main())
