"""The tiny MiMo's tokenizer as a Hugging Face tokenizer.json: token id i is byte i.

The model reads bytes (data.py): its 256 token ids are the 256 byte values, with no
merges and no special tokens (so no end-of-sequence token). Written in the byte-level
BPE format (GPT-2's byte-to-character table, an empty merge list), which every tokenizer
library reads, so a grammar library learns from it which bytes each id stands for.

``python -m examples.tiny_mimo.tokenizer DIR`` writes DIR/tokenizer.json (the embedded
default checkpoint's is service/model/default_checkpoint/tokenizer.json).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False}


def byte_characters() -> list[str]:
    """GPT-2's printable character for each byte value: printable Latin-1 bytes stand for
    themselves, the others for 256 + their rank among them."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = (b for b in range(256) if b not in kept)
    table = {b: chr(b) for b in kept} | {b: chr(256 + n) for n, b in enumerate(others)}
    return [table[b] for b in range(256)]


def byte_tokenizer() -> dict:
    """tokenizer.json's content: 256 tokens, token i the character of byte i."""
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {**_BYTE_LEVEL, "use_regex": False},
        "post_processor": None,
        "decoder": {**_BYTE_LEVEL, "use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {c: i for i, c in enumerate(byte_characters())},
            "merges": [],
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="write the byte-level tokenizer.json")
    parser.add_argument("folder", type=Path)
    out = parser.parse_args().folder / "tokenizer.json"
    out.write_text(json.dumps(byte_tokenizer(), indent=1, ensure_ascii=False) + "\n")
    print(out)


if __name__ == "__main__":
    main()
