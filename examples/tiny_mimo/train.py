"""Trains the tiny MiMo target and its MTP layer jointly on the Python stdlib's source.

    python3 -m examples.tiny_mimo.train --out examples/tiny_mimo/checkpoint \
        --time-budget 270 --report examples/tiny_mimo/TRAINING.md

Bytes are tokens (vocabulary 256). Each step samples random windows of the
training files' concatenation; the loss is LM loss + ``mtp_weight`` x MTP loss
(the MTP layer predicts token i + 2 from token i + 1 and the target hidden h_i,
its gradient flowing into the target as in MiMo / DeepSeek-V3 training). AdamW,
linear warmup then cosine decay to 10%, bf16 autocast on the GPU. With
``--time-budget`` the number of steps is fixed after timing the first steps and
printed; ``--steps N`` reruns the same schedule. Seeds are fixed (GPU kernels
may still differ in the last bits from run to run).

At the end the checkpoint is written in bf16 and evaluated as written (held-out
LM / MTP loss, and first-draft acceptance: how often the MTP's argmax equals the
target's greedy token along the target's own greedy continuations of held-out
prompts).
"""

from __future__ import annotations

import argparse
import math
import platform
import random
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from .data import HELD_OUT_MODULUS, split, stdlib_files, stdlib_root
from .model import TinyMiMoConfig, TinyMiMoForCausalLM, load_checkpoint, save_checkpoint

TINY = TinyMiMoConfig(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=192
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="checkpoint folder to write")
    p.add_argument("--steps", type=int, default=0, help="optimizer steps (0: --time-budget)")
    p.add_argument("--time-budget", type=float, default=270.0, help="seconds of training")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=1024, help="window length in bytes")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=150)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stdlib", type=Path, help="stdlib folder (default: this Python's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a tiny config (CPU smoke test)")
    p.add_argument("--max-shard-mb", type=float, help="shard the checkpoint above this size")
    p.add_argument("--report", help="write TRAINING.md here")
    return p.parse_args(argv)


class Windows:
    """Random windows of seq + 1 bytes from a byte string, on the device, seeded."""

    def __init__(self, data: bytes, seq: int, device: torch.device, seed: int) -> None:
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        self.seq = seq
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.offsets = torch.arange(seq + 1, device=device)

    def sample(self, batch: int) -> torch.Tensor:
        high = self.data.numel() - self.seq - 1
        starts = torch.randint(0, high, (batch,), generator=self.gen, device=self.data.device)
        return self.data[starts[:, None] + self.offsets].long()


def lr_at(step: int, total: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, total - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model: TinyMiMoForCausalLM, windows: torch.Tensor, autocast: bool) -> dict[str, float]:
    """Held-out LM / MTP loss and teacher-forced MTP-vs-target argmax agreement."""
    model.eval()
    lm_sum = mtp_sum = agree_sum = 0.0
    for chunk in windows.split(16):
        with torch.autocast(chunk.device.type, torch.bfloat16, enabled=autocast):
            lm, mtp, target_greedy, mtp_greedy = model.losses(chunk)
        lm_sum += lm.item() * chunk.shape[0]
        mtp_sum += mtp.item() * chunk.shape[0]
        agree = (mtp_greedy == target_greedy[:, 1:]).float().mean().item()
        agree_sum += agree * chunk.shape[0]
    model.train()
    n = windows.shape[0]
    return {"lm_loss": lm_sum / n, "mtp_loss": mtp_sum / n, "mtp_agree_tf": agree_sum / n}


@torch.no_grad()
def greedy_acceptance(model: TinyMiMoForCausalLM, prompts: torch.Tensor, new_tokens: int) -> float:
    """First-draft acceptance along greedy continuations: does the MTP's argmax at the
    row (x_p, h_{p-1}) equal the target's greedy token at p + 1?"""
    model.eval()
    seq = prompts
    for _ in range(new_tokens):
        h = model.forward_target(seq)
        seq = torch.cat([seq, model.target_logits(h[:, -1:]).argmax(-1)], dim=1)
    h = model.forward_target(seq)
    target_next = model.target_logits(h).argmax(-1)  # [B, T]: greedy token at t + 1
    mtp_next = model.mtp_logits(model.forward_mtp(seq[:, 1:], h[:, :-1])).argmax(-1)
    # Row i = (x_{i+1}, h_i) drafts x_{i+2}; the target's greedy x_{i+2} is target_next[i+1].
    start = prompts.shape[1] - 1  # rows whose drafted token lies in the continuation
    agree = mtp_next[:, start:] == target_next[:, start + 1 :]
    return agree.float().mean().item()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t_start = time.time()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    root = args.stdlib or stdlib_root()
    files = stdlib_files(root)
    train_files, held_files = split(files)
    train_bytes = b"\n".join(f.data for f in train_files)
    held_bytes = b"\n".join(f.data for f in held_files)
    data_desc = (
        f"{len(files)} .py files of the stdlib at {root}"
        f"{'' if args.stdlib else f' (Python {platform.python_version()})'}; "
        f"train {len(train_files)} files / {len(train_bytes):,} bytes, held out "
        f"{len(held_files)} files / {len(held_bytes):,} bytes (crc32(path) % "
        f"{HELD_OUT_MODULUS} == 0)"
    )
    print(data_desc, flush=True)

    config = TINY if args.tiny else TinyMiMoConfig()
    model = TinyMiMoForCausalLM(config).to(device)
    params = sum(p.numel() for p in model.parameters())
    print(f"config {asdict(config)}; {params:,} parameters ({2 * params / 1e6:.1f} MB bf16)")

    train = Windows(train_bytes, args.seq, device, args.seed)
    held = Windows(held_bytes, args.seq, device, args.seed + 1)
    eval_windows = held.sample(64 if not args.tiny else 8)
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay}],
        lr=args.lr,
        betas=(0.9, 0.95),
        weight_decay=0.0,
        fused=cuda,
    )

    total = args.steps or 10**9
    history = []
    step = 0
    t_train = time.time()
    t_mark = None
    while step < total:
        if not args.steps and step == 60:
            per_step = (time.time() - t_mark) / 40
            total = max(step + 1, int((args.time_budget - (time.time() - t_train)) / per_step))
            total = int(total * 0.95) + step  # leave room for the evaluations
            print(f"{per_step * 1e3:.1f} ms/step: training for {total} steps", flush=True)
        if step == 20:
            if cuda:
                torch.cuda.synchronize()
            t_mark = time.time()
        lr = lr_at(step, total if total < 10**9 else 10**6, args)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = train.sample(args.batch)
        with torch.autocast(device.type, torch.bfloat16, enabled=cuda):
            lm, mtp, _, _ = model.losses(batch)
            loss = lm + args.mtp_weight * mtp
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0 or step == 1:
            print(
                f"step {step:5d}  loss {loss.item():.4f}  lm {lm.item():.4f}  "
                f"mtp {mtp.item():.4f}  lr {lr:.2e}  {time.time() - t_train:.0f}s",
                flush=True,
            )
        if step % args.eval_every == 0 or step == total:
            ev = evaluate(model, eval_windows, cuda)
            history.append({"step": step, **ev})
            print(
                f"eval {step:5d}  held-out lm {ev['lm_loss']:.4f}  mtp {ev['mtp_loss']:.4f}  "
                f"mtp==target argmax {ev['mtp_agree_tf']:.3f}",
                flush=True,
            )
    train_seconds = time.time() - t_train

    max_shard = int(args.max_shard_mb * 1e6) if args.max_shard_mb else None
    save_checkpoint(model, args.out, torch.bfloat16, max_shard)
    saved = load_checkpoint(args.out, torch.float32, device)  # evaluate what was written
    final = evaluate(saved, eval_windows, autocast=False)
    prompts = held.sample(64 if not args.tiny else 4)[:, :128]
    final["draft1_acceptance_greedy"] = greedy_acceptance(saved, prompts, 128)
    print(f"final (bf16 checkpoint, fp32 compute): {final}", flush=True)
    print(f"trained {step} steps in {train_seconds:.0f}s; total {time.time() - t_start:.0f}s")

    if args.report:
        command = "python3 -m examples.tiny_mimo.train " + shlex.join(sys.argv[1:] or [])
        write_report(
            Path(args.report),
            args,
            command,
            data_desc,
            config,
            params,
            step,
            train_seconds,
            history,
            final,
            device,
        )


