"""What watching the KV cache costs the engine: one state snapshot (kvserve.engine.kv_state.snapshot, pickled
as the pipe to the server pickles it) against one engine step, at the load of `kvserve bench serve` at
concurrency 64: 64 requests of 128 random prompt tokens and 128 output tokens on the demo model, with
`kvserve serve`'s defaults (its pool of 16,384 blocks). The server takes at most 4 snapshots a second
(server/dashboard.py's STATE_INTERVAL), so 4 x the snapshot's time is the engine's share per second.

    python scripts/kv_state_cost.py [--requests 64] [--steps 100]
"""
from __future__ import annotations

import argparse
import pickle
import statistics
import time
from functools import partial

from kvserve.bench.common import random_prompts
from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.kv_state import render, snapshot
from kvserve.sampling import SamplingParams
from kvserve.server.dashboard import STATE_INTERVAL


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--steps", type=int, default=100, help="decode steps measured, each with one snapshot (at most "
                                                           "the 127 the requests run)")
    args = p.parse_args()
    engine = LLMEngine(EngineConfig(model=None))
    params = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0)
    for i, prompt in enumerate(random_prompts(args.requests, 128, engine.model_config.vocab_size)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    while engine.scheduler.waiting:
        engine.step()
    steps, snaps, renders = [], [], []
    while len(steps) < args.steps and engine.scheduler.running:
        steps.append(timed(engine.step))
        snaps.append(timed(lambda: pickle.dumps(snapshot(engine), protocol=pickle.HIGHEST_PROTOCOL)))
        renders.append(timed(partial(render, snapshot(engine))))
    step, snap, rendered = (statistics.median(x) * 1e3 for x in (steps, snaps, renders))
    rate = 1 / STATE_INTERVAL
    stats = engine.stats()
    print(f"{len(engine.scheduler.running)} running, {stats['kv_blocks_total']} blocks "
          f"({stats['kv_blocks_total'] - stats['kv_blocks_free']} in use); medians of {len(steps)} steps")
    print(f"step {step:.2f} ms; snapshot + pickle {snap:.3f} ms ({100 * snap / step:.2f}% of a step); "
          f"at {rate:g} snapshots/s: {100 * rate * snap / 1e3:.3f}% of the engine's time")
    print(f"render (the server's process, not the engine's): {rendered:.3f} ms")


if __name__ == "__main__":
    main()
