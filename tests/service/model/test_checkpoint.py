"""Loading MTP heads from checkpoint folders in both published namings."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtpdraft.service.model.checkpoint import load_mtp_weights
from mtpdraft.service.model.errors import CheckpointError
from mtpdraft.service.model.synthetic import write_random_checkpoint


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("family", ["mimo", "deepseek"])
def test_loads_both_namings_sharded_or_not(tmp_path, family: str, shards: int) -> None:
    write_random_checkpoint(tmp_path, family, shards=shards, dtype=torch.bfloat16)
    w = load_mtp_weights(tmp_path)
    assert w.family == family
    assert w.embed_first == (family == "deepseek")
    assert w.pass_normed_hidden == (family == "mimo")
    assert w.config.dtype == torch.bfloat16 and w.config.hidden_size == 64
    assert w.tensors["input_proj"].shape == (64, 128)
    assert ("q_proj_bias" in w.tensors) == (family == "mimo")


def test_deepseek_takes_the_shared_head_and_layer_embedding_when_present(tmp_path) -> None:
    write_random_checkpoint(tmp_path, "deepseek")
    tensors = load_file(tmp_path / "model.safetensors")
    head = torch.full_like(tensors["lm_head.weight"], 0.5)
    embed = torch.full_like(tensors["model.embed_tokens.weight"], 0.25)
    tensors |= {"model.layers.2.shared_head.head.weight": head}
    tensors |= {"model.layers.2.embed_tokens.weight": embed}
    save_file(tensors, tmp_path / "model.safetensors")
    w = load_mtp_weights(tmp_path)
    assert torch.equal(w.tensors["lm_head"], head)
    assert torch.equal(w.tensors["embed"], embed)


def _rewrite(folder, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")


def test_missing_tensor_is_named(tmp_path) -> None:
    write_random_checkpoint(tmp_path, "mimo")
    _rewrite(tmp_path, lambda t: t.pop("model.mtp_layers.0.self_attn.k_proj.bias"))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.mtp_layers\.0\.self_attn"):
        load_mtp_weights(tmp_path)


def test_misshapen_tensor_is_named_with_both_shapes(tmp_path) -> None:
    write_random_checkpoint(tmp_path, "deepseek")
    name = "model.layers.2.mlp.down_proj.weight"

    def shrink(t: dict) -> None:
        t[name] = t[name][:, :10].contiguous()

    _rewrite(tmp_path, shrink)
    with pytest.raises(CheckpointError, match=rf"{name}: expected shape \(64, 96\).*\(64, 10\)"):
        load_mtp_weights(tmp_path)


def test_shard_named_by_the_index_must_exist(tmp_path) -> None:
    write_random_checkpoint(tmp_path, "mimo", shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: missing"):
        load_mtp_weights(tmp_path)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("model.layers.2.self_attn.q_a_proj.weight", "MLA weights, but config.json has no kv_lora"),
        (
            "model.layers.2.mlp.experts.0.up_proj.weight",
            "describes a dense MLP, but model.layers.2.mlp has experts",
        ),
    ],
)
def test_unsupported_deepseek_variants_are_refused(tmp_path, extra: str, message: str) -> None:
    write_random_checkpoint(tmp_path, "deepseek")
    _rewrite(tmp_path, lambda t: t.update({extra: torch.zeros(2, 2)}))
    with pytest.raises(CheckpointError, match=message):
        load_mtp_weights(tmp_path)


def test_config_problems_are_named(tmp_path) -> None:
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_mtp_weights(tmp_path)
    write_random_checkpoint(tmp_path, "mimo")
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"rope_scaling": {"type": "yarn"}}))
    with pytest.raises(CheckpointError, match="rope_scaling"):
        load_mtp_weights(tmp_path)
    del cfg["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="'vocab_size'"):
        load_mtp_weights(tmp_path)


def test_no_mtp_layer_is_a_clear_error(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="no MTP layer found"):
        load_mtp_weights(tmp_path)
