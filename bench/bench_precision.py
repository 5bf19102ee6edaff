"""bf16 drafts against float32 drafts of the same service, at the published shapes.

Per family (MiMo-7B, GLM-4.5-Air, Qwen3-Next-80B, DeepSeek-V3 with its FP8 weights; random
weights, bench/shapes.py), one set of weights is served twice by the engine as users run
it (Triton kernels, CUDA graphs): in bf16, then in float32. Both take the same steps: 64
states prefilled with the same prompts, then steps of K = 4 for all of them at once, whose
verdicts (a random count, always refed with the same target hiddens) keep both runs'
committed rows equal. Per draft index: the fraction of drafts equal in both runs, among
chains equal up to that draft (so both drafted from the same tokens), and the median
|log p| between the two runs' probabilities of equal drafts. A precision regression shows
up as a lower fraction. Writes bench/results/precision.{json,md}.

    python bench/bench_precision.py --out-dir bench/results
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile

import numpy as np
import torch
from bench_families import fp8_weights
from results_file import write_results
from shapes import DEEPSEEK_V3, GLM_45_AIR, MIMO_7B, QWEN3_NEXT_80B, SMALL, SMALL_MLA, SMALL_MOE

from mtpdraft.service.config import ServeConfig
from mtpdraft.service.engine.engine import DraftEngine
from mtpdraft.service.engine.step import Step, single
from mtpdraft.service.engine.types import Verdict
from mtpdraft.service.model.checkpoint import load_mtp_weights, mtp_weights_from
from mtpdraft.service.model.mtp_head import MTPHead
from mtpdraft.service.model.synthetic import random_tensors, write_random_checkpoint
from mtpdraft.service.model.tensors import TensorDict

FAMILIES = {
    "mimo-7b": ("mimo", MIMO_7B),
    "glm-4.5-air": ("glm4_moe", GLM_45_AIR),
    "qwen3-next-80b": ("qwen3_next", QWEN3_NEXT_80B),
    "deepseek-v3": ("deepseek", DEEPSEEK_V3),
}
K = 4


def weights_of(name: str, small: bool, device: torch.device):
    family, shape = FAMILIES[name]
    if family == "mimo":
        with tempfile.TemporaryDirectory() as folder:
            shape = SMALL if small else shape
            write_random_checkpoint(folder, "mimo", dtype=torch.bfloat16, **shape)
            return load_mtp_weights(folder)
    tiny = SMALL_MOE | (SMALL_MLA if family == "deepseek" else {})
    cfg = shape | (tiny if small else {})
    tensors = random_tensors(cfg, family, dtype=torch.bfloat16, device=device)
    return mtp_weights_from(cfg, TensorDict(fp8_weights(cfg, tensors)))


def run(weights, dtype: torch.dtype, device: torch.device, args) -> tuple[np.ndarray, np.ndarray]:
    """Drafts [steps, B, K] and their probabilities of one dtype's run."""
    ops = "triton" if device.type == "cuda" else "torch"
    head = MTPHead(weights, device, dtype, ops)
    rows = args.prompt + args.steps * (K + 1) + 1
    config = ServeConfig(
        kv_blocks=args.states * -(-rows // 16), block_size=16, max_drafts=K,
        max_batch=args.states,
    )  # fmt: skip
    engine = DraftEngine(head, config)
    c, gen = head.config, torch.Generator().manual_seed(0)
    states, lengths = [], []
    for _ in range(args.states):
        state = engine.alloc_state()
        prefill = engine.begin_prefill(state, 1)
        tokens = torch.randint(0, c.vocab_size, (args.prompt,), generator=gen).tolist()
        prefill.append(tokens, torch.randn(args.prompt, c.hidden_size, generator=gen))
        prefill.finish()
        states.append(state)
        lengths.append(args.prompt)
    drafts, probs, verdicts = [], [], [None] * args.states
    for _ in range(args.steps):
        requests = []
        for i, state in enumerate(states):
            token = int(torch.randint(0, c.vocab_size, (1,), generator=gen))
            hidden = torch.randn(c.hidden_size, generator=gen)
            position, previous = lengths[i] + 1, verdicts[i]
            requests.append(
                single(
                    state, token, hidden, position, K, previous=previous, shape=engine.step_shape
                )
            )
            lengths[i] += 1
        result = engine.step(Step.concat(requests))
        assert not result.errors, result.errors
        got = [result.proposal(i, state) for i, state in enumerate(states)]
        drafts.append([p.tokens for p in got])
        probs.append([p.probs for p in got])
        for i in range(args.states):
            accepted = int(torch.randint(0, K + 1, (1,), generator=gen))
            refeed = torch.randn(accepted, c.hidden_size, generator=gen)
            verdicts[i] = Verdict(accepted, refeed if accepted else None)
            lengths[i] += accepted
    del engine, head
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return np.array(drafts), np.array(probs)


def compare(bf16: tuple, fp32: tuple) -> list[dict]:
    (d16, p16), (d32, p32) = bf16, fp32
    same_so_far = np.ones(d16.shape[:2], dtype=bool)
    rows = []
    for j in range(K):
        equal = d16[..., j] == d32[..., j]
        chains = int(same_so_far.sum())
        both = same_so_far & equal
        off = np.abs(np.log(p16[..., j][both]) - np.log(p32[..., j][both]))
        rows.append(
            dict(
                draft_index=j + 1,
                chains=chains,
                equal=int(both.sum()),
                fraction_equal=float(both.sum() / max(chains, 1)),
                median_log_prob_off=float(np.median(off)) if off.size else None,
            )
        )
        same_so_far = both
    return rows


def markdown(report: dict) -> str:
    lines = [
        "# bf16 drafts against float32 drafts of the same service",
        "",
        f"`{report['command']}` on {report['device']}: {report['states']} states, prompts of "
        f"{report['prompt']} rows, {report['steps']} steps of K = {K}. bench/bench_precision.py "
        "says how. Per draft index: drafts equal in both runs among chains equal so far, and "
        "the median |log p| between the runs' probabilities of equal drafts.",
        "",
        "| family | draft 1 | draft 2 | draft 3 | draft 4 | median \\|log p\\| off, draft 1 |",
        "|---|---|---|---|---|---|",
    ]
    for name, rows in report["families"].items():
        cells = [f"{r['fraction_equal']:.3f} ({r['equal']}/{r['chains']})" for r in rows]
        lines.append(f"| {name} | {' | '.join(cells)} | {rows[0]['median_log_prob_off']:.2g} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--states", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
    parser.add_argument("--out-dir", default="bench/results")
    args = parser.parse_args()
    device = torch.device(args.device)
    report = dict(
        command="python " + shlex.join(sys.argv),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        states=args.states, prompt=args.prompt, steps=args.steps, families={},
    )  # fmt: skip
    for name in args.families.split(","):
        weights = weights_of(name, args.small, device)
        runs = [run(weights, dtype, device, args) for dtype in (torch.bfloat16, torch.float32)]
        del weights
        report["families"][name] = compare(*runs)
        print(name, report["families"][name], flush=True)
        write_results(args.out_dir, "precision", report, markdown(report))  # each family's
    return 0


if __name__ == "__main__":
    sys.exit(main())
