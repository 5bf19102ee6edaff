"""The embedded default model: a small trained MiMo-format checkpoint shipped with the package.

A byte-level target (hidden 384, 4 layers) with one MTP layer, trained on the
Python standard library's source by examples/tiny_mimo/train.py (the command,
data and losses are in examples/tiny_mimo/TRAINING.md). Only its MTP layer,
embedding and head are served; its target layers are there for the reference
verifier (examples/tiny_mimo/verify.py), which measures about 0.93 first-draft
acceptance on held-out text. It lets `mtpdraft serve` run anywhere with nothing
to download.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_CHECKPOINT = Path(__file__).parent / "default_checkpoint"
