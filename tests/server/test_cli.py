"""The `kvserve` command's effects on its own process, and a library's lack of them."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kvserve.engine.builder as builder_module
from kvserve import LLM
from kvserve.cli import API_KEY_VARIABLES, api_key, build_parser, engine_kwargs, main
from servers import free_port


def test_the_library_leaves_the_allocator_alone_unless_asked(tiny_llama, monkeypatch):
    calls = []
    monkeypatch.setattr(builder_module, "reuse_freed_memory", lambda: calls.append(1))
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
    assert main(["serve", "--max-connections", "0"]) == 2
    assert "max_connections must be positive" in capsys.readouterr().err
    assert main(["serve", "--request-read-timeout", "-1"]) == 2
    assert "request_read_timeout" in capsys.readouterr().err


def test_a_port_out_of_range_is_refused(capsys):
    for port in ("99999", "0", "-1", "http"):
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args(["serve", "--port", port])
        assert exit_.value.code == 2 and "[1, 65535]" in capsys.readouterr().err
    assert build_parser().parse_args(["serve", "--port", "65535"]).port == 65535


def test_the_api_key_comes_from_the_flag_a_file_or_the_environment(tmp_path, monkeypatch):
    """`ps` shows a command line: the key can come from a file or the environment (vLLM's variable too)."""
    def key(*flags):
        return api_key(build_parser().parse_args(["serve", *flags]))

    for name in API_KEY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert key() is None
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert key() == "from-vllm"
    monkeypatch.setenv("KVSERVE_API_KEY", "from-kvserve")
    assert key() == "from-kvserve"
    (tmp_path / "key").write_text("from-file\n")
    assert key("--api-key-file", str(tmp_path / "key")) == "from-file"
    assert key("--api-key", "from-flag") == "from-flag"
    (tmp_path / "empty").write_text("\n")
    for flags, text in [(["--api-key-file", str(tmp_path / "none")], "cannot be read"),
                        (["--api-key-file", str(tmp_path / "empty")], "one key"),
                        (["--api-key", "a", "--api-key-file", str(tmp_path / "key")], "not both")]:
        with pytest.raises(ValueError, match=text):
            key(*flags)


def one_line_error(err: str, text: str) -> bool:
    return text in err and err.strip().count("\n") == 0 and "Traceback" not in err


def test_an_engine_that_cannot_run_here_is_a_one_line_error(tiny_llama, capsys, monkeypatch):
    """A device this machine lacks, a backend that cannot run on it, a memory size past the floats: exit code 2 and
    one line, not a traceback (nor a server that answers every request with a 500)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)        # the tests' way of running Triton on the CPU
    cases = [(["--kv-cache-memory", "1e400"], "kv_cache_memory: memory size must be a finite positive number"),
             (["--device", "tpu"], "device 'tpu': kvserve runs on cpu or cuda"),
             (["--attention-backend", "triton", "--device", "cpu"], "attention_backend 'triton' runs on a CUDA GPU")]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "device 'cuda': this machine has no CUDA GPUs"))
    for flags, text in cases:
        assert main(["generate", "hi", "--model", str(tiny_llama), "--max-tokens", "2", *flags]) == 2
        assert one_line_error(capsys.readouterr().err, text), flags


def test_serve_with_a_backend_that_cannot_run_here_stops_at_start(tiny_llama):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = ["serve", "--model", str(tiny_llama), "--port", str(free_port()), "--attention-backend", "triton",
               "--device", "cpu", "--num-kv-blocks", "8"]
    done = subprocess.run([sys.executable, "-m", "kvserve", *command], capture_output=True, text=True, timeout=300,
                          env=env, check=False)
    assert done.returncode == 2 and one_line_error(done.stderr, "attention_backend 'triton' runs on a CUDA GPU")
