"""The training corpus: the Python standard library sources of the running
interpreter (text every machine has), split into train and validation by file.

- Only `*.py` files under `sysconfig.get_paths()["stdlib"]`, never
  site-packages (third-party code differs between machines); files that are
  not UTF-8 are skipped.
- The split is by file and depends only on the file's path relative to the
  stdlib root (a SHA-256 hash), so it is the same on every machine and for
  every Python version a file exists in.
- The validation metric leaves out `encodings/`: its generated codec tables
  are near-copies of each other, a model scores about 2 on them, and that
  would hide everything else.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path
from typing import NamedTuple

VALIDATION_PERCENT = 5
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
METRIC_EXCLUDED_PREFIXES = ("encodings/",)


class SourceFile(NamedTuple):
    rel_path: str  # posix path relative to the stdlib root
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(rel_path: str) -> str:
    """'validation' for about VALIDATION_PERCENT % of paths, else 'train'."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return "validation" if int.from_bytes(digest[:8], "big") % 100 < VALIDATION_PERCENT else "train"


def iter_source_paths(root: Path | None = None) -> list[tuple[str, Path]]:
    """(relative path, path) of every stdlib `*.py`, sorted by relative path."""
    root = stdlib_root() if root is None else root
    paths: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        for filename in filenames:
            if filename.endswith(".py"):
                path = Path(dirpath) / filename
                paths.append((path.relative_to(root).as_posix(), path))
    paths.sort()
    return paths


def load_split(split: str, *, for_metric: bool = False, root: Path | None = None) -> list[SourceFile]:
    """UTF-8 source files of `split` ('train' or 'validation'), sorted by path.

    `for_metric=True` leaves out the files under METRIC_EXCLUDED_PREFIXES.
    """
    if split not in ("train", "validation"):
        raise ValueError(f"split={split!r} must be 'train' or 'validation'")
    files: list[SourceFile] = []
    for rel_path, path in iter_source_paths(root):
        if split_of(rel_path) != split:
            continue
        if for_metric and rel_path.startswith(METRIC_EXCLUDED_PREFIXES):
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text:
            files.append(SourceFile(rel_path, text))
    return files
