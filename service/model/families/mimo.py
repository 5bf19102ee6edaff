"""MiMo-7B (``MiMoForCausalLM``): one MTP layer, ``model.mtp_layers.0.*``.

As vLLM's MiMoMultiTokenPredictorLayer computes it: the embedding (zeroed at position 0)
and the target's hidden, each normed (``token_layernorm``, ``hidden_layernorm``), go
through ``input_proj`` (2H -> H) **hidden first**; then Qwen2's decoder block (GQA whose
q/k/v projections always have biases, full RoPE, a dense SwiGLU MLP); then
``final_layernorm``, whose output is both passed on and the LM head's input. The
embedding and head are the target's (``model.embed_tokens``, ``lm_head``).
"""

from __future__ import annotations

from collections.abc import Collection

from ..config import ConfigReader, MTPConfig
from .family import Family, Layout, inputs, shared_config

_PREFIX = "model.mtp_layers.0."


class Mimo(Family):
    name = "mimo"
    architectures = ("MiMoForCausalLM",)
    model_type = "mimo"
    embed_first = False
    mask_first_embedding = True
    pass_normed_hidden = True

    def marker(self, config: ConfigReader) -> str:
        return f"{_PREFIX}*"

    def recognises(self, config: ConfigReader, names: Collection[str]) -> bool:
        return any(n.startswith("model.mtp_layers.") for n in names)

    def layout(self, config: ConfigReader) -> Layout:
        return Layout(
            prefix=_PREFIX,
            block=_PREFIX,
            inputs=inputs(
                _PREFIX, "token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm"
            ),
            embed=(f"{_PREFIX}embed_tokens.weight", "model.embed_tokens.weight"),
            head=("lm_head.weight",),
        )

    def read_config(self, c: ConfigReader) -> MTPConfig:
        # Qwen2's block: q/k/v biases always (its config has no key for them), a dense MLP.
        shared = shared_config(c)
        return MTPConfig(
            **shared, intermediate_size=c.positive("intermediate_size"), attention_bias=True
        )
