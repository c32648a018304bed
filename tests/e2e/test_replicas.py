"""Two `kvserve serve` replicas behind vLLM's router (`vllm-router`, the bench extra) sharing a Redis tier: round
robin and cache_aware answer as one engine does, streaming included, and a prefix one replica computed is loaded
by the other."""
from __future__ import annotations

import json
import shutil
import time
import urllib.request

import pytest

from kvserve import LLM, SamplingParams
from kvserve.bench.replicas import Cluster, scrape, start_replicas, start_router

pytestmark = pytest.mark.skipif(shutil.which("vllm-router") is None,
                                reason="vllm-router is not installed (pip install 'kvserve[bench]'; CI installs it)")

BS = 4
SYSTEM = "The quick brown fox jumps over the lazy dog. Once upon a time there was a cache. " * 2
QUESTIONS = ["import os", "def fibonacci(n):", "Paged attention splits", "for i in range(10):"]


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("llama", max_position_embeddings=256)


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())


def streamed(url: str, body: dict) -> str:
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps({**body, "stream": True}).encode(),
                                     {"Content-Type": "application/json"})
    text = ""
    with urllib.request.urlopen(request, timeout=120) as r:
        for line in r:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    return text


def body(question: str) -> dict:
    return {"model": "bench-model", "prompt": SYSTEM + question, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}


def served(cluster: Cluster) -> list[float]:
    return [scrape(u).get("kvserve:request_success_total", 0.0) for u in cluster.replica_urls]


def test_replicas_behind_the_router(ckpt, redis_server, tmp_path):
    redis_server.client().flushall()
    reference = LLM(str(ckpt), block_size=BS, num_kv_blocks=128, enable_prefix_caching=False)
    expected = [o.outputs[0].text for o in reference.generate(
        [SYSTEM + q for q in QUESTIONS], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
        use_tqdm=False)]
    args = ["--model", str(ckpt), "--block-size", str(BS), "--num-kv-blocks", "128", "--max-model-len", "256",
            "--kv-offload", redis_server.url, "--kv-offload-size", "16MiB", "--preemption-mode", "recompute"]
    procs, urls = start_replicas(2, args, tmp_path)
    cluster = Cluster(procs, urls, None, "")
    try:
        router, url = start_router(urls, "round_robin", tmp_path)
        cluster = Cluster(procs, urls, router, url)
        first = post(url, body(QUESTIONS[0]))["choices"][0]["text"]
        deadline = time.monotonic() + 60          # the first replica's blocks are in Redis before the next request
        while max(scrape(u).get("kvserve:kv_offload_blocks_stored_total", 0.0) for u in urls) < 12:  # of ~17
            assert time.monotonic() < deadline, "no replica wrote its blocks to the tier"
            time.sleep(0.1)
        texts = [first] + [post(url, body(q))["choices"][0]["text"] for q in QUESTIONS[1:3]]
        texts.append(streamed(url, body(QUESTIONS[3])))
        assert texts == expected
        assert served(cluster) == [2.0, 2.0]                     # round robin: each replica half
        assert sum(scrape(u).get("kvserve:kv_offload_hit_tokens_total", 0.0) for u in urls) > 0
        router.terminate()
        router.wait()
        router, url = start_router(urls, "cache_aware", tmp_path)
        cluster = Cluster(procs, urls, router, url)
        before = served(cluster)
        texts = [post(url, body(q))["choices"][0]["text"] for q in QUESTIONS[:3]]
        texts.append(streamed(url, body(QUESTIONS[3])))
        assert texts == expected
        assert sorted(a - b for a, b in zip(served(cluster), before)) == [0.0, 4.0]   # one prefix, one replica
    finally:
        cluster.stop()
