"""The GEMM chosen by measurement (model/gemm_choice.py): the rule, the cache, and each choice forced."""
from __future__ import annotations

import logging
import shutil

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model import gemm_choice, layers
from kvserve.model.gemm_choice import DECODE_ROWS, GEMM_ENV, ROWS, Shape, amx_threshold, decide
from kvserve.model.layers import NEVER, Linear
from timings import measured

pytestmark = pytest.mark.skipif(shutil.which("cc") is None or not layers.gemm_packs(torch.bfloat16),
                                reason="csrc/gemm.c does not multiply bfloat16 here")
AMX = "amx" in layers.gemm_kernels(torch.bfloat16)
VECTOR = layers.vector_kernel(layers.gemm_kernels(torch.bfloat16))      # the build's own tiles: avx512 or avx2


def _timings(avx512: list[float], amx: list[float], onednn: list[float]) -> dict[int, dict[str, float]]:
    return {m: {"avx512": a, "amx": b, "onednn": c} for m, a, b, c in zip(ROWS, avx512, amx, onednn)}


def test_amx_runs_from_the_rows_where_it_wins_at_every_larger_count():
    assert ROWS == (1, 4, 8, 16, 64, 512)
    slow = [9.0] * 6
    assert amx_threshold(_timings([2, 2, 4, 8, 32, 256], [3, 3, 3, 3, 5, 30], slow)) == 8
    assert amx_threshold(_timings([1] * 6, [0.5] * 6, slow)) == 1
    # faster at 16 and 64 rows but not at 512: a kernel that loses at a larger count is not taken below it
    assert amx_threshold(_timings([2, 2, 4, 8, 32, 256], [3, 3, 3, 3, 5, 300], slow)) == NEVER
    assert amx_threshold({m: {"avx512": 1.0} for m in ROWS}) == NEVER       # not measured: no AMX here


def test_the_format_is_the_one_faster_at_decode_rows():
    shapes = [Shape("qkv_proj", 64, 32, False, 2), Shape("lm_head", 96, 32, False, 1)]
    fast_gemm = _timings([1, 1, 1, 1, 1, 100], [2, 2, 2, 2, 2, 100], [3, 3, 3, 3, 3, 1])
    choice = decide(shapes, {"qkv_proj": fast_gemm, "lm_head": fast_gemm}, "measured")
    # faster per row at 1..64 rows: csrc/gemm.c packs, though oneDNN would win a prefill
    assert choice.weight_format == "gemm" and choice.amx_from == {"qkv_proj": NEVER, "lm_head": NEVER}
    assert choice.per_row(DECODE_ROWS)["gemm"] == pytest.approx(3 * sum(1 / m for m in DECODE_ROWS))
    fast_onednn = _timings([4, 4, 4, 4, 4, 9], [5, 5, 5, 5, 1, 1], [1, 1, 1, 1, 1, 1])
    choice = decide(shapes, {"qkv_proj": fast_onednn, "lm_head": fast_gemm}, "measured")
    assert choice.weight_format == "onednn" and choice.amx_from["qkv_proj"] == 64
    # faster, but by less than the margin the native step is worth: csrc/gemm.c
    close = _timings([1] * 6, [2] * 6, [1 / (0.99 * gemm_choice.ONEDNN_MARGIN)] * 6)
    assert decide(shapes, {"qkv_proj": close, "lm_head": close}, "measured").weight_format == "gemm"


