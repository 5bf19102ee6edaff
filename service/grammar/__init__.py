"""Grammars on the server: a checkpoint's tokenizer as xgrammar sees it, grammars compiled
once and shared, and one matcher per state, advanced by the tokens a verifier commits.

xgrammar is optional (`pip install mtpdraft[grammar]`): without it, or without a tokenizer
for the checkpoint, the server serves no grammar and GetInfo says so.
"""

from __future__ import annotations

import importlib.util


def xgrammar_installed() -> bool:
    """Whether xgrammar can be imported, without importing it (its import takes seconds)."""
    return importlib.util.find_spec("xgrammar") is not None
