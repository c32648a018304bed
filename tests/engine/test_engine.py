"""The engine: continuous batching equals running alone, in every cache mode, under preemption."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import SchedulerConfig
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.sequence import Sequence
from kvserve.kv import KVCacheManager, NoKVCache
from kvserve.sampling import Logprob

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("llama", max_position_embeddings=128)


def mixed_prompts(n: int = 9) -> list[dict]:
    g = torch.Generator().manual_seed(7)
    lens = [1, 2, 3, 4, 5, 8, 13, 17, 31, 2, 9, 20][:n]
    return [{"prompt_token_ids": torch.randint(3, 384, (k,), generator=g).tolist()} for k in lens]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def alone(ckpt) -> list[list[int]]:
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=64, max_num_seqs=1)
    return [tokens(llm.generate(p, GREEDY, use_tqdm=False))[0] for p in mixed_prompts()]


@pytest.mark.parametrize("kwargs", [
    dict(cache_mode="paged"),
    dict(cache_mode="paged", attention_backend="textbook"),
    dict(cache_mode="paged", attention_backend="flash"),
    dict(cache_mode="paged", attention_backend="native"),
    dict(cache_mode="none", attention_backend="flash"),
    dict(cache_mode="paged", attention_backend="triton", max_num_batched_tokens=16),   # (its interpreter is slow)
    dict(cache_mode="contiguous", max_model_len=64),
    dict(cache_mode="none"),
    dict(cache_mode="none", attention_backend="textbook"),
    dict(cache_mode="paged", max_num_batched_tokens=7),          # chunked prefill, splitting blocks
    dict(cache_mode="paged", max_num_batched_tokens=7, attention_backend="textbook"),
    dict(cache_mode="paged", max_num_batched_tokens=7, attention_backend="flash"),
    dict(cache_mode="paged", max_num_batched_tokens=7, attention_backend="native"),
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_batched_equals_alone(ckpt, alone, kwargs):
    if kwargs.get("attention_backend") == "triton":
        pytest.importorskip("triton")
    kwargs = {"block_size": 4, "num_kv_blocks": 64, **kwargs}
    llm = LLM(str(ckpt), **kwargs)
    assert tokens(llm.generate(mixed_prompts(), GREEDY, use_tqdm=False)) == alone
    stats = llm.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_with_no_cache_a_sequence_is_computed_whole_or_waits_and_nothing_stays_computed():
    """cache_mode none's scheduling: no prompt chunks (long_prefill_token_threshold does not apply), a sequence
    that does not fit what is left of the budget waits, and every step computes each sequence from its start."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=10, max_model_len=10,
                             long_prefill_token_threshold=2)
    sched = Scheduler(config, NoKVCache(2))
    a, b = (Sequence(i, str(i), None, list(range(3, 3 + n)), SamplingParams(), 4, 0.0) for i, n in enumerate((6, 5)))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert out.seqs == [a] and out.num_new_tokens == [6] and out.num_decodes == 0 and list(sched.waiting) == [b]
    sched.commit(out)
    assert a.num_computed_tokens == 0
    a.token_ids.append(7)
    out = sched.schedule()
    assert out.seqs == [a] and out.num_new_tokens == [7] and out.num_decodes == 0 and list(sched.waiting) == [b]
    sched.finish(a, "stop")
    assert sched.schedule().num_new_tokens == [5]


def test_a_fork_runs_beside_its_parent_over_shared_blocks_with_its_own_lists():
    """Sequence.fork copies the request's state but not its lists: what one sample appends (tokens, block keys,
    logprobs) the other does not see, and the child starts its own detokenizer stream; Scheduler.fork runs it
    over the parent's blocks."""
    kv = KVCacheManager(8, 2)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=16), kv)
    parent = Sequence(0, "r", None, [3, 4, 5, 6, 7], SamplingParams(n=2, logprobs=1), 4, 0.0)
    sched.add(parent)
    sched.commit(sched.schedule())
    parent.full_block_keys(2, 5)
    parent.detokenize_stream = object()
    child = parent.fork(1, torch.Generator())
    sched.fork(parent, child)
    assert sched.running == [parent, child] and kv.block_tables[1] == kv.block_tables[0]
    assert all(kv.pool.ref_counts[b] == 2 for b in kv.block_tables[0])
    child.token_ids.append(9)
    child.logprobs.append({9: Logprob(-0.5, 1)})
    child.full_block_keys(2, 6)
    assert parent.token_ids == [3, 4, 5, 6, 7] and parent.logprobs == [] and len(parent.block_keys) == 2
    assert (child.seq_id, child.request_id, child.num_computed_tokens) == (1, "r", 5)
    assert child.detokenize_stream is None and parent.detokenize_stream is not None


def test_preemption_keeps_tokens_and_frees_everything(ckpt, alone):
    # 12 blocks of 4 tokens: the longest request (31 + 10 tokens) needs 11 of them alone.
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=12)
    outs = llm.generate(mixed_prompts(), GREEDY, use_tqdm=False)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert tokens(outs) == alone
    assert stats["kv_blocks_free"] == 12


def test_contiguous_reserves_max_model_len(ckpt):
    llm = LLM(str(ckpt), cache_mode="contiguous", max_model_len=64, num_kv_blocks=3)
    engine = llm.engine
    for i in range(5):
        engine.add_request(str(i), {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4))
    engine.step()
    stats = llm.stats()
    assert stats["kv_block_size"] == 64
    assert stats["num_running"] == 3 and stats["num_waiting"] == 2 and stats["kv_blocks_free"] == 0


