"""bench replicas' workload and its report's targets, on given figures (the measured run is the bench's)."""
from __future__ import annotations

import argparse

from kvserve.bench.replicas import print_report, workload
from kvserve.model.loader import load_tokenizer, resolve_model


def test_the_workload_interleaves_tenants_that_share_their_system_prompts():
    args = argparse.Namespace(tenants=3, questions=4, system_len=64, question_len=8)
    tokenizer = load_tokenizer(resolve_model(None))
    prompts = workload(args, seed=1, tokenizer=tokenizer)
    assert len(prompts) == 12
    systems = [p.split("\nQuestion: ")[0] for p in prompts]
    assert len(set(systems)) == 3 and all(systems.count(s) == 4 for s in set(systems))
    assert all(len(tokenizer.encode(s)) >= 64 for s in systems)
    assert systems != sorted(systems, key=systems.index)          # not one tenant after another
    assert workload(args, seed=1, tokenizer=tokenizer) == prompts and workload(args, 2, tokenizer) != prompts


def row(hit: float, ttft: float) -> dict:
    return {"hit_rate": hit, "pool_hit_rate": hit, "tier_hit_rate": 0.0, "ttft_mean_ms": ttft, "ttft_p90_ms": ttft,
            "output_tok_s": 1.0, "request_s": 1.0, "replicas_serving": 2, "errors": 0}


def test_the_report_holds_the_tier_to_one_replica_and_round_robin(capsys):
    rows = {"round robin": row(0.4, 200.0), "round robin + tier": row(0.8, 90.0), "cache_aware": row(0.7, 120.0),
            "cache_aware + tier": row(0.8, 100.0), "one replica": row(0.85, 95.0)}
    print_report({"rows": rows})
    out = capsys.readouterr().out
    assert "within 10%: met" in out and "2.22x lower" in out and "(target 2x: met)" in out
    rows["round robin + tier"] = row(0.7, 150.0)
    print_report({"rows": rows})
    out = capsys.readouterr().out
    assert "within 10%: NOT met" in out and "(target 2x: NOT met)" in out