def test_the_choice_is_measured_once_then_read_from_the_cache(checkpoint, tmp_path, monkeypatch):
    # a cache of its own (not all of $KVSERVE_CACHE: the kernels would be built again there)
    monkeypatch.setattr(gemm_choice, "cache_dirs", lambda what: [tmp_path / "cache" / what])
    monkeypatch.setenv(GEMM_ENV, "measure")
    monkeypatch.setattr(gemm_choice, "_BUDGET", 0.0)         # the fewest runs: what is chosen is not tested here
    path = checkpoint("llama", dtype=torch.bfloat16, tie_word_embeddings=True)
    llm = LLM(str(path), block_size=4, num_kv_blocks=16, dtype="bfloat16")
    report = llm.stats()["gemm"]
    assert report["source"] == "measured"
    names = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"]
    candidates = {VECTOR, "onednn", *(["amx"] if AMX else [])}
    assert list(report["seconds"]) == names
    for name in names:
        by_rows = report["seconds"][name]
        assert list(by_rows) == [str(m) for m in ROWS] and all(set(t) == candidates for t in by_rows.values())
        assert all(measured(s) for t in by_rows.values() for s in t.values())
        threshold = amx_threshold({int(m): t for m, t in by_rows.items()})
        assert report["amx_from"][name] == (None if threshold == NEVER else threshold)
    per_row = report["decode_s_per_row"]
    assert report["weight_format"] == ("onednn" if per_row["onednn"] * gemm_choice.ONEDNN_MARGIN < per_row["gemm"]
                                       else "gemm")
    model = llm.engine.model
    for name, m in model.named_modules():
        if isinstance(m, Linear):
            expected = report["amx_from"][name.rsplit(".", 1)[-1]] if m.own_gemm else None
            assert (None if m.amx_from == NEVER else m.amx_from) == expected, name

    def measure(*args):
        raise AssertionError("measured again")

    monkeypatch.setattr(gemm_choice, "time_shape", measure)
    again = LLM(str(path), block_size=4, num_kv_blocks=16, dtype="bfloat16").stats()["gemm"]
    assert again["source"] == "cached" and again["seconds"] == report["seconds"]


def test_each_forced_choice_gives_the_same_tokens(checkpoint, monkeypatch, caplog):
    """csrc/gemm.c by AVX-512 or AMX at every row count, or oneDNN's GEMM (and no native step, which reads only
    csrc/gemm.c's panels): the same greedy tokens, prefill and decode; the log says which was forced."""
    path = checkpoint("llama", dtype=torch.bfloat16, hidden_size=128, intermediate_size=256)
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + 3 * i))} for i in range(5)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = {}
    for forced in (VECTOR, "onednn", *(["amx"] if AMX else [])):
        monkeypatch.setenv(GEMM_ENV, forced)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=gemm_choice.__name__):
            llm = LLM(str(path), block_size=4, num_kv_blocks=128, dtype="bfloat16", num_scheduler_steps=1)
        packed = "oneDNN" if forced == "onednn" else "csrc/gemm.c"
        assert f"GEMMs: weights packed for {packed} ({GEMM_ENV}={forced})" in caplog.text
        report = llm.stats()["gemm"]
        assert report["source"] == f"{GEMM_ENV}={forced}"
        assert report["weight_format"] == ("onednn" if forced == "onednn" else "gemm")
        down = llm.engine.model.model.layers[0].mlp.down_proj
        assert down.amx_from == (1 if forced == "amx" else NEVER)
        outs[forced] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        steps = llm.stats()["steps"]
        assert (steps.get("native", 0) > 0) == (forced != "onednn")
    assert all(tokens == outs[VECTOR] for tokens in outs.values())


def test_a_forced_choice_this_cpu_cannot_run_is_an_error(checkpoint, monkeypatch):
    path = checkpoint("llama", dtype=torch.bfloat16)
    monkeypatch.setenv(GEMM_ENV, "fastest")
    with pytest.raises(ValueError, match=f"{GEMM_ENV} must be one of measure, avx512, amx, onednn"):
        LLM(str(path), num_kv_blocks=8)
    monkeypatch.setenv(GEMM_ENV, "amx")
    monkeypatch.setattr(gemm_choice, "gemm_kernels", lambda dtype: ("avx512",))
    with pytest.raises(ValueError, match=f"{GEMM_ENV}=amx: csrc/gemm.c has no amx kernel"):
        LLM(str(path), num_kv_blocks=8)