def write_report(
    path: Path,
    args: argparse.Namespace,
    command: str,
    data_desc: str,
    config: TinyMiMoConfig,
    params: int,
    steps: int,
    seconds: float,
    history: list[dict],
    final: dict,
    device: torch.device,
) -> None:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = "\n".join(
        f"| {h['step']} | {h['lm_loss']:.4f} | {h['mtp_loss']:.4f} | {h['mtp_agree_tf']:.3f} |"
        for h in history
    )
    path.write_text(
        f"""# Training the tiny MiMo checkpoint

Command (run from the repository root on one {gpu}, torch {torch.__version__}):

```
{command}
```

Reproduce the same schedule with `--steps {steps}` in place of `--time-budget`.

- Data: {data_desc}. Bytes are tokens (vocabulary 256); windows of {args.seq} + 1 bytes
  sampled uniformly from the concatenated training files (joined by a newline).
- Model: {config}; {params:,} parameters ({2 * params / 1e6:.1f} MB in bf16), MiMo
  checkpoint naming with one MTP layer (`model.mtp_layers.0.*`).
- Objective: LM loss + {args.mtp_weight} x MTP loss, trained jointly (the MTP row
  (x_(i+1), h_i) predicts x_(i+2); h_i is the last decoder layer's output before
  `model.norm`, as vLLM's MiMo passes it; the embedding is zeroed at position 0).
- Optimizer: AdamW (betas 0.9/0.95, weight decay {args.weight_decay} on matrices), peak lr
  {args.lr}, {args.warmup} warmup steps, cosine to 10%, batch {args.batch} x {args.seq},
  bf16 autocast, grad clip 1.0, seed {args.seed}; {steps} steps in {seconds:.0f} s.

Held-out evaluation during training (64 windows; "agree" = teacher-forced MTP argmax
equals the target's argmax for the same token):

| step | LM loss | MTP loss | agree |
|---|---|---|---|
{rows}

Final, on the bf16 checkpoint as written (fp32 compute):

- held-out LM loss **{final["lm_loss"]:.4f}** nats/byte
  ({final["lm_loss"] / math.log(2):.3f} bits/byte)
- held-out MTP loss **{final["mtp_loss"]:.4f}** nats/byte
- teacher-forced MTP/target argmax agreement {final["mtp_agree_tf"]:.3f}
- first-draft acceptance along greedy continuations of 64 held-out prompts
  (128 + 128 bytes): **{final["draft1_acceptance_greedy"]:.3f}**
"""
    )


if __name__ == "__main__":
    main()
