"""`kvserve bench decode|throughput|prefix|capacity` on a tiny model: they run, and their JSON holds sane figures."""
from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
from pathlib import Path

import pytest
import torch

from kvserve.bench.common import linear_params, linear_step, make_checkpoint
from kvserve.bench.report import plot_eviction, plot_quant
from kvserve.cli import main
from kvserve.config import ModelConfig
from kvserve.model.layers import gemm_kernels
from timings import measured

TINY = ["--hidden-size", "64", "--intermediate-size", "128", "--num-layers", "2", "--num-heads", "4",
        "--num-kv-heads", "2", "--vocab-size", "512"]


def _positive(x) -> bool:
    """A finite positive number: a size, a count, a perplexity; never a timing (timings.measured)."""
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_bench_decode_json(tmp_path):
    path = tmp_path / "decode.json"
    assert main(["bench", "decode", "--quick", "--json", str(path), "--tokens", "16", "--prompt-len", "8", *TINY]) == 0
    res = json.loads(path.read_text())
    assert res["generated_tokens"] == 16
    for mode in ("none", "paged"):
        r = res[mode]
        assert len(r["per_token_ms"]) == 16 and all(measured(t) for t in r["per_token_ms"])
        assert r["total_s"] == pytest.approx(sum(r["per_token_ms"]) / 1e3)
        assert set(r["at_positions_ms"]) == {"1", "16"} and all(measured(t) for t in r["at_positions_ms"].values())
        assert math.isfinite(r["slope_ms_per_100_positions"]) and measured(r["growth_last_over_first"])
    assert measured(res["speedup_cached_vs_none"])
    assert res["speedup_cached_vs_none"] == pytest.approx(res["none"]["total_s"] / res["paged"]["total_s"])


def test_bench_throughput_json(tmp_path):
    path = tmp_path / "throughput.json"
    args = ["--requests", "4", "--prompt-len", "16", "--tokens", "8", "--batch1-prompt-len", "8",
            "--batch1-tokens", "24", "--repeats", "1", "--device", "cpu", "--decode-batches", "2,6"]
    assert main(["bench", "throughput", "--quick", "--json", str(path), *args, *TINY]) == 0
    res = json.loads(path.read_text())
    assert measured(res["read_bandwidth_bytes_s"])
    assert res["workload"]["decode_batches"] == [2, 6]
    # TINY's linear weights: 2 layers of q, k, v, o (64 x (64 + 2 x 32 + 64)) and the MLP's 3 x 64 x 128; lm_head
    weights = 2 * (64 * (64 + 2 * 32 + 64) + 3 * 64 * 128) + 64 * 512
    for dtype in ("float32", "bfloat16"):
        r = res[dtype]
        for key in ("ours_tok_s", "hf_tok_s", "ratio_vs_hf", "fraction_of_limit", "batch1_tok_s",
                    "batch1_fraction_of_bandwidth_limit", "hf_batch1_tok_s", "limit_s", "matmul_flop_s"):
            assert measured(r[key]), key
        assert r["generated_tokens"] == r["hf_generated_tokens"] == 4 * 8
        assert r["ratio_vs_hf"] == pytest.approx(r["ours_tok_s"] / r["hf_tok_s"])
        assert r["fraction_of_limit"] == pytest.approx(r["limit_s"] / r["ours_s"])
        assert r["limit_s"] >= max(r["compute_limit_s"], r["memory_limit_s"]) * (1 - 1e-9)
        assert r["batch1_fraction_of_bandwidth_limit"] == pytest.approx(r["batch1_tok_s"] / r["batch1_limit_tok_s"])
        assert set(r["decode_vs_gemms"]) == {"2", "6"}
        for b, d in r["decode_vs_gemms"].items():
            for key in ("tok_s", "step_s", "linear_s", "linear_flops", "linear_flop_s", "step_flop_s",
                        "fraction_of_gemm_rate"):
                assert measured(d[key]), (b, key)
            # every linear layer once, at b rows: 2 FLOPs a weight a row
            assert d["linear_flops"] == 2 * weights * int(b)
            assert d["step_s"] == pytest.approx(int(b) / d["tok_s"])
            assert d["fraction_of_gemm_rate"] == pytest.approx(d["linear_s"] / d["step_s"])
            assert d["fraction_of_gemm_rate"] == pytest.approx(d["step_flop_s"] / d["linear_flop_s"])
        # the limit of batch-1 decode is the bandwidth measured around its run
        bandwidth = r["runs"]["batch1_read_bandwidth_bytes_s"][0]
        assert r["batch1_limit_tok_s"] == pytest.approx(bandwidth / r["weight_bytes"])
        if shutil.which("cc"):   # the CPU decodes by the C step, and op by op beside it
            assert r["native_decode"] and not r["cuda_graphs"] and measured(r["batch1_eager_tok_s"])
            assert all(measured(v["native"]) and measured(v["eager"]) for v in r["native_by_batch"].values())
            # with every layer packed for csrc/gemm.c, the step takes any batch
            assert (r["native_max_batch"] is None) == r["native_gemm"]


