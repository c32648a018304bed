"""Property: whatever drafts are right or wrong, speculative decoding leaves the KV cache as plain decoding of the same
tokens leaves it: after every step each sequence's block tables hold exactly its verified tokens' blocks (a sliding
group's window released as far as plain decoding releases it), its prefix keys are its verified tokens', no block
leaks; at the end the prefix cache and the second tier hold verified blocks only, each with plain decoding's bytes."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.kv.blocks import BlockKey, block_key
from spec_oracle import NGRAM, generate_ids, with_oracle

WINDOW = 6


@pytest.fixture(scope="module")
def models(checkpoint):
    """A Llama, and a Gemma 2 of a sliding layer (window 6) and a global one: two layer groups."""
    return {"llama": checkpoint("llama", max_position_embeddings=128),
            "gemma2": checkpoint("gemma2", sliding_window=WINDOW, head_dim=16,
                                 max_position_embeddings=128)}


# each case: its model and engine options (the tier's path is filled in per example)
CASES = {
    "full": ("llama", {}),
    "int8 pages": ("llama", {"kv_cache_dtype": "int8"}),
    "hybrid": ("gemma2", {}),
    "sink": ("llama", {"eviction": "sink:sinks=2,window=12"}),
    "hybrid sink": ("gemma2", {"eviction": f"sink:sinks=2,window={WINDOW + 4}"}),
    "disk tier": ("llama", {"kv_offload": "disk:{}", "kv_offload_size": "4MiB"}),
}


def _keys(tokens: list[int], block_size: int) -> list:
    """The prefix keys of the full blocks of `tokens`."""
    keys, parent = [], None
    for i in range(len(tokens) // block_size):
        keys.append(block_key(parent, tuple(tokens[i * block_size:(i + 1) * block_size]), None))
        parent = keys[-1].hash
    return keys


def _check_running(engine, k: int) -> None:
    """Each running sequence's tables hold its verified tokens' blocks alone (and its sliding groups' null entries
    where plain decoding releases them); its indexed keys are its verified tokens'."""
    kv, bs = engine.kv, engine.kv.block_size
    for seq in engine.scheduler.running:
        in_cache = seq.num_tokens_in_cache
        assert seq.num_computed_tokens < seq.num_tokens and len(seq.spec_token_ids) <= k
        for group, table in zip(kv.layer_groups, kv.group_tables(seq.seq_id)):
            assert len(table) == kv.blocks_for(in_cache), (seq.seq_id, table, in_cache)
            if group.sliding_window is not None and not seq.num_evicted_tokens:
                released = min(len(table), max(0, in_cache - group.sliding_window + 1) // bs)
                assert table[:released] == [kv.null_block] * released
                assert kv.null_block not in table[released:]
        if not seq.num_evicted_tokens:
            assert seq.num_indexed_blocks <= seq.num_computed_tokens // bs
            assert seq.block_keys[:seq.num_indexed_blocks] == \
                _keys(seq.token_ids, bs)[:seq.num_indexed_blocks]


def _cached_pages(llm, verified: dict) -> dict:
    """The K/V (decoded) of every block in the pool's prefix index and in the second tier, by hash; every one of them
    is one of the `verified` blocks (by hash: their keys). A tier's block is decoded from a free block of the pool
    that holds no prefix, written with its bytes."""
    engine = llm.engine
    pool, storage = engine.kv.pool, engine.storage
    blocks = {pool.keys[b].hash: b for b in pool.indexed_blocks()}
    assert blocks.keys() <= verified.keys()
    tier = getattr(engine.connector, "tier", None)
    if tier is not None:
        tier.flush()
        held = {h: tier.get(key) for h, key in verified.items() if tier.has(h)}
        assert len(held) == tier.num_blocks
        scratch = [b for b in range(pool.num_blocks) if not pool.ref_counts[b] and pool.keys[b] is None]
        for (h, data), b in zip([(h, d) for h, d in held.items() if h not in blocks], scratch):
            storage.write_blocks([b], data[None])
            blocks[h] = b
    layers = [group.layers for group in engine.kv.layer_groups]
    return {h: torch.cat([storage.layer(i).gather(torch.tensor([b])).float().flatten()
                          for i in layers[BlockKey.group_of(h)]]) for h, b in blocks.items()}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(sorted(CASES)), block_size=st.integers(2, 6), common=st.integers(0, 10),
       tails=st.lists(st.integers(1, 14), min_size=1, max_size=6), max_tokens=st.integers(4, 20),
       n=st.sampled_from([1, 1, 2]), miss=st.sampled_from([0.0, 0.2, 0.5, 0.8]), k=st.integers(1, 5),
       seed=st.integers(0, 2**16), spare_blocks=st.integers(0, 8))
