"""What several commands share: the engine's flags, generated from EngineConfig's fields (the field's type, default
and help: kvserve.config.option), the value types beside them, and the --json file of the measuring commands."""
from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any

from kvserve.config import EngineConfig


def layer_list(text: str) -> tuple[int, ...]:
    """Layer numbers from a comma-separated list such as "0,31"; argparse's error for anything else."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers such as 0,31, got {text!r}") from None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Every EngineConfig field as a flag (max_model_len: --max-model-len) with the field's help: the LLM(...)
    options of each subcommand that builds an engine. A field whose type no flag reads is a TypeError."""
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        # argparse formats help with %: a literal one must reach it as %%
        p.add_argument(*flag_names(f), dest=f.name, help=f.metadata["help"].replace("%", "%%"),
                       **_flag_options(f, hints[f.name]))


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields of parsed engine flags, by name: EngineConfig(**engine_kwargs(args))."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}


def flag_names(f: dataclasses.Field) -> tuple[str, ...]:
    """The flag of a field, and its aliases."""
    return ("--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ()))


def _flag_options(f: dataclasses.Field, hint: Any) -> dict[str, Any]:
    default = f.metadata.get("cli_default", f.default)
    options: dict[str, Any] = {"default": default}
    if "metavar" in f.metadata:
        options["metavar"] = f.metadata["metavar"]
    if (choices := f.metadata.get("choices")) is not None:
        options["choices"] = choices() if callable(choices) else choices
    value = _value_type(f.name, hint)
    if value is bool:
        # a switch that is on by default can be turned off (--no-enable-prefix-caching); one that is off, on
        options["action"] = argparse.BooleanOptionalAction if default else "store_true"
    elif value is not str:
        options["type"] = value
    return options


def _value_type(name: str, hint: Any) -> Any:
    """What a flag's text becomes: the field's type less None; the text itself where the field also takes it
    (sizes: int | str; eviction: str | dict); layer_list for tuple[int, ...]."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    kinds = [t for t in typing.get_args(hint) if t is not type(None)] if union else [hint]
    if str in kinds:
        return str
    if len(kinds) == 1 and kinds[0] in (int, float, bool):
        return kinds[0]
    if len(kinds) == 1 and typing.get_origin(kinds[0]) is tuple and typing.get_args(kinds[0]) == (int, ...):
        return layer_list
    raise TypeError(f"EngineConfig.{name}: no flag reads a {hint}")


def write_json(path: str | None, data: dict) -> None:
    """Write `data` to `path` (a --json flag's value) as indented JSON, and say so; nothing without a path."""
    if path:
        Path(path).write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {path}")