def test_bench_throughput_one_dtype(tmp_path):
    path = tmp_path / "throughput.json"
    args = ["--dtype", "float32", "--requests", "2", "--prompt-len", "4", "--tokens", "2", "--batch1-prompt-len", "4",
            "--batch1-tokens", "24", "--repeats", "1", "--no-sweep"]
    assert main(["bench", "throughput", "--quick", "--json", str(path), *args, *TINY]) == 0
    res = json.loads(path.read_text())
    assert "float32" in res and "bfloat16" not in res and res["float32"]["native_by_batch"] is None
    assert res["workload"]["decode_batches"] == [4]       # a quick run's one small batch


def test_bench_throughput_decode_against_its_gemms(tmp_path):
    """At a shape whose GEMMs outweigh the calls' own cost, the decode batch is timed as the engine runs it (by the C
    step, several steps a call) against its linear layers alone (no bound on the fraction: it is a timing)."""
    path = tmp_path / "throughput.json"
    shape = ["--hidden-size", "512", "--intermediate-size", "1408", "--num-layers", "2", "--num-heads", "8",
             "--num-kv-heads", "2", "--vocab-size", "4096"]
    args = ["--dtype", "bfloat16", "--requests", "2", "--prompt-len", "8", "--tokens", "6", "--batch1-prompt-len", "4",
            "--batch1-tokens", "2", "--repeats", "1", "--no-sweep", "--no-llama-cpp", "--device", "cpu",
            "--decode-batches", "8"]
    assert main(["bench", "throughput", "--quick", "--json", str(path), *args, *shape]) == 0
    d = json.loads(path.read_text())["bfloat16"]["decode_vs_gemms"]["8"]
    weights = 2 * (512 * (512 + 2 * 128 + 512) + 3 * 512 * 1408) + 512 * 4096
    assert d["linear_flops"] == 2 * weights * 8 and measured(d["fraction_of_gemm_rate"])
    assert d["fraction_of_gemm_rate"] == pytest.approx(d["linear_s"] / d["step_s"])
    if shutil.which("cc"):      # the C step decoded the batch, several steps a call
        assert d["steps"]["native_multi_step"] > 0


def test_bench_decode_batches_flag(capsys):
    from kvserve.bench.throughput import decode_batches

    assert decode_batches("64,32,32") == [32, 64] and decode_batches("none") == decode_batches("") == []
    for bad in ("0", "32,x", ","):
        with pytest.raises(ValueError, match="--decode-batches"):
            decode_batches(bad)
    assert main(["bench", "throughput", "--decode-batches", "32", "--max-num-seqs", "16", *TINY]) == 2
    assert "--decode-batches" in capsys.readouterr().err


def test_linear_step_times_the_engines_own_linear_layers(checkpoint):
    """linear_step calls each of the engine's Linear modules (its weights, packing and GEMM choice) once a run, on
    inputs of the step's rows, and counts 2 FLOPs a weight a row."""
    from kvserve import LLM
    from kvserve.model.layers import Linear
    ckpt = checkpoint(max_position_embeddings=64, dtype=torch.bfloat16)
    llm = LLM(str(ckpt), dtype="bfloat16", device="cpu", block_size=4)
    layers = [m for m in llm.engine.model.modules() if isinstance(m, Linear)]
    rows = []
    for m in layers:
        m.register_forward_hook(lambda m, inputs, out: rows.append((m, inputs[0].shape[0])))
    step = linear_step(llm.engine.model, 5, repeats=3)
    assert len(rows) == 4 * len(layers)                   # a warm-up run and 3 timed ones
    assert {id(m) for m, _ in rows} == {id(m) for m in layers} and {n for _, n in rows} == {5}
    assert step.rows == 5 and measured(step.seconds)
    assert step.flops == 2 * 5 * sum(linear_params(llm.engine.model_config))
    assert step.flop_s == pytest.approx(step.flops / step.seconds)


