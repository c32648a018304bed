"""vLLM's CPU build beside kvserve in `bench throughput`, on the same random checkpoint and prompts.

vLLM's requirements pin versions that kvserve's environment cannot share, so it runs in an environment of its own
(`--vllm-python`, that environment's interpreter; the recipe is in docs/performance.md): the bench runs
vllm_driver.py there as a subprocess, a JSON job in and a JSON result out. The driver's engine is vLLM's as users
run it: bfloat16, its CPU attention, torch.compile'd unless `enforce_eager`, its threads bound to the cores the bench
may use (as many as kvserve's), with tcmalloc and Intel's OpenMP preloaded as vLLM's CPU docs ask.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

DRIVER = Path(__file__).with_name("vllm_driver.py")
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
CHECK_TOKENS = 8            # leading greedy tokens of each prompt compared with kvserve's
_PROBE = "import json, sys, vllm; print(json.dumps({'version': vllm.__version__, 'prefix': sys.prefix}))"


@dataclass
class VllmCpu:
    """An interpreter that imports vllm, its version, and the environment's prefix (where its libiomp5 is)."""
    python: Path
    version: str
    prefix: Path

    @classmethod
    def probe(cls, python: str) -> VllmCpu:
        """The environment of `python` (--vllm-python). ValueError, naming the flag, where it is not an interpreter
        that imports vllm."""
        try:
            out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, check=False)
        except OSError as e:
            raise ValueError(f"--vllm-python {python}: cannot be run: {e.strerror}") from None
        try:
            found = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
        except (IndexError, json.JSONDecodeError):
            found = None
        if not isinstance(found, dict):
            last = (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]
            raise ValueError(f"--vllm-python {python}: not a Python that imports vllm ({last})")
        return cls(Path(python), found["version"], Path(found["prefix"]))

    def command(self, out: Path) -> list[str]:
        """The driver's command line: it writes its result to `out`."""
        return [str(self.python), str(DRIVER), str(out)]

    def environment(self, threads: int, kv_cache_gib: int, base: dict[str, str] | None = None) -> dict[str, str]:
        """`base` (default: this process's environment) with vLLM's CPU settings: its OpenMP threads bound to the
        first `threads` cores this process may run on, a KV cache of `kv_cache_gib` GiB, tcmalloc (where installed)
        and the environment's libiomp5 preloaded."""
        env = dict(os.environ if base is None else base)
        cores = sorted(os.sched_getaffinity(0))[:threads]
        preload = [str(p) for p in (TCMALLOC, self.prefix / "lib" / "libiomp5.so") if p.exists()]
        env.update(VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cores)), VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
                   LD_PRELOAD=":".join([*preload, *filter(None, [env.get("LD_PRELOAD")])]))
        return env

    def run(self, job: dict, env: dict[str, str]) -> dict:
        """The driver's result for `job` (vllm_driver.py says what each holds). RuntimeError with the end of its
        output where it fails."""
        with tempfile.TemporaryDirectory(prefix="kvserve-vllm-") as tmp:
            out = Path(tmp) / "result.json"
            done = subprocess.run(self.command(out), input=json.dumps(job), capture_output=True, text=True, env=env,
                                  check=False)
            if done.returncode or not out.exists():
                log = done.stdout + done.stderr
                raise RuntimeError(f"vLLM's driver failed (exit {done.returncode}): {_cause(log)}")
            return json.loads(out.read_text())


def _cause(log: str) -> str:
    """The first exception line of vLLM's log (its engine's fails in another process, and the driver's traceback
    only says that it died), and the log's last lines."""
    errors = [line for line in log.splitlines()
              if ("Error: " in line or "Exception: " in line) and " WARNING " not in line]
    return "\n".join([*errors[:1], "...", *log.splitlines()[-20:]])


def kv_cache_gib(seqs: int, max_len: int, config: dict) -> int:
    """Whole GiB (vLLM's unit) of a bfloat16 KV cache for `seqs` sequences of `max_len` tokens of the Llama
    `config` (config.json's fields)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2
    return max(1, math.ceil(seqs * max_len * per_token / 2**30))


def rates(seqs: int, prompt_len: int, tokens: int, runs: dict[str, list[float]]) -> dict:
    """A side's figures for a batch of `seqs` prompts of `prompt_len` tokens from its runs: the median prefill
    seconds (a generate of one token each) and its tok/s, generated tok/s from the median seconds of a run of `tokens`
    each, and the best decode tok/s of those runs (bench.common.decode_rate's: on a busy machine a run that another
    job slowed says nothing of the engine)."""
    prefill = statistics.median(runs["prefill_s"])
    return {"prefill_s": prefill, "prefill_tok_s": seqs * prompt_len / prefill,
            "tok_s": seqs * tokens / statistics.median(runs["generate_s"]), "decode_tok_s": max(runs["decode_tok_s"])}


def leading_equal(ours: list[list[int]], theirs: list[list[int]], n: int = CHECK_TOKENS) -> int:
    """How many prompts' first `n` greedy tokens are the same on both sides."""
    return sum(a[:n] == b[:n] for a, b in zip(ours, theirs))
