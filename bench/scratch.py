"""A bench's scratch folder (its random checkpoint, its sockets), removed when the bench
exits: a MiMo-7B-shaped checkpoint is about 2 GB, and runs in a row would fill the disk."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path


def scratch_folder(prefix: str, in_memory: bool = False) -> Path:
    """A new empty folder, under /dev/shm with `in_memory` (where there is one)."""
    shm = "/dev/shm" if in_memory and Path("/dev/shm").is_dir() else None
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=shm))
    atexit.register(functools.partial(shutil.rmtree, folder, ignore_errors=True))
    return folder