def test_bench_prefix_json(tmp_path):
    path = tmp_path / "prefix.json"
    args = ["--requests", "4", "--system-len", "32", "--question-len", "8", "--tokens", "3"]
    assert main(["bench", "prefix", "--quick", "--json", str(path), *args, *TINY]) == 0
    res = json.loads(path.read_text())
    for mode in ("no_cache", "cold_cache", "warm_cache"):
        r = res[mode]
        assert len(r["ttft_s"]) == 4 and all(measured(t) for t in r["ttft_s"])
        # one clock: each request's first token came within the burst's time
        assert r["median_ttft_s"] <= r["max_ttft_s"] <= r["total_s"]
        assert 0 <= r["prefix_hit_rate"] <= 1 and r["num_preemptions"] == 0
    assert res["no_cache"]["prefix_hit_rate"] == 0
    # each warm prompt finds the system prompt's 2 full blocks of 16 tokens cached: 32 of its 40 tokens
    assert res["prefix_hit_rate"] == res["warm_cache"]["prefix_hit_rate"] == res["max_hit_rate"] == pytest.approx(0.8)
    assert res["ttft_speedup"] == pytest.approx(res["no_cache"]["median_ttft_s"] / res["warm_cache"]["median_ttft_s"])
    assert res["cold_ttft_speedup"] == pytest.approx(res["no_cache"]["median_ttft_s"]
                                                     / res["cold_cache"]["median_ttft_s"])


def test_bench_capacity_json(tmp_path):
    path = tmp_path / "capacity.json"
    args = ["--requests", "12", "--contexts", "2", "--max-model-len", "128", "--prompt-median", "40",
            "--output-median", "24", "--shared-prompts", "2"]
    assert main(["bench", "capacity", "--quick", "--json", str(path), *args, *TINY]) == 0
    res = json.loads(path.read_text())
    w = res["workload"]
    assert len(w["prompt_lens"]) == len(w["output_lens"]) == 12
    assert all(p >= 1 and o >= 1 and p + o <= 128 for p, o in zip(w["prompt_lens"], w["output_lens"]))
    assert res["kv_budget_bytes"] == 2 * 128 * res["kv_bytes_per_token"]
    for mode in ("contiguous", "paged"):
        r = res[mode]
        assert r["kv_cache_bytes"] == res["kv_budget_bytes"]
        assert r["generated_tokens"] == sum(w["output_lens"])
        assert measured(r["tok_s"]) and 1 <= r["loaded_mean_concurrent"] <= r["peak_concurrent"]
        assert 0 <= res[f"{mode}_waste_pct"] == r["waste_pct"] < 100
    # the budget holds 2 slabs of max_model_len, and more requests than that in blocks
    assert res["contiguous_peak_concurrent"] == 2 < res["paged_peak_concurrent"] <= 12
    assert res["concurrency_ratio"] == pytest.approx(res["paged_peak_concurrent"] / res["contiguous_peak_concurrent"])
    assert res["paged_waste_pct"] < res["contiguous_waste_pct"]
    s = res["sharing"]
    assert s["n"] == 4
    assert s["shared_generated_tokens"] == s["separate_generated_tokens"] == 4 * sum(w["output_lens"][:2])
    assert s["shared_preemptions"] == s["separate_preemptions"] == 0
    assert 0 < s["shared_peak_blocks"] <= s["separate_peak_blocks"]
    assert s["shared_peak_kv_bytes"] == s["shared_peak_blocks"] * 16 * res["kv_bytes_per_token"]
    assert s["saved_pct"] == pytest.approx(100 * (1 - s["shared_peak_blocks"] / s["separate_peak_blocks"]))


