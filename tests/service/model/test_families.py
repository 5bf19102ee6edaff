"""Every published MTP family, read from its published layout, against the float64 oracle.

The checkpoints are tiny but use each family's published config keys and weight
names (tests/family_checkpoints.py); the oracle (tests/family_reference.py) is
written from the published modeling code. The forward over a paged KV cache must
give the oracle's hiddens and logits, in fp32, row for row.
"""

from __future__ import annotations

import json

import pytest
import torch
from family_checkpoints import NAMES, write_family_checkpoint
from family_reference import FamilyReference

from mtpdraft.service.model.batch import RowBatch
from mtpdraft.service.model.checkpoint import load_mtp_weights
from mtpdraft.service.model.errors import CheckpointError
from mtpdraft.service.model.mtp_head import MTPHead

VARIANTS = {
    "plain": {},
    "transformers5": {"spelling": "transformers5"},
    "sharded-full-model": {"shards": 3, "full_model": True},
}
H, V = 64, 256


def _rows_through_the_paged_cache(head: MTPHead, seed: int):
    """Two sequences of 11 and 6 rows in scattered blocks, in two forwards each."""
    kv = head.new_kv_cache(num_blocks=16, block_size=4)
    gen = torch.Generator().manual_seed(seed)
    lengths, tables = [11, 6], [[9, 2, 14], [5, 0]]
    toks = [torch.randint(0, V, (n,), generator=gen) for n in lengths]
    hids = [torch.randn(n, H, generator=gen) for n in lengths]
    outs: list[list[torch.Tensor]] = [[], []]
    for lo, hi in [(0, 5), (5, None)]:
        rows = [(s, r) for s in range(2) for r in range(lengths[s])[lo:hi]]
        batch = RowBatch(
            tokens=torch.stack([toks[s][r] for s, r in rows]),
            hiddens=torch.stack([hids[s][r] for s, r in rows]),
            positions=torch.tensor([r for _, r in rows]),
            seq_ids=torch.tensor([s for s, _ in rows], dtype=torch.int32),
            slot_mapping=torch.tensor([tables[s][r // 4] * 4 + r % 4 for s, r in rows]),
            block_tables=torch.tensor([tables[0], [*tables[1], 0]], dtype=torch.int32),
        )
        for (s, _), o in zip(rows, head.forward(batch, kv), strict=True):
            outs[s].append(o)
    return toks, hids, [torch.stack(o) for o in outs]


def assert_rows_and_logits_match(head: MTPHead, ref) -> None:
    """The head's rows (through the paged cache) and their logits against the oracle's."""
    toks, hids, outs = _rows_through_the_paged_cache(head, seed=1)
    for s in range(2):
        expected = ref.rows(toks[s].tolist(), hids[s])
        torch.testing.assert_close(outs[s].double(), expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(
            head.logits(outs[s]).double(), ref.logits(expected), atol=1e-3, rtol=1e-4
        )


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", NAMES)
def test_forward_matches_the_oracle(tmp_path, name: str, variant: str) -> None:
    write_family_checkpoint(tmp_path, name, seed=3, **VARIANTS[variant])
    head = MTPHead(load_mtp_weights(tmp_path), torch.device("cpu"), ops="torch")
    ref = FamilyReference(tmp_path)
    assert_rows_and_logits_match(head, ref)


@pytest.mark.parametrize(
    "overrides",
    [{"n_group": 2, "topk_group": 1}, {"norm_topk_prob": False, "routed_scaling_factor": 2.5}],
    ids=["group-limited", "unnormalized-scaled"],
)
def test_glm_routing_variants_match_the_oracle(tmp_path, overrides: dict) -> None:
    write_family_checkpoint(tmp_path, "glm-4.5", seed=4, **overrides)
    head = MTPHead(load_mtp_weights(tmp_path), torch.device("cpu"), ops="torch")
    ref = FamilyReference(tmp_path)
    toks, hids, outs = _rows_through_the_paged_cache(head, seed=2)
    for s in range(2):
        torch.testing.assert_close(
            outs[s].double(), ref.rows(toks[s].tolist(), hids[s]), atol=1e-4, rtol=1e-4
        )


@pytest.mark.parametrize(
    ("name", "family", "moe", "gated"),
    [
        ("glm-4.5", "glm4_moe", True, False),
        ("glm-4.6", "glm4_moe", True, False),
        ("qwen3-next", "qwen3_next", True, True),
        ("qwen3.5-moe", "qwen3_next", True, True),
        ("qwen3.6-dense", "qwen3_next", False, True),
    ],
)
def test_each_family_is_recognised_with_what_it_computes(tmp_path, name, family, moe, gated):
    write_family_checkpoint(tmp_path, name, full_model=True)
    w = load_mtp_weights(tmp_path)
    assert w.family == family
    assert (w.config.moe is not None) == moe
    assert w.config.attn_output_gate == gated == w.config.norm_unit_offset
    assert w.mask_first_embedding == (family != "qwen3_next")
    assert w.pass_normed_hidden == (family == "qwen3_next")


def _edit_config(folder, edit) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg.get("text_config", cfg))
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("name", "edit", "message"),
    [
        ("glm-4.5", lambda c: c.update(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
        (
            "glm-4.5",
            lambda c: c.update(quantization_config={"quant_method": "fp8"}),
            r"quantization_config \('fp8'\) is not supported",
        ),
        (
            "glm-4.5-air",
            lambda c: c.update(rope_scaling={"type": "yarn", "factor": 4.0}),
            "rope_scaling type 'yarn' is not supported",
        ),
        ("glm-4.5", lambda c: c.update(scoring_func="softmax"), "scoring_func='softmax'"),
        ("qwen3-next", lambda c: c.update(use_sliding_window=True), "use_sliding_window"),
        ("qwen3-next", lambda c: c.pop("rope_theta"), "missing required key 'rope_theta'"),
        (
            "qwen3.5-moe",
            lambda c: c.update(mtp_use_dedicated_embeddings=True),
            "mtp_use_dedicated_embeddings",
        ),
        # The MTP layer has experts and use_qk_norm is off: its q/k norms would go unused.
        ("glm-4.5", lambda c: c.update(use_qk_norm=False), "would not use.*q_norm"),
        ("glm-4.5", lambda c: c.pop("n_routed_experts"), "describes a dense MLP"),
    ],
)
def test_keys_not_honoured_are_refused_by_name(tmp_path, name, edit, message) -> None:
    write_family_checkpoint(tmp_path, name)
    _edit_config(tmp_path, edit)
    with pytest.raises(CheckpointError, match=message) as info:
        load_mtp_weights(tmp_path)
    assert str(info.value).startswith(str(tmp_path))


def test_a_transformers5_rope_theta_is_read_not_defaulted(tmp_path) -> None:
    """rope_parameters.rope_theta is honoured (a 10000 default would draft silently wrong)."""
    write_family_checkpoint(tmp_path, "qwen3-next", spelling="transformers5")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert "rope_theta" not in cfg and cfg["rope_parameters"]["rope_theta"] > 10000
    assert load_mtp_weights(tmp_path).config.rope_theta == cfg["rope_parameters"]["rope_theta"]
    _edit_config(tmp_path, lambda c: c.update(rope_theta=10000.0))
    with pytest.raises(CheckpointError, match="disagree"):
        load_mtp_weights(tmp_path)


def test_a_mimo_config_in_the_transformers5_spelling(tmp_path) -> None:
    """MiMo's rope_theta 640000 under rope_parameters is read; a yarn setting there is refused."""
    from safetensors.torch import load_file, save_file

    from mtpdraft.service.model.synthetic import write_random_checkpoint

    write_random_checkpoint(tmp_path, "mimo")

    def respell(c: dict) -> None:
        del c["rope_theta"], c["torch_dtype"]
        c |= {"rope_parameters": {"rope_type": "default", "rope_theta": 640000.0}}
        c |= {"dtype": "float32"}

    _edit_config(tmp_path, respell)
    assert load_mtp_weights(tmp_path).config.rope_theta == 640000.0
    _edit_config(tmp_path, lambda c: c["rope_parameters"].update(rope_type="yarn", factor=2.0))
    with pytest.raises(CheckpointError, match="rope_parameters type 'yarn' is not supported"):
        load_mtp_weights(tmp_path)
    _edit_config(tmp_path, lambda c: c["rope_parameters"].update(rope_type="default"))
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.mtp_layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"mimo MTP layer would not use.*q_norm"):
        load_mtp_weights(tmp_path)
