"""The MTP layer's forward over a batch of rows: embedding + hidden in, next hidden out.

It knows nothing of states: the engine says which rows to compute and where
their KV goes (a RowBatch); this computes them, writes their K/V and returns the
hidden each row passes on. Conventions follow vLLM so that one checkpoint gives
the same drafts here as there: the embedding is zeroed in the row at position 0
(but for Qwen3-Next), the RoPE position of a row is its hidden's position, and the
hidden passed on is what vLLM's MTP layer returns (MiMo, Qwen3-Next: after the final
norm; DeepSeek/GLM: before shared_head.norm, which feeds the logits only). What each
family computes is families/; the attention is GQA here or MLA (mla.py), the MLP
dense here or a MoE (moe.py).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .batch import RowBatch
from .checkpoint import MTPWeights
from .config import MTPConfig
from .decode_chain import BeforeWait, ChainInputs, ChainOutputs
from .finite import finite_rows
from .kv_cache import KVCache
from .mla import LatentAttention
from .moe import MoEMLP
from .ops import ops_for
from .rope import rope_table
from .sampling import RowSampling, Selected
from .tensors import FP8Matrix, dequantize_blocks


def _queries_then_gates(w: torch.Tensor, c: MTPConfig) -> torch.Tensor:
    """Rows [head0 q, head0 gate, head1 q, ...] (Qwen3-Next's q_proj) -> [all q, all gates]."""
    per_head = w.view(c.num_attention_heads, 2, c.head_dim, *w.shape[1:])
    return per_head.transpose(0, 1).reshape(w.shape)


class MTPHead:
    """One MTP layer with its embedding and LM head, ready to run on one device."""

    def __init__(
        self,
        weights: MTPWeights,
        device: torch.device,
        dtype: torch.dtype | None = None,
        ops: str = "auto",
    ) -> None:
        self.config: MTPConfig = weights.config
        self.family = weights.family
        self.device = torch.device(device)
        self.dtype = dtype or weights.config.dtype
        self._embed_first = weights.embed_first
        self._pass_normed = weights.pass_normed_hidden
        self._mask_first = weights.mask_first_embedding
        self.ops = ops_for(self.device, ops)
        t = {k: self._place(k, v) for k, v in weights.tensors.items()}
        for name in [k.removesuffix("_scale") for k in t if k.endswith("_scale")]:
            if not name.startswith("experts_"):  # an FP8 matrix: kept so where ops read it
                matrix = FP8Matrix(t[name], t.pop(f"{name}_scale"), weights.fp8_block)
                t[name] = matrix if self.ops.reads_fp8 else matrix.dequantized(self.dtype)
        if "experts_gate_up_scale" in t and not self.ops.reads_fp8:
            for name in ("experts_gate_up", "experts_down"):  # one expert at a time: no fp32 copy
                scale = t.pop(f"{name}_scale")
                t[name] = torch.stack(
                    [
                        dequantize_blocks(w, s, weights.fp8_block).to(self.dtype)
                        for w, s in zip(t[name], scale, strict=True)
                    ]
                )
        c = self.config
        self.embed = t["embed"]
        self.lm_head = t["lm_head"]
        self.norm_embed, self.norm_hidden = t["norm_embed"], t["norm_hidden"]
        self.input_proj = t["input_proj"]
        self.input_layernorm = t["input_layernorm"]
        self.mla = None if c.mla is None else LatentAttention(c, t, self.ops)
        if c.mla is None:
            # One GEMM for q (and its gate), k, v and one for gate, up: fewer launches.
            q, q_bias = t["q_proj"], t.get("q_proj_bias")
            if c.attn_output_gate:  # per head [q, gate] rows -> all q rows, then all gates
                q = self._dense(q)
                q, q_bias = (None if w is None else _queries_then_gates(w, c) for w in (q, q_bias))
            self.qkv = self._stacked(q, t["k_proj"], t["v_proj"])
            self.qkv_bias = (
                torch.cat([q_bias, t["k_proj_bias"], t["v_proj_bias"]])
                if q_bias is not None
                else None
            )
            self.q_norm, self.k_norm = t.get("q_norm"), t.get("k_norm")
        self.o_proj = t["o_proj"]
        self.post_attention_layernorm = t["post_attention_layernorm"]
        self.final_norm = t["final_norm"]
        if c.moe is None:
            self.gate_up = self._stacked(t["gate_proj"], t["up_proj"])
            self.down_proj = t["down_proj"]
            self.moe = None
        else:
            if c.moe.shared_intermediate_size:
                t["shared_gate_up"] = self._stacked(t["shared_gate_proj"], t["shared_up_proj"])
            self.moe = MoEMLP(c.moe, t, self.ops, weights.fp8_block)
        self.cos_sin = self._rope_table()
        self._graphs = None

    def _dense(self, w: torch.Tensor | FP8Matrix) -> torch.Tensor:
        return w.dequantized(self.dtype) if isinstance(w, FP8Matrix) else w

    def _stacked(self, *parts: torch.Tensor | FP8Matrix) -> torch.Tensor | FP8Matrix:
        """The matrices' rows in one (one GEMM for all): FP8 where all are and can stack."""
        if all(isinstance(p, FP8Matrix) for p in parts):
            stacked = FP8Matrix.stacked(parts)
            if stacked is not None:
                return stacked
        return torch.cat([self._dense(p) for p in parts])

    def _place(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """On the device, in the compute dtype; the sigmoid router stays fp32 as in vLLM,
        FP8 weights stay FP8 beside their fp32 block scales."""
        if tensor.dtype == torch.float8_e4m3fn:
            return tensor.to(self.device)
        fp32 = name.endswith("_scale") or (
            name in ("router", "router_bias") and self.config.moe.scoring == "sigmoid"
        )
        return tensor.to(device=self.device, dtype=torch.float32 if fp32 else self.dtype)

    def _rope_table(self) -> torch.Tensor:
        """[max_pos, rotary_dim]: cos columns then sin columns (rope.py), on the device."""
        c = self.config
        table = rope_table(
            c.rotary_dim, c.rope_theta, c.max_position_embeddings, self.dtype, c.yarn
        )
        return table.to(self.device)

    @property
    def kv_row_values(self) -> int:
        """Values the KV cache keeps per token: K and V of every KV head, or MLA's latent."""
        c = self.config
        if c.mla is not None:
            return c.mla.kv_lora_rank + c.mla.qk_rope_head_dim
        return 2 * c.num_key_value_heads * c.head_dim

    def new_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        c = self.config
        if c.mla is not None:
            return KVCache.for_latent(
                num_blocks, block_size, c.mla.kv_lora_rank, c.mla.qk_rope_head_dim, self.dtype,
                self.device,
            )  # fmt: skip
        return KVCache(
            num_blocks, block_size, c.num_key_value_heads, c.head_dim, self.dtype, self.device
        )

    def forward(self, batch: RowBatch, kv: KVCache) -> torch.Tensor:
        """Computes the rows, writes their K/V, returns the hiddens they pass on [N, H]."""
        ops, eps, unit = self.ops, self.config.rms_norm_eps, self.config.norm_unit_offset
        hiddens = batch.hiddens.to(self.dtype)
        x = ops.input_norms(
            batch.tokens, self.embed, hiddens, self.norm_embed, self.norm_hidden,
            batch.positions, eps, self._embed_first, unit, self._mask_first,
        )  # fmt: skip
        x = ops.linear(x, self.input_proj)
        y = ops.rms_norm(x, self.input_layernorm, eps, unit)
        attn = self._attention(y, batch, kv) if self.mla is None else self._mla(y, batch, kv)
        x, y = ops.add_rms_norm(x, attn, self.post_attention_layernorm, eps, unit)
        if self.moe is not None:
            mlp_out = self.moe(y)
        else:
            mlp_out = ops.linear(ops.swiglu(ops.linear(y, self.gate_up)), self.down_proj)
        if self._pass_normed:
            return ops.add_rms_norm(x, mlp_out, self.final_norm, eps, unit)[1]
        return x + mlp_out

    def _mla(self, y: torch.Tensor, batch: RowBatch, kv: KVCache) -> torch.Tensor:
        return self.ops.linear(self.mla(y, batch, kv, self.cos_sin), self.o_proj)

    def _attention(self, y: torch.Tensor, batch: RowBatch, kv: KVCache) -> torch.Tensor:
        """Self-attention of the normed rows y over their sequences' KV (which it extends)."""
        c, ops, n = self.config, self.ops, len(batch)
        qkv = ops.linear(y, self.qkv, self.qkv_bias)
        gate_size = c.q_size if c.attn_output_gate else 0
        q, gate, k, v = qkv.split([c.q_size, gate_size, c.kv_size, c.kv_size], -1)
        # Views of the fused projection: the kernels read (and rotate) them in place.
        q, k, v = (t.view(n, -1, c.head_dim) for t in (q, k, v))
        if c.qk_norm:
            eps, unit = c.rms_norm_eps, c.norm_unit_offset
            q, k = ops.qk_norm(q, k, self.q_norm, self.k_norm, eps, unit)
        q = ops.rope_write_kv(q, k, v, batch.positions, self.cos_sin, kv, batch.slot_mapping)
        attn = ops.paged_attention(
            q, kv, batch.block_tables, batch.seq_ids, batch.context_lens, c.head_dim**-0.5,
            gate=gate if gate_size else None,
        )  # fmt: skip
        return ops.linear(attn, self.o_proj)

    def _head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the LM head multiplies: the hidden after final_norm."""
        if self._pass_normed:
            return hidden
        c = self.config
        return self.ops.rms_norm(hidden, self.final_norm, c.rms_norm_eps, c.norm_unit_offset)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, V] logits of the hiddens forward() returned."""
        return F.linear(self._head_input(hidden), self.lm_head)

    def draft(
        self, hidden: torch.Tensor, bitmask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy drafts [N] and their top-1 probabilities [N] under an optional bitmask."""
        return self.ops.draft(self._head_input(hidden), self.lm_head, bitmask)

    def select(
        self,
        hidden: torch.Tensor,
        bitmask: torch.Tensor | None,
        sampling: RowSampling,
        draft_positions: torch.Tensor,
        index: torch.Tensor,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
        key_offsets: tuple[int, int] = (0, 0),
    ) -> Selected:
        """Drafts [N] chosen as each row's sampling says (sampling.select), each drawn for
        the token position and proposal index given (`key_offsets` added: constants of a
        captured step); q written into `out` if given."""
        return self.ops.select(
            self._head_input(hidden), self.lm_head, bitmask, sampling, draft_positions, index,
            out, key_offsets,
        )  # fmt: skip

    def capture_decode_graphs(
        self, kv: KVCache, max_batch: int, max_steps: int, support: int = 0
    ) -> None:
        """On CUDA: capture the chained decode step for `decode_chain` to replay (sampled
        too, drafts whose q holds `support` tokens, when it is given)."""
        from .decode_graphs import DecodeGraphs

        self._graphs = DecodeGraphs(self, kv, max_batch, max_steps, support=support)

    def decode(
        self, batch: RowBatch, kv: KVCache, bitmask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """forward + draft of every row: (hiddens, drafts, probabilities)."""
        hidden = self.forward(batch, kv)
        tokens, probs = self.draft(hidden, bitmask)
        return hidden, tokens, probs

    def decode_chain(
        self, kv: KVCache, chain: ChainInputs, before_wait: BeforeWait | None = None
    ) -> ChainOutputs:
        """Runs a chain of decode steps (see ChainInputs); the host waits once, at the end.

        Replayed from CUDA graphs when they were captured on this KV cache and the chain
        fits them; step by step (the same kernels, launched one by one) otherwise: a
        graph reads and writes the KV it was captured on, whatever `kv` a caller hands
        it. `before_wait` runs on the host once the whole chain is queued, before the
        wait (BeforeWait).
        """
        graphs = self._graphs
        if graphs is not None and graphs.kv is kv and graphs.fits(chain):
            return graphs.run(chain, before_wait)
        dev, n = self.device, len(chain)
        writes = np.where(finite_rows(chain.hiddens), chain.limits, 0)  # ChainInputs' rule
        step_rows = torch.from_numpy(chain.step_rows(kv.block_size, writes)).to(dev)
        tokens = torch.from_numpy(chain.tokens).to(dev)
        hiddens = chain.hiddens.to(dev, self.dtype)
        tables = torch.from_numpy(chain.block_tables).to(dev)
        seq_ids = torch.arange(n, dtype=torch.int32, device=dev)
        masks = None if chain.bitmasks is None else chain.bitmasks.to(dev)
        sampling = None if chain.sampling is None else chain.sampling.on(dev)
        outputs = []
        for j, (positions, slots, context_lens) in enumerate(step_rows):
            batch = RowBatch(tokens, hiddens, positions, seq_ids, slots, tables, context_lens)
            mask = None if masks is None else masks[j]
            if sampling is None:
                hiddens, tokens, probs = self.decode(batch, kv, mask)
                outputs.append((hiddens, tokens, probs))
                continue
            hiddens = self.forward(batch, kv)
            rows, first_index = sampling
            # A row at position p (its hidden's) holds the token at p + 1 and drafts p + 2.
            chosen = self.select(hiddens, mask, rows, positions, first_index, key_offsets=(2, j))
            tokens = chosen.tokens
            outputs.append((hiddens, tokens, chosen.probs, chosen.q_ids, chosen.q_probs))
        out = [torch.stack(o) for o in zip(*outputs, strict=True)]
        if before_wait is not None:
            before_wait(out[0])
        q = [o.cpu().numpy() for o in out[3:]] or [None, None]
        return ChainOutputs(out[0], out[1].cpu().numpy(), out[2].float().cpu().numpy(), *q)