# and cases that surely preempt, evict, and write blocks to the tier
@example("disk tier", 3, 6, [8, 3, 2, 12, 5, 9], 16, 2, 0.2, 3, 48, 0)
@example("hybrid", 3, 10, [14, 6, 11, 2, 9], 20, 2, 0.2, 4, 11, 0)
@example("int8 pages", 2, 4, [14, 14, 14, 14], 20, 1, 0.2, 5, 3, 0)
@example("hybrid sink", 4, 2, [10, 12, 9, 11], 20, 2, 0.5, 4, 7, 0)
def test_speculation_leaves_the_cache_plain_decoding_leaves(models, tmp_path_factory, case, block_size, common,
                                                            tails, max_tokens, n, miss, k, seed, spare_blocks):
    model, options = CASES[case]
    prompts = [list(range(5, 5 + common)) + [100 + 7 * i + j for j in range(t)] for i, t in enumerate(tails)]
    params = [SamplingParams(n=n if i == 0 else 1, max_tokens=max_tokens, temperature=0, ignore_eos=True)
              for i in range(len(prompts))]
    # room for the longest request in each layer group (and the null block), and a few blocks more: the others wait
    # or are preempted; under eviction room for all at once, as a preempted sequence's recomputation in prompt chunks
    # evicts other blocks than its decode steps did (plain decoding's tokens then depend on where it was preempted)
    blocks = [-(-(len(p) + max_tokens + k) // block_size) for p in prompts]
    room = sum(blocks) + n * max(blocks) if "eviction" in options else max(blocks) + spare_blocks
    kw = dict(block_size=block_size, num_kv_blocks=2 * room + 2, max_num_seqs=3, long_prefill_token_threshold=8)

    def engine_options() -> dict:
        return {name: value.format(tmp_path_factory.mktemp("tier")) if name == "kv_offload" else value
                for name, value in options.items()}

    plain = LLM(str(models[model]), **kw, **engine_options())
    reference = generate_ids(plain, prompts, params)
    assert "eviction" not in options or plain.stats()["num_preemptions"] == 0
    llm = LLM(str(models[model]), speculative_config={**NGRAM, "num_speculative_tokens": k}, **kw,
              **engine_options())
    with_oracle(llm, prompts, reference, miss, seed)
    engine, outputs = llm.engine, {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, p, final_only=True)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[int(out.request_id)] = [c.token_ids for c in out.outputs]
        engine.kv.check_invariants()
        _check_running(engine, k)
    assert [outputs[i] for i in range(len(prompts))] == reference
    assert engine.kv.num_free_blocks == engine.kv.num_usable_blocks
    # the cache holds verified blocks alone, with plain decoding's bytes
    verified = {key.in_group(g).hash: key.in_group(g) for prompt, samples in zip(prompts, reference)
                for sample in samples for key in _keys(prompt + sample, block_size)
                for g in range(len(engine.kv.layer_groups))}
    spec_pages, plain_pages = _cached_pages(llm, verified), _cached_pages(plain, verified)
    for block_hash in spec_pages.keys() & plain_pages.keys():
        # the same numbers up to the order of the sums (a token computed by the C step in one engine, op by op in
        # the other), within a step of the quantized formats' grids
        ours, theirs = spec_pages[block_hash], plain_pages[block_hash]
        torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-2 * float(theirs.abs().max()) + 1e-5)
