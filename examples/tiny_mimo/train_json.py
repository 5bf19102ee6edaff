"""Fine-tunes the tiny MiMo (target and MTP layer, jointly, as train.py) on JSON Lines.

    python3 -m examples.tiny_mimo.train_json --out DIR [--init DIR] [--steps N]

Starts from a checkpoint (the embedded default model unless --init), trains on
json_data's records (documents of seeds below HELD_OUT_SEED) with train.py's objective
and schedule, writes DIR (config.json, model.safetensors, and the byte-level
tokenizer.json that grammars read) and prints the held-out losses before and after.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from mtpdraft.service.model.default_model import DEFAULT_CHECKPOINT

from .json_data import HELD_OUT_SEED, corpus
from .model import load_checkpoint, save_checkpoint
from .tokenizer import byte_tokenizer
from .train import Windows, evaluate, lr_at


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--init", type=Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256, help="window length in bytes")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument("--documents", type=int, default=4000, help="training documents")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    model = load_checkpoint(args.init, torch.float32, device).train()
    train = Windows(corpus(0, args.documents), args.seq, device, args.seed)
    held = Windows(corpus(HELD_OUT_SEED, 200), args.seq, device, args.seed + 1).sample(32)
    print(f"before: held-out {evaluate(model, held, cuda)}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    start = time.time()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args)
        with torch.autocast(device.type, torch.bfloat16, enabled=cuda):
            lm, mtp, _, _ = model.losses(train.sample(args.batch))
            loss = lm + args.mtp_weight * mtp
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == args.steps - 1:
            print(
                f"step {step:4d}  lm {lm.item():.4f}  mtp {mtp.item():.4f}  "
                f"{time.time() - start:.0f}s",
                flush=True,
            )
    save_checkpoint(model, args.out, torch.bfloat16)
    (args.out / "tokenizer.json").write_text(json.dumps(byte_tokenizer()))
    saved = load_checkpoint(args.out, torch.float32, device)
    print(f"after: held-out {evaluate(saved, held, False)}", flush=True)


if __name__ == "__main__":
    main()
