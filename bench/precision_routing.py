"""Where bf16 drafts differ from float64, and why: every disagreement, draft by draft.

The MoE families' tiny test checkpoints, served in-process in bf16 (the eager path: Triton
kernels on a GPU, torch ops on the CPU; DeepSeek-V3 also with its FP8 weights), one state
at a time: a long prompt, then steps of K = 4 whose verdicts always refeed (so every
reference below holds the same committed rows). Each draft is set against three
references, each teacher-forced with the served drafts (tests/: they share nothing with
the service):
- float64: the oracle as published (tests/*_reference.py);
- float64 routed as served: the same oracle made to route every row to the experts the
  service chose (tests/precision.py Forced);
- bf16-rounded: the oracle rounding every stored value to bf16 (its `store` hook), routing
  by its own rounded values.
For each draft where the served token is not float64's top-1 within the tie gap, the
table gives the first row of its chain that the service routed unlike float64, float64's
margin there and the difference of the service's choice values from float64's on that
row (both in bf16 roundings of the row's largest choice value, tests/precision.py), and
the other two references' verdicts. Writes bench/results/precision_routing.{json,md}.

    python bench/precision_routing.py --device cuda --out-dir bench/results
"""

from __future__ import annotations

import argparse
import math
import random
import shlex
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from precision import (
    ROUTING_ROUNDINGS,
    UNIT_ROUNDOFF,
    Forced,
    ServiceRouting,
    in_roundings,
    tie_gap,
)
from proposing import ProposeArgs, propose
from results_file import write_results
from served_chains import PROMPT_ROWS, bf16_checkpoint

from mtpdraft.service.config import ServeConfig
from mtpdraft.service.engine.engine import DraftEngine
from mtpdraft.service.engine.types import Verdict
from mtpdraft.service.model.checkpoint import load_mtp_weights
from mtpdraft.service.model.mtp_head import MTPHead

FAMILIES = ("deepseek-v3", "deepseek-v3-fp8", "glm-4.5", "qwen3-next")  # the MoE ones
U = UNIT_ROUNDOFF["bfloat16"]


class Own:
    """A route hook that keeps the oracle's own choice and margin of every row."""

    def __init__(self) -> None:
        self.ids, self.margin, self.values = {}, {}, {}

    def __call__(self, row, ids, margin, values):
        self.ids[row], self.margin[row], self.values[row] = sorted(ids.tolist()), margin, values
        return ids


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).double()


def verdict_of(ref, tokens, hiddens, j: int, draft: int, route=None, store=None) -> tuple:
    """(the reference's output hidden, its top-1, how far the draft's logit is behind it,
    the tie gap, log of the draft's probability)."""
    out = ref.rows(tokens, hiddens, store=store, step=j, route=route)[-1]
    logits = ref.logits(out, store=store, step=j)
    top = int(logits.argmax())
    behind = float(logits[top] - logits[draft])
    return out, top, behind, tie_gap(logits, U), float(logits.log_softmax(-1)[draft])


def session(ref, engine, routed, rows: int, steps: int, seed: int, seen: dict) -> list[dict]:
    """One state's steps; `seen` gathers precision.Forced's notes (row -> margin, same
    choice, choice difference), its rows numbered across sessions."""
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    vocab, hidden = ref.text["vocab_size"], ref.hidden
    tokens = torch.randint(0, vocab, (rows,), generator=gen).tolist()
    hiddens = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
    state = engine.alloc_state()
    prefill = engine.begin_prefill(state, 1)
    prefill.append(tokens, hiddens)
    prefill.finish()
    hiddens, records = hiddens.double(), []
    for step in range(steps):
        x = int(torch.randint(0, vocab, (1,), generator=gen))
        h = torch.randn(hidden, generator=gen).to(torch.bfloat16)
        got = propose(engine, ProposeArgs(state, x, h, len(tokens) + 1, 4))
        tokens, hiddens = [*tokens, x], torch.cat([hiddens, h.double()[None]])
        r0 = len(tokens) - 1
        chains = {"float64": hiddens, "routed": hiddens, "bf16": hiddens}
        chain_tokens = list(tokens)
        for j, draft in enumerate(got.tokens):
            own, notes = Own(), {}
            o_out, o_top, o_behind, gap, o_logp = verdict_of(
                ref, chain_tokens, chains["float64"], j, draft, own
            )
            f_out, f_top, f_behind, _, f_logp = verdict_of(
                ref, chain_tokens, chains["routed"], j, draft, Forced(routed, notes, U)
            )
            r_out, r_top, r_behind, _, _ = verdict_of(
                ref, chain_tokens, chains["bf16"], j, draft, store=bf16
            )
            served_logp = math.log(got.probs[j])
            chain = range(r0, r0 + j + 1)
            flips = [r for r in chain if routed.ids.get(r) not in (None, own.ids[r])]
            record = dict(
                step=step, draft_index=j, served=draft,
                float64=dict(top=o_top, behind=o_behind, log_prob_off=abs(served_logp - o_logp)),
                routed_as_served=dict(
                    top=f_top, behind=f_behind, log_prob_off=abs(served_logp - f_logp)
                ),
                bf16_rounded=dict(top=r_top, behind=r_behind),
                tie_gap=gap,
            )  # fmt: skip
            if flips:
                r = flips[0]
                delta = float((routed.choice[r] - own.values[r]).abs().max())
                record["first_flip"] = dict(
                    chain_row=r - r0,
                    margin=in_roundings(own.margin[r], own.values[r], U),
                    choice_difference=in_roundings(delta, own.values[r], U),
                )
            records.append(record)
            seen.update({(seed, row): note for row, note in notes.items()})
            chain_tokens.append(draft)
            for key, out in (("float64", o_out), ("routed", f_out), ("bf16", r_out)):
                chains[key] = torch.cat([chains[key], out[None]])
        accepted = rng.randint(0, len(got.tokens))
        refeed = torch.randn(accepted, hidden, generator=gen).to(torch.bfloat16)
        engine.after_verify(state, Verdict(accepted, refeed if accepted else None))
        tokens += got.tokens[:accepted]
        hiddens = torch.cat([hiddens, refeed.double()])
    engine.free_state(state)
    return records


