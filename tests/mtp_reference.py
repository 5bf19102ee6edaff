"""A dense, float64 MTP layer written straight from the published checkpoints: the oracle.

It shares no code with mtpdraft.service: it reads the safetensors itself, keeps no
KV cache (every call recomputes the whole sequence with full causal attention),
and follows DESIGN.md's vLLM conventions (row position = hidden position, the
embedding zeroed at position 0, MiMo passes the final-norm output on, DeepSeek
the pre-norm hidden).

`rows` and `logits` take an optional `store`: a function applied to every value a
real implementation keeps in its compute dtype (each op's output, the cached K/V,
the RoPE table, the hidden passed on), so that an emulation of bf16 or fp32 can
round or perturb them there; without it the computation is exact float64.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

Store = Callable[[torch.Tensor], torch.Tensor]


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rotate(
    x: torch.Tensor, pos: torch.Tensor, rot: int, theta: float, s: Store = _same
) -> torch.Tensor:
    inv = 1.0 / theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    ang = pos[:, None].double() * inv[None]
    cos, sin = s(ang.cos()[:, None]), s(ang.sin()[:, None])
    a, b = x[..., : rot // 2], x[..., rot // 2 : rot]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, x[..., rot:]], -1)


@dataclass
class Reference:
    folder: Path
    cfg: dict = field(init=False)
    w: dict = field(init=False)

    def __post_init__(self) -> None:
        self.cfg = json.loads((self.folder / "config.json").read_text())
        self.w = {}
        for f in sorted(self.folder.glob("*.safetensors")):
            self.w |= {k: v.double() for k, v in load_file(f).items()}
        if any(k.startswith("model.mtp_layers.") for k in self.w):
            self.mimo, p = True, "model.mtp_layers.0."
            self.names = (p + "token_layernorm", p + "hidden_layernorm", p + "input_proj")
            self.out_norm = p + "final_layernorm"
        else:
            self.mimo, p = False, f"model.layers.{self.cfg['num_hidden_layers']}."
            self.names = (p + "enorm", p + "hnorm", p + "eh_proj")
            self.out_norm = p + "shared_head.norm"
        self.p = p

    def t(self, name: str) -> torch.Tensor:
        return self.w[name + ".weight"] if name + ".weight" in self.w else self.w[name]

    def rows(
        self,
        tokens: list[int],
        hiddens: torch.Tensor,
        store: Store | None = None,
        step: int = 0,
        route: object = None,
    ) -> torch.Tensor:
        """Output hiddens (the ones passed on) of rows 0..n-1 of one sequence (one MTP
        layer: the same for every draft `step`; a dense MLP: `route` never called)."""
        c, p, eps = self.cfg, self.p, self.cfg["rms_norm_eps"]
        s = store or _same
        n, h = len(tokens), c["hidden_size"]
        heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        hd = h // heads
        pos = torch.arange(n)
        emb = self.t("model.embed_tokens")[torch.tensor(tokens)].clone()
        emb[pos == 0] = 0
        e = s(_norm(emb, self.t(self.names[0]), eps))
        hid = s(_norm(s(hiddens.double()), self.t(self.names[1]), eps))
        x = s(torch.cat([hid, e] if self.mimo else [e, hid], -1) @ self.t(self.names[2]).T)

        y = s(_norm(x, self.t(p + "input_layernorm"), eps))

        def proj(name: str) -> torch.Tensor:
            out = y @ self.t(p + f"self_attn.{name}").T
            bias = p + f"self_attn.{name}.bias"
            return s(out + self.w[bias] if bias in self.w else out)

        q = proj("q_proj").reshape(n, heads, hd)
        k = proj("k_proj").reshape(n, kv_heads, hd)
        v = proj("v_proj").reshape(n, kv_heads, hd)
        rot = int(hd * c.get("partial_rotary_factor", 1.0))
        q, k = (s(_rotate(t, pos, rot, c["rope_theta"], s)) for t in (q, k))
        k = k.repeat_interleave(heads // kv_heads, 1)
        v = v.repeat_interleave(heads // kv_heads, 1)
        att = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5
        att = att.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
        a = s(torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(n, -1))
        x = s(x + s(a @ self.t(p + "self_attn.o_proj").T))

        y = s(_norm(x, self.t(p + "post_attention_layernorm"), eps))
        g, u = s(y @ self.t(p + "mlp.gate_proj").T), s(y @ self.t(p + "mlp.up_proj").T)
        x = s(x + s(s(torch.nn.functional.silu(g) * u) @ self.t(p + "mlp.down_proj").T))
        return s(_norm(x, self.t(self.out_norm), eps)) if self.mimo else x

    def logits(self, out: torch.Tensor, store: Store | None = None, step: int = 0) -> torch.Tensor:
        s = store or _same
        if not self.mimo:
            out = s(_norm(out, self.t(self.out_norm), self.cfg["rms_norm_eps"]))
        head = self.p + "shared_head.head"
        return s(out @ (self.t(head) if head + ".weight" in self.w else self.t("lm_head")).T)

    def propose(
        self,
        tokens: list[int],
        hiddens: torch.Tensor,
        num_drafts: int,
        allowed: torch.Tensor | None = None,
    ) -> tuple[list[int], list[float], list[torch.Tensor]]:
        """Drafts after the rows (tokens, hiddens), whose last row is the committed R0.

        Returns the drafts, their probabilities and the output hidden of every
        row of the chain (m0 .. m(K-1)). `allowed` is a [n, V] bool mask per draft.
        """
        return chain_drafts(self, tokens, hiddens, num_drafts, allowed)


def chain_drafts(
    ref, tokens: list[int], hiddens: torch.Tensor, num_drafts: int, allowed: torch.Tensor | None
) -> tuple[list[int], list[float], list[torch.Tensor]]:
    """The greedy chain of `ref` (a Reference, FamilyReference or DeepseekReference:
    rows and logits by draft step) after the rows (tokens, hiddens); see Reference.propose."""
    tokens, hiddens = list(tokens), hiddens.double()
    drafts, probs, outs = [], [], []
    for j in range(num_drafts):
        out = ref.rows(tokens, hiddens, step=j)[-1]
        logits = ref.logits(out, step=j)
        if allowed is not None:
            logits = logits.masked_fill(~allowed[min(j, len(allowed) - 1)], float("-inf"))
        d = int(logits.argmax())
        drafts.append(d)
        probs.append(float(logits.softmax(-1)[d]))
        outs.append(out)
        tokens.append(d)
        hiddens = torch.cat([hiddens, out[None]])
    return drafts, probs, outs