def test_paged_admits_while_blocks_are_free_and_returns_them(ckpt):
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=40)
    engine = llm.engine
    for i in range(3):
        engine.add_request(str(i), {"prompt_token_ids": list(range(3 + i, 12 + i))}, SamplingParams(max_tokens=20))
    engine.step()
    assert llm.stats()["kv_blocks_free"] == 40 - 3 * 3
    engine.abort_request("1")
    assert llm.stats()["kv_blocks_free"] == 40 - 2 * 3
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.stats()["kv_blocks_free"] == 40


def test_impossible_requests_are_rejected_and_others_still_served(ckpt):
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=8, max_model_len=64)
    with pytest.raises(ValueError, match=r"exceeds max_model_len \(64\)"):
        llm.generate({"prompt_token_ids": [5] * 60}, SamplingParams(max_tokens=10), use_tqdm=False)
    with pytest.raises(ValueError, match="needs 10 KV blocks of 4 tokens; the whole pool has 8"):
        llm.generate({"prompt_token_ids": [5] * 30}, SamplingParams(max_tokens=10), use_tqdm=False)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate({"prompt_token_ids": [5, 100000]}, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    out = llm.generate({"prompt_token_ids": [5, 6]}, GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 10
    assert llm.stats()["kv_blocks_free"] == 8


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-1), "max_tokens"),
    (dict(temperature=-0.5), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(min_p=2), "min_p"), (dict(logprobs=-1), "logprobs"),
])
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, text", [
    (dict(cache_mode="virtual"), "cache_mode"), (dict(attention_backend="magic"), "attention_backend"),
    (dict(dtype="int3"), "dtype"), (dict(block_size=0), "block_size"),
    (dict(kv_cache_memory="lots"), "memory size"), (dict(max_model_len=100000), "max_model_len"),
    (dict(num_scheduler_steps=0), "num_scheduler_steps"),
])
def test_invalid_engine_options(ckpt, kwargs, text):
    with pytest.raises(ValueError, match=text):
        LLM(str(ckpt), **kwargs)


def test_unsupported_architecture_is_named(tmp_path):
    import json
    from kvserve.config import ModelConfig
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM, MistralForCausalLM"):
        ModelConfig.from_dict({"architectures": ["GPT2LMHeadModel"]})
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"]}))
    with pytest.raises(ValueError, match="FalconForCausalLM"):
        LLM(str(tmp_path))


def test_missing_hub_model_names_the_id(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="'nobody/no-such-model' is not in the local Hugging Face cache"):
        LLM("nobody/no-such-model")


def test_kv_cache_memory_sizes_the_pool(ckpt):
    llm = LLM(str(ckpt), block_size=16, kv_cache_memory="1MiB")
    per_token = 2 * 2 * 2 * 16 * 4           # layers x (K, V) x kv_heads x head_dim x fp32
    assert llm.stats()["kv_bytes_per_token"] == per_token
    assert llm.stats()["kv_blocks_total"] == 2**20 // (16 * per_token)


def test_stats_keys(ckpt):
    stats = LLM(str(ckpt), num_kv_blocks=8).stats()
    for key in ("kv_blocks_total", "kv_blocks_free", "kv_block_size", "kv_bytes_per_token",
                "num_running", "num_waiting", "num_preemptions"):
        assert key in stats


def test_final_only_text_is_the_streamed_text(ckpt):
    """A final-only request's text waits for its end (a DecodeStream takes the tokens at once): the same
    text as streamed token by token, without the stop token that ended it."""
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=256)
    engine, prompts = llm.engine, mixed_prompts(6)

    def streamed(params):
        for i, p in enumerate(prompts):
            engine.add_request(f"s{i}", p, params)
        done = {}
        while engine.has_unfinished_requests():
            done |= {o.request_id: o for o in engine.step() if o.finished}
        return [done[f"s{i}"] for i in range(len(prompts))]

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, n=2, seed=0)
    first = streamed(params)
    decodable = [t for o in first for t in o.outputs[0].token_ids
                 if (text := llm.get_tokenizer().decode([t])).strip() and text.isascii()]
    stop = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=decodable[:1],
                          skip_special_tokens=False)
    for params, ref in ((params, first), (stop, streamed(stop))):
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [[c.text for c in o.outputs] for o in outs] == [[c.text for c in o.outputs] for o in ref]
        assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in ref]
    assert any(c.text for o in first for c in o.outputs)
    assert any(o.outputs[0].finish_reason == "stop" and o.outputs[0].token_ids[-1] == decodable[0] for o in ref)


def test_final_only_requests_are_reported_once_finished(ckpt):
    """As vLLM's FINAL_ONLY output kind: LLM.generate's requests; the others at every step they gain a token."""
    engine = LLM(str(ckpt), block_size=4, num_kv_blocks=64).engine
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine.add_request("final", {"prompt_token_ids": [5, 6, 7]}, params, final_only=True)
    engine.add_request("stream", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, n=2, temperature=0,
                                                                                  ignore_eos=True))
    engine.add_request("final-n", {"prompt_token_ids": [8, 9]}, SamplingParams(max_tokens=3, n=2, temperature=0,
                                                                                ignore_eos=True), final_only=True)
    reports = []
    while engine.has_unfinished_requests():
        reports += [(out.request_id, out.finished, len(out.outputs[0].token_ids)) for out in engine.step()]
    assert [r for r in reports if r[0] == "stream"] == [("stream", i == 3, i) for i in (1, 2, 3)]
    assert [r for r in reports if r[0] != "stream"] == [("final", True, 3), ("final-n", True, 3)]
    assert not engine.requests and not engine.final_only
    # an aborted one is forgotten too
    engine.add_request("gone", {"prompt_token_ids": [5]}, params, final_only=True)
    engine.abort_request("gone")
    assert not engine.final_only
