"""The checkpoint's tokenizer as xgrammar's TokenizerInfo: the bytes each token id stands for.

Read from the Hugging Face `tokenizer.json` in the checkpoint folder (every family served
here ships one): its vocabulary and added tokens by id, and the vocabulary's encoding
(byte-level, byte-fallback or raw) as xgrammar detects it from the same file. The stop
tokens are the checkpoint's `eos_token_id` (config.json, else generation_config.json):
a grammar lets them through only where it may end. The model's vocabulary may be wider
than the tokenizer's (padded rows of the LM head): those ids stand for no bytes and no
grammar allows them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import xgrammar

TOKENIZER_FILE = "tokenizer.json"


def tokenizer_file(path: str | Path) -> Path | None:
    """The tokenizer.json that `path` names (the file, or a folder holding one), if any."""
    path = Path(path)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    return path if path.is_file() else None


def stop_token_ids(checkpoint: str | Path) -> list[int]:
    """The checkpoint's end-of-sequence ids: config.json's eos_token_id (its text_config's
    for a multimodal one), else generation_config.json's; none where neither says."""
    folder = Path(checkpoint)
    for name in ("config.json", "generation_config.json"):
        file = folder / name
        if not file.is_file():
            continue
        config = json.loads(file.read_text())
        eos = config.get("eos_token_id", config.get("text_config", {}).get("eos_token_id"))
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    return []


def tokenizer_info(file: Path, vocab_size: int, stop_ids: list[int]) -> xgrammar.TokenizerInfo:
    """xgrammar's view of the tokenizer in `file` for a model of `vocab_size` tokens.

    Raises ValueError naming the file when it holds no vocabulary this can read.
    """
    import xgrammar

    text = file.read_text()
    try:
        spec = json.loads(text)
        by_id = {int(i): token for token, i in spec["model"]["vocab"].items()}
        by_id.update({int(t["id"]): t["content"] for t in spec.get("added_tokens", [])})
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{file}: not a tokenizer.json with a vocabulary ({exc})") from exc
    if max(by_id) >= vocab_size:
        raise ValueError(
            f"{file}: token id {max(by_id)} is past the model's vocabulary ({vocab_size})"
        )
    encoded = [""] * vocab_size  # ids the tokenizer does not name stand for nothing
    for i, token in by_id.items():
        encoded[i] = token
    metadata = xgrammar.TokenizerInfo._detect_metadata_from_hf(text)
    return xgrammar.TokenizerInfo(
        encoded,
        metadata["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=stop_ids,
        add_prefix_space=metadata["add_prefix_space"],
    )
