"""Broken checkpoint folders: every error names the file at fault, and `mtpdraft serve`
says so in one line on stderr, without a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
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
