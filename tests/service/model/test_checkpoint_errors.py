"""Broken checkpoint folders: every error names the file at fault (a config's, the keys at
fault), and `mtpdraft serve` says so in one line on stderr, without a traceback."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from deepseek_checkpoints import write_deepseek_checkpoint
from family_checkpoints import write_family_checkpoint
from safetensors.torch import load_file, save_file
from servers import PATIENCE

from mtpdraft.service.model.checkpoint import load_mtp_weights
from mtpdraft.service.model.errors import CheckpointError
from mtpdraft.service.model.synthetic import write_random_checkpoint

WEIGHTS = "model.safetensors"


def _truncate(folder: Path) -> str:
    file = folder / WEIGHTS
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    return f"{file}: Error while deserializing header: incomplete metadata"


def _corrupt(folder: Path) -> str:
    (folder / WEIGHTS).write_bytes(b"\x00" * 4096)
    return f"{folder / WEIGHTS}: Error while deserializing header"


def _no_config(folder: Path) -> str:
    (folder / "config.json").unlink()
    return f"{folder}: no config.json"


def _config_not_json(folder: Path) -> str:
    (folder / "config.json").write_text('{"hidden_size": 64,')
    return f"{folder / 'config.json'}: not valid JSON"


def _config_not_an_object(folder: Path) -> str:
    (folder / "config.json").write_text("[64, 4]")
    return f"{folder / 'config.json'}: not a JSON object"


def _config_wrong_type(folder: Path) -> str:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"hidden_size": "wide"}))
    return f"{folder / 'config.json'}: a value of the wrong type"


def _config_missing_key(folder: Path) -> str:
    config = json.loads((folder / "config.json").read_text())
    del config["vocab_size"]
    (folder / "config.json").write_text(json.dumps(config))
    return f"{folder / 'config.json'}: missing required key 'vocab_size'"


def _missing_weight(folder: Path) -> str:
    tensors = load_file(folder / WEIGHTS)
    del tensors["model.mtp_layers.0.mlp.up_proj.weight"]
    save_file(tensors, folder / WEIGHTS)
    return f"{folder}: missing tensor model.mtp_layers.0.mlp.up_proj.weight"


def _misshapen_weight(folder: Path) -> str:
    tensors = load_file(folder / WEIGHTS)
    name = "model.mtp_layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name][:3].contiguous()
    save_file(tensors, folder / WEIGHTS)
    return f"{folder / WEIGHTS}: {name}: expected shape (96, 64)"


def _truncated_shard(folder: Path) -> str:
    for file in folder.glob("*.safetensors"):
        file.unlink()
    write_random_checkpoint(folder, "mimo", shards=2)
    shard = folder / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    return f"{shard}: Error while deserializing header"


def _bad_index(folder: Path) -> str:
    write_random_checkpoint(folder, "mimo", shards=2)
    (folder / "model.safetensors.index.json").write_text("{}")
    return f"{folder / 'model.safetensors.index.json'}: not a weight map"


BREAKS: dict[str, Callable[[Path], str]] = {
    "truncated": _truncate,
    "corrupt": _corrupt,
    "no-config": _no_config,
    "config-not-json": _config_not_json,
    "config-not-an-object": _config_not_an_object,
    "config-wrong-type": _config_wrong_type,
    "config-missing-key": _config_missing_key,
    "missing-weight": _missing_weight,
    "misshapen-weight": _misshapen_weight,
    "truncated-shard": _truncated_shard,
    "bad-index": _bad_index,
}


def _broken(tmp_path: Path, how: str) -> tuple[Path, str]:
    """A test checkpoint broken as `how` says, and the start of the error that names it."""
    folder = write_random_checkpoint(tmp_path / "checkpoint", "mimo")
    return folder, BREAKS[how](folder)


@pytest.mark.parametrize("how", BREAKS)
def test_each_break_is_named_by_its_file(tmp_path, how: str) -> None:
    folder, expected = _broken(tmp_path, how)
    with pytest.raises(CheckpointError) as error:
        load_mtp_weights(folder)
    assert str(error.value).startswith(expected)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("how", ["truncated", "no-config", "config-not-json", "missing-weight"])
def test_serve_says_it_in_one_line_without_a_traceback(tmp_path, how: str) -> None:
    folder, expected = _broken(tmp_path, how)
    cmd = [sys.executable, "-m", "mtpdraft", "serve", "--model", str(folder), "--port", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=PATIENCE)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"mtpdraft: cannot load {expected}"), done.stderr
    assert "listening" not in done.stdout


# Configs whose values do not fit together, each written by a family's writer with some
# keys changed, and the refusal, which must name the keys at fault (and no other).
MIMO = "mimo"  # hidden_size 64, 4 heads of 16, 2 KV heads
CONFIG_REFUSALS = {
    "hidden-not-divisible-by-heads": (
        MIMO, {"num_attention_heads": 3},
        "hidden_size=64 is not divisible by num_attention_heads=3, and no head_dim is given",
    ),
    "no-heads": (MIMO, {"num_attention_heads": 0}, "num_attention_heads=0 is not a positive"),
    "no-vocabulary": (MIMO, {"vocab_size": 0}, "vocab_size=0 is not a positive integer"),
    "heads-not-a-multiple-of-kv-heads": (
        MIMO, {"num_key_value_heads": 3},
        "num_attention_heads=4 is not a multiple of num_key_value_heads=3",
    ),
    "odd-head-dim": (MIMO, {"head_dim": 15}, r"head_dim=15 is odd \(RoPE rotates pairs"),
    "odd-derived-head-dim": (
        MIMO, {"hidden_size": 60}, "hidden_size / num_attention_heads=15 is odd"
    ),
    "rotary-factor-too-small": (
        MIMO, {"partial_rotary_factor": 0.05},
        "partial_rotary_factor=0.05 of hidden_size / num_attention_heads=16 rotates 0 dims",
    ),
    "odd-mla-rope-dims": ("deepseek-v3", {"qk_rope_head_dim": 7}, "qk_rope_head_dim=7 is odd"),
    # MLA has neither: read, they would be ignored.
    "mla-with-biases": (
        "deepseek-v3", {"attention_bias": True}, r"attention_bias=True is not supported \(MLA"
    ),
    "mla-with-qk-norms": (
        "deepseek-v3", {"use_qk_norm": True}, r"use_qk_norm=True is not supported \(MLA"
    ),
    "groups-do-not-divide-experts": (
        "glm-4.5", {"n_group": 3}, "n_group=3 does not divide n_routed_experts=8"
    ),
    "more-groups-picked-than-there-are": (
        "glm-4.5", {"n_group": 2, "topk_group": 3}, "topk_group=3 exceeds n_group=2"
    ),
    "top-k-past-the-experts": (
        "glm-4.5", {"num_experts_per_tok": 9},
        "num_experts_per_tok=9 exceeds n_routed_experts=8",
    ),
    "top-k-past-the-picked-groups": (
        "glm-4.5", {"n_group": 4, "topk_group": 1},
        "num_experts_per_tok=3 exceeds the 2 experts of topk_group=1 of n_group=4 groups",
    ),
    "qwen-top-k-past-the-experts": (
        "qwen3-next", {"num_experts_per_tok": 9},
        "num_experts_per_tok=9 exceeds num_experts=8",
    ),
}  # fmt: skip


def _written(folder: Path, name: str) -> Path:
    if name == "mimo":
        return write_random_checkpoint(folder, "mimo")
    if name.startswith("deepseek"):
        return write_deepseek_checkpoint(folder, name)
    return write_family_checkpoint(folder, name)


def _config_keys(raw: dict) -> set[str]:
    return set(raw) | set(raw.get("text_config", {})) | set(raw.get("rope_parameters") or {})


@pytest.mark.parametrize("case", CONFIG_REFUSALS)
def test_each_config_refusal_names_the_keys_at_fault(tmp_path, case: str) -> None:
    """Keys that do not fit together are named, with their values; no key the config does
    not hold is (hidden_size not divisible by the heads once blamed partial_rotary_factor)."""
    family, changes, expected = CONFIG_REFUSALS[case]
    folder = _written(tmp_path, family)
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    (raw.get("text_config") or raw).update(changes)
    path.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError) as error:
        load_mtp_weights(folder)
    message = str(error.value)
    assert message.startswith(f"{path}: ") and re.search(expected, message), message
    named = set(re.findall(r"([a-z_]+)=", message))
    assert named and named <= _config_keys(raw), message


def test_serve_names_the_keys_at_fault_in_one_line(tmp_path) -> None:
    folder = write_random_checkpoint(tmp_path / "checkpoint", "mimo")
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(raw | {"num_attention_heads": 3}))
    cmd = [sys.executable, "-m", "mtpdraft", "serve", "--model", str(folder), "--port", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=PATIENCE)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert "is not divisible by num_attention_heads=3" in done.stderr
    assert "partial_rotary_factor" not in done.stderr
