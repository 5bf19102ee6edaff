"""Triton kernels for the MTP head's forward pass.

One op per module; each public launcher checks its arguments, allocates the output and
launches. The pieces several kernels are built from are in ``_shared``, the launchers'
argument checks in ``_checks``: no kernel imports another. The kernels know nothing of
models or states. On a machine without a GPU they run
under ``TRITON_INTERPRET=1`` (set it before ``triton`` is imported).
"""

from ._shared import GEMV_MAX_ROWS as gemv_max_rows
from .chain_step import expand_block_tables, record_step, select_step, stop_nonfinite_rows
from .fused_moe import fused_moe
from .gemv import gemv
from .lm_head_drafts import lm_head_drafts
from .mla_decode import mla_decode
from .mla_write_latent import mla_write_latent, rope_interleaved
from .moe_route import moe_route
from .mtp_input_norms import mtp_input_norms
from .paged_attention import paged_attention
from .rms_norm import add_rms_norm, qk_norm, rms_norm
from .rope_write_kv import rope_write_kv
from .sample_top import sample_top
from .select_drafts import select_drafts
from .swiglu import swiglu
from .top_support import TopSupport, top_support, top_support_group

__all__ = [
    "TopSupport",
    "add_rms_norm",
    "expand_block_tables",
    "fused_moe",
    "gemv",
    "gemv_max_rows",
    "lm_head_drafts",
    "mla_decode",
    "mla_write_latent",
    "moe_route",
    "mtp_input_norms",
    "paged_attention",
    "qk_norm",
    "record_step",
    "rms_norm",
    "rope_interleaved",
    "rope_write_kv",
    "sample_top",
    "select_drafts",
    "select_step",
    "stop_nonfinite_rows",
    "swiglu",
    "top_support",
    "top_support_group",
]