def summary(records: list[dict], seen: dict) -> dict:
    off = [r for r in records if r["float64"]["behind"] > r["tie_gap"]]
    flips = [margin for margin, same, _ in seen.values() if not same]
    differences = [difference for *_, difference in seen.values()]

    routed_off = [r for r in records if r["routed_as_served"]["behind"] > r["tie_gap"]]
    return dict(
        drafts=len(records),
        off_float64=len(off),
        off_float64_explained=sum(
            1 for r in off if r.get("first_flip", {}).get("margin", math.inf) < ROUTING_ROUNDINGS
        ),
        off_routed_as_served=len(routed_off),
        off_bf16_rounded=sum(1 for r in records if r["bf16_rounded"]["behind"] > r["tie_gap"]),
        worst_behind_routed_as_served=max(r["routed_as_served"]["behind"] for r in records),
        worst_log_prob_off_routed_as_served=max(
            r["routed_as_served"]["log_prob_off"] for r in records
        ),
        worst_log_prob_off_float64_agreeing=max(
            (r["float64"]["log_prob_off"] for r in records if r not in off), default=0.0
        ),
        rows_routed=len(seen),
        rows_routed_unlike_float64=len(flips),
        largest_flip_margin_roundings=max(flips, default=None),
        median_choice_difference_roundings=float(np.median(differences)),
        largest_choice_difference_roundings=max(differences),
    )  # fmt: skip


def markdown(report: dict) -> str:
    lines = [
        "# bf16 drafts against float64, draft by draft",
        "",
        f"`{report['command']}` on {report['device']}. bench/precision_routing.py says what",
        "each column is. A draft is off when the served token's logit is more than the tie",
        "gap (4 bf16 roundings of the largest logit) behind the reference's top-1. Margins",
        "and choice differences are in bf16 roundings of the row's largest choice value; a",
        f"margin under {report['routing_roundings']} may go either way (tests/precision.py).",
        "",
        "| family | drafts | off float64 | of which after a routing flip below the resolution "
        "| off float64 routed as served | off bf16-rounded | worst logit gap, routed as served "
        "| worst \\|log p\\| off, routed as served | rows routed unlike float64 (largest margin) "
        "| choice difference, median / largest |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, fam in report["families"].items():
        s = fam["summary"]
        lines.append(
            f"| {name} | {s['drafts']} | {s['off_float64']} | {s['off_float64_explained']} | "
            f"{s['off_routed_as_served']} | {s['off_bf16_rounded']} | "
            f"{s['worst_behind_routed_as_served']:.3f} | "
            f"{s['worst_log_prob_off_routed_as_served']:.3f} | "
            f"{s['rows_routed_unlike_float64']} of {s['rows_routed']} "
            f"({s['largest_flip_margin_roundings'] or 0:.2f}) | "
            f"{s['median_choice_difference_roundings']:.2f} / "
            f"{s['largest_choice_difference_roundings']:.2f} |"
        )
    lines += [
        "",
        "Each draft off float64 (draft index in its chain, logits behind float64's top-1; the",
        "chain's first row routed unlike float64, float64's margin there and the service's",
        "choice values' largest difference from float64's on it; the draft's verdicts from",
        "float64 routed as served and from the bf16-rounded reference):",
        "",
        "| family | step | draft | behind | flip row | margin | choice difference "
        "| routed as served: behind | bf16-rounded: top-1 is the draft |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, fam in report["families"].items():
        for r in fam["drafts"]:
            if r["float64"]["behind"] <= r["tie_gap"]:
                continue
            flip = r.get("first_flip") or {}
            lines.append(
                f"| {name} | {r['step']} | {r['draft_index'] + 1} | "
                f"{r['float64']['behind']:.2f} | {flip.get('chain_row', '-')} | "
                f"{flip.get('margin', math.nan):.2g} | "
                f"{flip.get('choice_difference', math.nan):.2g} | "
                f"{r['routed_as_served']['behind']:.3f} | "
                f"{r['bf16_rounded']['top'] == r['served']} |"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--out-dir", default="bench/results")
    args = parser.parse_args()
    device = torch.device(args.device)
    ops = "triton" if device.type == "cuda" else "torch"
    report = dict(
        command="python " + shlex.join(sys.argv),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        routing_roundings=ROUTING_ROUNDINGS,
        families={},
    )
    for name in FAMILIES:
        with tempfile.TemporaryDirectory() as folder:
            ref = bf16_checkpoint(Path(folder), name)
            head = MTPHead(load_mtp_weights(folder), device, torch.bfloat16, ops)
        # Eager: the recorder sees every forward (a graph's replay would hide the chain's).
        config = ServeConfig(kv_blocks=160, block_size=16, max_drafts=8, cuda_graphs=False)
        engine = DraftEngine(head, config)
        records, seen = [], {}
        with ServiceRouting(head) as routed:
            for seed in range(args.sessions):
                records += session(ref, engine, routed, PROMPT_ROWS[name], args.steps, seed, seen)
        report["families"][name] = dict(summary=summary(records, seen), drafts=records)
        print(name, report["families"][name]["summary"], flush=True)
        write_results(args.out_dir, "precision_routing", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
