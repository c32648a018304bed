"""The demo model's text: the Python standard library's own sources, split into train and held-out.

The modules in HELD_OUT_MODULES (and their test suites) are never trained on; `held_out_text()` is
what held-out loss and perplexity are measured on. Both lists are sorted, so they are reproducible
on one Python version (other versions ship slightly different sources).
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

HELD_OUT_MODULES = ("bisect", "calendar", "colorsys", "difflib", "fractions", "heapq", "json",
                    "shlex", "statistics", "textwrap")
# site-packages is not the standard library; encodings is mostly generated codec tables.
SKIPPED_DIRS = ("site-packages", "encodings", "__pycache__")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Every .py file of the standard library (tests included), sorted, minus SKIPPED_DIRS."""
    root = root or stdlib_root()
    return sorted(p for p in root.rglob("*.py")
                  if not any(part in SKIPPED_DIRS for part in p.relative_to(root).parts))


def is_held_out(path: Path, root: Path | None = None) -> bool:
    """Whether `path` belongs to a held-out module or to its tests (test_<module>)."""
    names = {Path(part).stem for part in path.relative_to(root or stdlib_root()).parts}
    return any(m in names or f"test_{m}" in names for m in HELD_OUT_MODULES)


def training_files(root: Path | None = None) -> list[Path]:
    root = root or stdlib_root()
    return [p for p in stdlib_files(root) if not is_held_out(p, root)]


def held_out_files(root: Path | None = None) -> list[Path]:
    """The held-out modules' own sources (not their tests), sorted."""
    root = root or stdlib_root()
    return [p for p in stdlib_files(root)
            if is_held_out(p, root) and not any(part.startswith("test") for part in p.relative_to(root).parts)]


def read_source(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def held_out_text(root: Path | None = None) -> str:
    """The held-out modules' sources, one after another, separated by a blank line."""
    return "\n\n".join(read_source(p) for p in held_out_files(root))
