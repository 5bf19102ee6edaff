"""Drafts chosen by the drafter (num_drafts 0) against every fixed K, on the trained tiny MiMo.

    python3 -m examples.tiny_mimo.draft_count_report [--report-dir examples/tiny_mimo]

Held-out prompts, several sequences each, verified greedily (T = 0) and by sampling
(T = 0.7, sampled drafts): per verify step, the tokens it yields (1 + drafts accepted),
the drafts handed over and the drafts wasted (handed over, not accepted); and for each
verify token cost c, the tokens per unit of verify cost, sum(1 + accepted) / sum(1 + c k),
of every fixed K = 1..4 and of the drafter choosing K (cap 4) for that c. Writes
DRAFT_COUNT.md and draft_count.json.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time

import numpy as np

from .sampled import report_arguments, speculate, trained
from .verify import held_out_prompts

CAP = 4


def measure(model, engine, prompts, args, temperature: float, k: int, cost: float | None):
    """(tokens per step, drafts per step, wasted per step, per-step arrays) of one setting."""
    accepted, drafted = [], []
    for i, (_, prompt) in enumerate(prompts):
        out = speculate(
            model, engine, prompt, batch=args.per_prompt, k=k, temperature=temperature,
            new_tokens=args.new_tokens, seed=i, rng=np.random.default_rng(i),
            verify_token_cost=cost,
        )  # fmt: skip
        accepted += out.accepted
        drafted += out.drafted
    return np.array(accepted), np.array(drafted)


def per_cost(accepted: np.ndarray, drafted: np.ndarray, cost: float) -> float:
    return float((1 + accepted).sum() / (1 + cost * drafted).sum())


def main(argv: list[str] | None = None) -> int:
    p = report_arguments(__doc__)
    p.add_argument("--costs", default="0.05,0.15,0.3")
    args = p.parse_args(argv)
    model, engine = trained(CAP)
    prompts = held_out_prompts(args.prompts, args.prompt_len, 0)
    costs = [float(c) for c in args.costs.split(",")]
    rows = []
    for temperature in (0.0, 0.7):
        fixed = {}
        for k in range(1, CAP + 1):
            start = time.time()
            fixed[k] = measure(model, engine, prompts, args, temperature, k, None)
            rows.append(row(temperature, f"K = {k}", *fixed[k], costs))
            print(rows[-1], f"({time.time() - start:.1f} s)", flush=True)
        for cost in costs:
            chosen = measure(model, engine, prompts, args, temperature, CAP, cost)
            rows.append(row(temperature, f"chosen, c = {cost}", *chosen, costs))
            best = max(per_cost(*fixed[k], cost) for k in fixed)
            rows[-1]["best_fixed_per_cost"] = best
            print(rows[-1], flush=True)
    if args.report_dir:
        write(args, rows, costs)
    return 0


def row(temperature, name, accepted, drafted, costs) -> dict:
    return {
        "temperature": temperature,
        "drafts": name,
        "steps": len(accepted),
        "tokens_per_step": float(1 + accepted.mean()),
        "drafted_per_step": float(drafted.mean()),
        "wasted_per_step": float((drafted - accepted).mean()),
        "tokens_per_cost": {str(c): per_cost(accepted, drafted, c) for c in costs},
    }


def write(args: argparse.Namespace, rows: list[dict], costs: list[float]) -> None:
    command = "python3 -m examples.tiny_mimo.draft_count_report " + shlex.join(sys.argv[1:])
    args.report_dir.mkdir(parents=True, exist_ok=True)
    report = {"command": command, "rows": rows}
    (args.report_dir / "draft_count.json").write_text(json.dumps(report, indent=1) + "\n")
    head = " | ".join(f"tokens per cost, c = {c}" for c in costs)
    lines = [
        "# Drafts chosen by the drafter against every fixed K",
        "",
        f"Produced by `{command}` (examples/tiny_mimo/draft_count_report.py says how): the "
        f"trained tiny MiMo, {args.prompts} held-out prompts of {args.prompt_len} bytes, "
        f"{args.per_prompt} sequences each, {args.new_tokens} new tokens, float32 on the CPU; "
        "verified greedily (T = 0) and by sampling (T = 0.7, sampled drafts). Per verify "
        "step: tokens yielded, drafts handed over, drafts wasted; tokens per unit of verify "
        "cost: sum(1 + accepted) / sum(1 + c k). A chosen row's drafter chose K (cap 4) for "
        "its own c: compare it in that c's column with the best fixed K.",
        "",
        f"| T | drafts | tokens / step | drafts / step | wasted / step | {head} |",
        "|---|---|---|---|---|" + "---|" * len(costs),
    ]
    for r in rows:
        cells = " | ".join(f"{r['tokens_per_cost'][str(c)]:.3f}" for c in costs)
        lines.append(
            f"| {r['temperature']} | {r['drafts']} | {r['tokens_per_step']:.3f} | "
            f"{r['drafted_per_step']:.2f} | {r['wasted_per_step']:.2f} | {cells} |"
        )
    (args.report_dir / "DRAFT_COUNT.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
