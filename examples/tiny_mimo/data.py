"""Training and held-out text: the Python standard library's own source, as bytes.

Every machine with Python has it. The files are the ``.py`` files under the
interpreter's stdlib folder (``sysconfig``'s ``stdlib`` path), without
``site-packages`` / ``dist-packages``. A file is held out when the CRC-32 of its
path relative to that folder is 0 mod 20 (about 5%), so the split depends on
the path alone and agrees across Python versions for the files they share.
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
HELD_OUT_MODULUS = 20


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative_path: str) -> bool:
    return zlib.crc32(relative_path.encode()) % HELD_OUT_MODULUS == 0


@dataclass
class SourceFile:
    path: str  # relative to the stdlib folder, with "/" separators
    data: bytes


def stdlib_files(root: Path | None = None) -> list[SourceFile]:
    """Every stdlib .py file, sorted by relative path."""
    root = root or stdlib_root()
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        for name in sorted(names):
            if name.endswith(".py"):
                full = Path(folder) / name
                rel = full.relative_to(root).as_posix()
                files.append(SourceFile(rel, full.read_bytes()))
    return sorted(files, key=lambda f: f.path)


def split(files: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, held out) by path."""
    train = [f for f in files if not is_held_out(f.path)]
    held = [f for f in files if is_held_out(f.path)]
    return train, held