def test_linear_params_counts_the_hf_linear_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    shape = dict(hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2, vocab_size=300)
    path = make_checkpoint(tmp_path, shape, max_positions=32)
    layers, head = linear_params(ModelConfig.from_path(path))
    model = AutoModelForCausalLM.from_pretrained(path)
    linears = [m.weight.numel() for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert layers + head == sum(linears)
    assert head == 64 * 300


def test_bench_quant_json(checkpoint, tmp_path):
    ckpt = checkpoint(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                      initializer_range=0.02, max_position_embeddings=256)
    path = tmp_path / "quant.json"
    args = ["--model", str(ckpt), "--tokens", "120", "--context", "60", "--block-size", "16",
            "--passkey-lengths", "200", "--decode-batch", "2", "--decode-prompt", "8", "--decode-tokens", "16",
            "--repeats", "1", "--max-num-seqs", "4"]
    assert main(["bench", "quant", "--quick", "--json", str(path), *args]) == 0
    res = json.loads(path.read_text())
    rows = {r["kv_cache_dtype"]: r for r in res["rows"]}
    assert list(rows) == ["auto", "int8", "fp8", "int4"]
    for d, r in rows.items():
        for key in ("bytes_per_token", "tokens_per_gib", "perplexity"):
            assert _positive(r[key]), (d, key)
        assert measured(r["decode_tok_s"]), d
        assert 0 <= r["passkey_acc"] <= 1 and 0 <= r["top1_agreement"] <= 1 and r["kl"] >= 0
    # fp32 model, head_dim 64: 4 bytes a number become 1 + scales (int8), 1/2 + scales (int4)
    assert rows["auto"]["bytes_per_token"] == 2 * 2 * 2 * 64 * 4
    assert rows["int8"]["bytes_per_token"] == 2 * 2 * 2 * (64 + 2)
    assert rows["int8"]["tokens_per_gib"] > 3.5 * rows["auto"]["tokens_per_gib"]
    assert rows["auto"]["kl"] == 0 and rows["auto"]["top1_agreement"] == 1
    assert rows["int4"]["kl"] > 0
    plot_quant(res, tmp_path / "quant.png", "here")            # the report's figure
    assert (tmp_path / "quant.png").stat().st_size > 0


def test_bench_quant_weights_json(checkpoint, tmp_path):
    """--weights: full-precision weights, then int8's and int4's, over a full-precision cache: about half the
    weights' bytes in bfloat16 (int8), less again (int4), and their quality against full precision."""
    ckpt = checkpoint(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                      initializer_range=0.02, max_position_embeddings=256, dtype=torch.bfloat16)
    path = tmp_path / "quant.json"
    args = ["--model", str(ckpt), "--weights", "--tokens", "120", "--context", "60", "--block-size", "16",
            "--passkey-lengths", "200", "--decode-batch", "2", "--decode-prompt", "8", "--decode-tokens", "16",
            "--repeats", "1", "--max-num-seqs", "4"]
    assert main(["bench", "quant", "--quick", "--json", str(path), *args]) == 0
    rows = {r["weights"]: r for r in json.loads(path.read_text())["rows"]}
    assert list(rows) == ["none", "int8", "int4"]
    assert all(_positive(r[key]) for r in rows.values() for key in ("weight_bytes", "perplexity"))
    assert all(measured(r["decode_tok_s"]) for r in rows.values())
    assert 0.5 < rows["int8"]["weight_bytes"] / rows["none"]["weight_bytes"] < 0.6
    assert rows["int4"]["weight_bytes"] < rows["int8"]["weight_bytes"]
    assert rows["none"]["kl"] == 0
    assert all(rows[q]["kl"] > 0 and rows[q]["top1_agreement"] > 0.5 for q in ("int8", "int4"))


def test_bench_quant_speed_json(checkpoint, tmp_path, monkeypatch):
    """--speed-only: decode tok/s at each batch and a prefill's seconds per weight format, each against the first
    row, and the GEMMs each ran (KVSERVE_GEMM=vnni: the quantized layers' own kernel where the build has it)."""
    vnni = "vnni" in gemm_kernels(torch.bfloat16)
    if vnni:
        monkeypatch.setenv("KVSERVE_GEMM", "vnni")
    ckpt = checkpoint(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, dtype=torch.bfloat16,
                      max_position_embeddings=256)
    path = tmp_path / "speed.json"
    args = ["--model", str(ckpt), "--weights", "--speed-only", "--decode-batches", "1,3", "--prefill-batch", "2",
            "--decode-prompt", "8", "--decode-tokens", "4", "--repeats", "1"]
    assert main(["bench", "quant", "--json", str(path), *args]) == 0
    res = json.loads(path.read_text())
    rows = res["rows"]
    assert list(rows) == ["none", "int8", "int4"] and res["prefill_batch"] == 2
    for name, r in rows.items():
        assert list(r["decode_tok_s"]) == ["1", "3"] and all(measured(v) for v in r["decode_tok_s"].values())
        assert measured(r["prefill_s"]) and r["gemm"].startswith("gemm: ")
        assert ("vnni from 1" in r["gemm"]) == vnni, name
    assert rows["none"]["prefill_ratio"] == 1 and set(rows["none"]["decode_ratio"].values()) == {1}


def test_bench_eviction_json(checkpoint, tmp_path):
    ckpt = checkpoint(initializer_range=0.02, max_position_embeddings=192)
    path = tmp_path / "eviction.json"
    args = ["--model", str(ckpt), "--block-size", "8", "--budgets", "0.5", "--decode-batch", "1",
            "--decode-tokens", "16", "--repeats", "1"]
    assert main(["bench", "eviction", "--quick", "--json", str(path), *args]) == 0
    res = json.loads(path.read_text())
    rows = {(r["policy"], r["budget"]): r for r in res["rows"]}
    assert set(rows) == {("full", 1.0), ("recompute", 0.5), ("window", 0.5), ("sink", 0.5), ("h2o", 0.5),
                         ("h2o-sum", 0.5), ("snapkv", 0.5)}
    assert res["text_tokens"] == 2 * 192 + 1
    assert rows["sink", 0.5]["worst_over_recompute"] > -1
    for key, r in rows.items():
        if key[0] == "recompute":
            assert r["passkey_acc"] is None and r["decode_tok_s"] is None
        else:
            assert 0 <= r["passkey_acc"] <= 1 and measured(r["decode_tok_s"]), key
        if key[0] != "snapkv":
            assert _positive(r["perplexity"]) and len(r["segments"]) == 2
            assert _positive(r["peak_kv_bytes"]) or key[0] == "recompute"
    # a budget of half the context holds less than the whole text
    assert rows["sink", 0.5]["peak_kv_bytes"] < rows["full", 1.0]["peak_kv_bytes"] / 2
    plot_eviction(res, tmp_path / "eviction.png", "here")      # the report's figure
    assert (tmp_path / "eviction.png").stat().st_size > 0


def test_the_gpu_check_script_runs_dry_on_the_cpu(tmp_path):
    # the one-call GPU check, with tiny shapes and Triton's interpreter: its plumbing must work before
    # a run on a GPU spends device time on it
    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"
    run = subprocess.run(["bash", str(script)], env={**os.environ, "OUT": str(tmp_path), "GPU_CHECK_DRY": "1"},
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:]
    summary = (tmp_path / "summary.txt").read_text()
    assert [line.split(":")[0] for line in summary.splitlines()] == ["kernels", "attention", "throughput"]
    assert measured(json.loads((tmp_path / "throughput.json").read_text())["float32"]["ours_tok_s"])
    assert json.loads((tmp_path / "attention.json").read_text())["rows"]


def test_recomputed_window_losses_cover_the_text_and_equal_the_full_cache_when_it_fits(checkpoint):
    from kvserve import LLM
    from kvserve.bench.eviction import recomputed_nll, streamed_nll
    ckpt = checkpoint(max_position_embeddings=64)
    ids = torch.randint(3, 384, (50,), generator=torch.Generator().manual_seed(0)).tolist()
    llm = LLM(str(ckpt), block_size=4, enable_prefix_caching=False)
    full, _ = streamed_nll(llm, ids)
    assert recomputed_nll(llm, ids, 64) == pytest.approx(full, abs=1e-4)
    short = recomputed_nll(llm, ids, 16)
    assert len(short) == len(ids) - 1 and short[:14] == pytest.approx(full[:14], abs=1e-4)   # windows from 0
    assert short[20:] != pytest.approx(full[20:], abs=1e-4)     # a window of 16 forgets the rest


def test_bench_capacity_hybrid_model_shape(tmp_path):
    """Gemma 3 1B's KV layout under one budget of one full context: kept whole, one 2048-token request runs at a
    time past its prompt; with the hybrid cache (a sliding group holding its window of 512 and a chunk of 128) both
    at once."""
    path = tmp_path / "capacity.json"
    args = ["--model-shape", "gemma3-1b", "--requests", "3", "--contexts", "1", "--max-model-len", "96",
            "--prompt-median", "20", "--output-median", "4", "--long-context", "2048", "--long-output", "2",
            "--long-requests", "2", "--long-prefill-token-threshold", "128", "--hidden-size", "32",
            "--intermediate-size", "64", "--vocab-size", "512"]
    assert main(["bench", "capacity", "--quick", "--json", str(path), *args]) == 0
    res = json.loads(path.read_text())
    long = res["long"]
    assert long["all_global"]["peak_decoding"] == 1 and long["hybrid"]["peak_decoding"] >= 2
    assert long["kv_budget_bytes"] == 2048 * 26 * 2 * 256 * 4
    for mode in ("all_global", "hybrid"):
        assert long[mode]["generated_tokens"] == 2 * 2 and res["mix"][mode]["generated_tokens"] > 0
        assert long[mode]["kv_cache_bytes"] <= long["kv_budget_bytes"]      # the null block within the budget


def test_bench_structured_json(tmp_path):
    path = tmp_path / "structured.json"
    args = ["--batches", "1,3", "--tokens", "6", "--repeats", "1", "--prompt-len", "8", *TINY]
    assert main(["bench", "structured", "--quick", "--json", str(path), *args]) == 0
    res = json.loads(path.read_text())
    assert [r["batch"] for r in res["results"]] == [1, 3] and res["tokens"] == 6
    for r in res["results"]:
        assert all(measured(x) for x in r["free_tokens_per_s"] + r["schema_tokens_per_s"])
        assert r["ratio_of_medians"] == pytest.approx(statistics.median(r["schema_tokens_per_s"])
                                                      / statistics.median(r["free_tokens_per_s"]))
        # every constrained sequence's mask of every timed step, computed while the model ran
        assert r["masks_per_step"] == r["batch"]
        assert measured(r["mask_fill_ms_per_step"]) and measured(r["mask_wait_ms_per_step"])


def test_bench_sparse_json(tmp_path):
    """bench sparse on a tiny checkpoint: its quality rows (dense first, Quest, the eviction policies at the same
    budget) and its speed rows (dense and Quest step times of the C step, side by side)."""
    from tiny_models import make_checkpoint as tiny_checkpoint

    ckpt = tiny_checkpoint(tmp_path / "m", initializer_range=0.02, max_position_embeddings=192)
    path = tmp_path / "sparse.json"
    shape = ["--hidden-size", "64", "--intermediate-size", "128", "--num-layers", "2", "--num-heads", "4",
             "--num-kv-heads", "2", "--vocab-size", "384"]
    args = ["--model", str(ckpt), "--block-size", "8", "--passkey-trials", "1", "--texts", "1", "--prefill", "64",
            "--contexts", "256", "--batches", "1,2", "--repeats", "1", *shape]
    assert main(["bench", "sparse", "--quick", "--json", str(path), *args]) == 0
    res = json.loads(path.read_text())
    quality = {r["policy"]: r for r in res["quality"]["rows"]}
    assert list(quality) == ["dense", "quest (dense_layers=2)", "quest (dense_layers=0)", "sink", "h2o", "snapkv"]
    assert quality["dense"]["kl"] == 0 and res["quality"]["budget"] == 24
    for name, r in quality.items():
        assert 0 <= r["passkey"] <= 1 and _positive(r["perplexity"]), name
        assert ("mass_share" in r) == name.startswith("quest")
    # two layers: dense_layers=2 reads every block, and selects in none
    assert quality["quest (dense_layers=2)"]["blocks_read"] == 1 and quality["quest (dense_layers=2)"]["kl"] == 0
    assert 0 < quality["quest (dense_layers=0)"]["mass_share"] <= 1
    assert 0 < quality["quest (dense_layers=0)"]["blocks_read"] < 1
    speed = res["speed"]["rows"]
    assert [(r["context"], r["batch"], r["layers"]) for r in speed] == [(256, 1, 2), (256, 2, 2)]
    assert all(measured(r["dense_ms"]) and measured(r["quest_ms"]) and r["kv_read_ratio"] > 1 for r in speed)
