"""The engine's flags, generated from EngineConfig's fields: one flag with help for every field, each reaching it."""
from __future__ import annotations

import argparse
import dataclasses
import typing

import pytest

from kvserve.arg_utils import add_engine_args, engine_kwargs
from kvserve.cli import build_parser
from kvserve.config import EngineConfig, option

# each subcommand that builds an engine: its arguments without flags
ENGINE_COMMANDS = {"generate": ["generate", "hi"], "serve": ["serve"], "eval perplexity": ["eval", "perplexity"],
                   "eval passkey": ["eval", "passkey"]}
# a value of each kind that no field has as its default, as the flag's text and as the field then holds it
VALUES = {int: ("3", 3), float: ("0.5", 0.5), str: ("x", "x")}


def subcommand_actions(command: str) -> dict[str, argparse.Action]:
    """The actions of a subcommand ("eval passkey"), by destination."""
    parser = build_parser()
    for name in command.split():
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return {a.dest: a for a in parser._actions}


def changed(f: dataclasses.Field, action: argparse.Action, default) -> tuple[list[str], object]:
    """Arguments that set the field to a value other than the command's default, and that value."""
    flag = "--" + f.name.replace("_", "-")
    if isinstance(default, bool):
        return ([f"--no-{f.name.replace('_', '-')}"], False) if default else ([flag], True)
    if action.choices:
        choice = next(c for c in reversed(list(action.choices)) if c != default)
        return [flag, choice], choice
    hint = typing.get_type_hints(EngineConfig)[f.name]
    if typing.get_origin(hint) is tuple:
        return [flag, "0,3"], (0, 3)
    kinds = [t for t in typing.get_args(hint) or (hint,) if t is not type(None)]
    text, value = VALUES[str if str in kinds else kinds[0]]
    return [flag, text], value


@pytest.mark.parametrize("name", ENGINE_COMMANDS)
def test_every_engine_field_is_a_flag_with_help_that_reaches_the_field(name):
    actions, command = subcommand_actions(name), ENGINE_COMMANDS[name]
    parser = build_parser()
    defaults = engine_kwargs(parser.parse_args(command))
    assert set(defaults) == {f.name for f in dataclasses.fields(EngineConfig)}
    for f in dataclasses.fields(EngineConfig):
        action = actions[f.name]
        flag = "--" + f.name.replace("_", "-")
        # a switch on by default can be turned off; one off by default has no --no- form
        switch_off = [f"--no-{flag[2:]}"] if defaults[f.name] is True else []
        assert action.option_strings == [flag, *switch_off, *f.metadata.get("aliases", ())]
        assert f.metadata["help"].strip() and action.help == f.metadata["help"]
        argv, value = changed(f, action, defaults[f.name])
        assert value != defaults[f.name], f.name
        kwargs = engine_kwargs(parser.parse_args([*command, *argv]))
        assert kwargs == {**defaults, f.name: value}, f.name


def test_the_command_defaults_are_the_library_defaults_but_where_a_field_says_otherwise():
    parser = build_parser()
    serve = EngineConfig(**engine_kwargs(parser.parse_args(["serve"])))
    assert serve == EngineConfig(cpu_allocator_tuning=True)
    # one prompt: a cache for one sequence
    assert EngineConfig(**engine_kwargs(parser.parse_args(["generate", "hi"]))) == dataclasses.replace(
        serve, max_num_seqs=1)


def test_flags_are_typed_from_the_fields():
    args = build_parser().parse_args(["serve", "-tp", "2", "--kv-cache-dtype-skip-layers", "0,31",
                                      "--gpu-memory-utilization", "0.5", "--kv-cache-memory", "2GiB"])
    kwargs = engine_kwargs(args)
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["kv_cache_dtype_skip_layers"] == (0, 31)
    assert kwargs["gpu_memory_utilization"] == 0.5 and kwargs["kv_cache_memory"] == "2GiB"
    for bad in (["--block-size", "big"], ["--kv-cache-dtype", "int3"], ["--kv-cache-dtype-skip-layers", "a,b"],
                ["--preemption-mode", "drop"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *bad])


def test_a_field_of_a_type_no_flag_reads_is_refused(monkeypatch):
    @dataclasses.dataclass
    class Odd:
        pairs: dict[str, int] = option(None, "a mapping")

    monkeypatch.setattr("kvserve.arg_utils.EngineConfig", Odd)
    with pytest.raises(TypeError, match="pairs"):
        add_engine_args(argparse.ArgumentParser())
