"""The training corpus: the Python standard-library sources of this machine.

Files are split by a hash of their relative path, so the held-out slice is the same on
every machine with the same Python version and never depends on file order or count.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

HELD_OUT_PERCENT = 5
_SKIP_DIRS = {"site-packages", "__pycache__", "idlelib", "tkinter", "turtledemo"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_held_out(rel_path: str) -> bool:
    digest = hashlib.sha1(rel_path.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELD_OUT_PERCENT


def source_files(split: str, root: Path | None = None) -> list[Path]:
    """Sorted .py files of the stdlib for split 'train' or 'heldout'."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', not {split!r}")
    root = root or stdlib_root()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if _is_held_out(rel) == (split == "heldout"):
                files.append(path)
    return files


def read_texts(files: list[Path]) -> list[str]:
    texts = []
    for path in files:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def heldout_prompts(n: int, prompt_chars: int = 200) -> list[str]:
    """n prompts cut from held-out files: the start of a top-level def or class.

    Deterministic: files in sorted order, first matching line of each file.
    """
    prompts = []
    for text in read_texts(source_files("heldout")):
        lines = text.splitlines(keepends=True)
        for i, line in enumerate(lines):
            if line.startswith(("def ", "class ")) and i > 0:
                chunk = "".join(lines[max(0, i - 3): i + 2])[-prompt_chars:]
                prompts.append(chunk)
                break
        if len(prompts) == n:
            break
    return prompts
