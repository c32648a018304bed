"""The `kvserve` command's effects on its own process, and a library's lack of them."""
from __future__ import annotations

import subprocess
import sys

import kvserve.engine.engine as engine_module
from kvserve import LLM
from kvserve.cli import build_parser, engine_kwargs


def test_the_library_leaves_the_allocator_alone_unless_asked(tiny_llama, monkeypatch):
    calls = []
    monkeypatch.setattr(engine_module, "reuse_freed_memory", lambda: calls.append(1))
    LLM(str(tiny_llama), num_kv_blocks=8, max_model_len=32)
    assert calls == []
    LLM(str(tiny_llama), num_kv_blocks=8, max_model_len=32, cpu_allocator_tuning=True)
    assert calls == [1]


def test_the_command_tunes_the_allocator_by_default_and_can_be_told_not_to():
    parser = build_parser()
    assert engine_kwargs(parser.parse_args(["generate", "hi"]))["cpu_allocator_tuning"] is True
    assert engine_kwargs(parser.parse_args(["serve"]))["cpu_allocator_tuning"] is True
    off = parser.parse_args(["serve", "--no-cpu-allocator-tuning"])
    assert engine_kwargs(off)["cpu_allocator_tuning"] is False


def test_the_command_exits_through_the_interpreter():
    """atexit handlers run and the exit code is main()'s."""
    script = ("import atexit, sys; atexit.register(lambda: print('atexit ran')); "
              "sys.argv = ['kvserve', 'plan', '--model', 'llama-3.2-1b', '--gpu', 'h100']; "
              "from kvserve.cli import entry; entry()")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().endswith("atexit ran")
    bad = script.replace("'h100'", "'h100', '--context', '0'")
    done = subprocess.run([sys.executable, "-c", bad], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "atexit ran" in done.stdout and "context" in done.stderr


def test_serve_refuses_limits_that_admit_nothing(capsys):
    from kvserve.cli import main

    assert main(["serve", "--max-connections", "0"]) == 2
    assert "max_connections must be positive" in capsys.readouterr().err
    assert main(["serve", "--request-read-timeout", "-1"]) == 2
    assert "request_read_timeout" in capsys.readouterr().err
