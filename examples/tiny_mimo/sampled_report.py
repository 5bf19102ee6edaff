"""Drafts kept per verify step when the verifier samples: greedy drafts against sampled ones.

    python3 -m examples.tiny_mimo.sampled_report [--report-dir examples/tiny_mimo]

On the trained tiny MiMo (the service's default checkpoint), for T in {0.3, 0.7, 1.0} and
K in 1..4, held-out prompts, several sequences each: the verifier samples at T with
speculative sampling (sampled.py) and counts the drafts it keeps per verify step, for
(a) greedy drafts handed over as one-hot q (what a verifier can do with any greedy
drafter) and (b) drafts sampled by the service at the same T with their q. Each figure
is the mean over sequences of their mean drafts kept per step, with a 95% interval
(1.96 standard errors over sequences). Every run's emitted tokens are also checked
against the target's distribution (rank_chi_square: the worst slot's chi-square over its
1e-6 critical value). Writes SAMPLED.md and sampled.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time

import numpy as np

from .sampled import chi_square_critical, rank_chi_square, report_arguments, speculate, trained
from .verify import held_out_prompts


def kept_per_step(runs) -> tuple[float, float, int]:
    """(mean over sequences of their mean drafts kept per step, its 95% half-width,
    verify steps)."""
    means = []
    for run in runs:
        seq, kept = np.array(run.sequences), np.array(run.accepted)
        means += [kept[seq == s].mean() for s in np.unique(seq)]
    means = np.array(means)
    half = 1.96 * means.std(ddof=1) / np.sqrt(len(means))
    return float(means.mean()), float(half), sum(len(r.accepted) for r in runs)


def worst_check(runs, k: int) -> float:
    ratios = []
    for run in runs:
        for slot in range(k + 1):
            chi2, df, n = rank_chi_square(run, slot)
            if n >= 100 and df >= 1:
                ratios.append(chi2 / chi_square_critical(df))
    return max(ratios, default=float("nan"))


def run(model, engine, prompt, args, k: int, temperature: float, seed: int, sampled: bool):
    return speculate(
        model, engine, prompt, batch=args.per_prompt, k=k, temperature=temperature,
        new_tokens=args.new_tokens, seed=seed, rng=np.random.default_rng(seed), sampled=sampled,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = report_arguments(__doc__)
    p.add_argument("--temperatures", default="0.3,0.7,1.0")
    p.add_argument("--max-k", type=int, default=4)
    args = p.parse_args(argv)
    model, engine = trained(args.max_k)
    prompts = held_out_prompts(args.prompts, args.prompt_len, 0)
    rows = []
    for t in (float(x) for x in args.temperatures.split(",")):
        for k in range(1, args.max_k + 1):
            row = {"temperature": t, "k": k}
            for name, sampled in (("greedy", False), ("sampled", True)):
                start = time.time()
                runs = [run(model, engine, prompt, args, k, t, i, sampled)
                        for i, (_, prompt) in enumerate(prompts)]  # fmt: skip
                mean, half, steps = kept_per_step(runs)
                row[name] = {"mean": mean, "ci95": half, "steps": steps,
                             "worst_chi_square_ratio": worst_check(runs, k)}  # fmt: skip
                print(f"T={t} K={k} {name}: {mean:.3f} ± {half:.3f} ({steps} steps, "
                      f"{time.time() - start:.1f} s)", flush=True)  # fmt: skip
            rows.append(row)
    if args.report_dir:
        write(args, rows)
    return 0


def write(args: argparse.Namespace, rows: list[dict]) -> None:
    command = "python3 -m examples.tiny_mimo.sampled_report " + shlex.join(sys.argv[1:])
    report = {"command": command, "cpu": platform.processor()
              or platform.machine(), "args": {k: str(v) for k, v in vars(args).items()},
              "rows": rows}  # fmt: skip
    args.report_dir.mkdir(parents=True, exist_ok=True)
    (args.report_dir / "sampled.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [
        "# Drafts kept per verify step when the verifier samples",
        "",
        f"Produced by `{command}` (examples/tiny_mimo/sampled_report.py says how): the trained "
        f"tiny MiMo, {args.prompts} held-out prompts of {args.prompt_len} bytes, "
        f"{args.per_prompt} sequences each, {args.new_tokens} new tokens; the MTP head and the "
        "target in float32 on the CPU. Mean drafts kept per verify step (over sequences), "
        "± a 95% interval. Greedy: greedy drafts, one-hot q. Sampled: drafts drawn by the "
        "service at the verifier's T, with their q. Check: the worst chi-square of the "
        "emitted tokens against the target's distribution, over its 1e-6 critical value "
        "(below 1: the tokens follow the target).",
        "",
        "| T | K | greedy drafts, one-hot q | sampled drafts, their q | sampled / greedy "
        "| check (greedy, sampled) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        g, s = r["greedy"], r["sampled"]
        lines.append(
            f"| {r['temperature']} | {r['k']} | {g['mean']:.3f} ± {g['ci95']:.3f} | "
            f"{s['mean']:.3f} ± {s['ci95']:.3f} | {s['mean'] / g['mean']:.2f} | "
            f"{g['worst_chi_square_ratio']:.2f}, {s['worst_chi_square_ratio']:.2f} |"
        )
    (args.report_dir / "SAMPLED.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
