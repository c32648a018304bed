"""The optional extras' modules (`bench`: matplotlib, aiohttp; `top`: rich), imported only where used, so that
the core install needs none of them; a missing one is an error naming its install command."""
from __future__ import annotations

import importlib
from types import ModuleType

BENCH_EXTRA = "pip install 'kvserve[bench]'"


class MissingDependency(ImportError):
    """A module of an optional extra is not installed; the message names the install command."""


def optional_import(name: str, needed_for: str) -> ModuleType:
    """Import and return `name`, a module of the `bench` extra; raise MissingDependency saying what
    needs it and how to install it when it is absent."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise MissingDependency(f"{needed_for} needs {name}, which the core install leaves out: {BENCH_EXTRA}") from e


def pyplot(needed_for: str = "drawing figures") -> ModuleType:
    """matplotlib.pyplot on the Agg backend (files only, no display); MissingDependency without matplotlib."""
    optional_import("matplotlib", needed_for).use("Agg")
    return importlib.import_module("matplotlib.pyplot")
