"""Property: whatever drafts are right or wrong, speculative decoding leaves the KV cache as plain decoding of the same
tokens leaves it: after every step each sequence's block tables hold exactly its verified tokens' blocks (a sliding
group's window released as far as plain decoding releases it), its prefix keys are its verified tokens', no block
leaks; at the end the prefix cache and the second tier hold verified blocks only, each with plain decoding's bytes.
So too where a request's n samples fork over shared blocks (a verification's drafts copy the block they share on
write) and where a sequence is preempted with drafts pending or right after a verification rejected some (its
blocks recomputed, or swapped to the second tier and read back)."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.kv.blocks import BlockKey, block_key
from spec_oracle import NGRAM, generate_ids, with_oracle
from tiny_models import HYBRID

WINDOW = HYBRID["gemma2"]["sliding_window"]


@pytest.fixture(scope="module")
def models(tiny_llama, gemma2):
    """The suite's shared checkpoints: a Llama, and a Gemma 2 of a sliding layer and a global one (two layer
    groups)."""
    return {"llama": tiny_llama, "gemma2": gemma2}


# each case: its model and engine options (the tier's path is filled in per example)
CASES = {
    "full": ("llama", {}),
    "int8 pages": ("llama", {"kv_cache_dtype": "int8"}),
    "hybrid": ("gemma2", {}),
    "sink": ("llama", {"eviction": "sink:sinks=2,window=12"}),
    "hybrid sink": ("gemma2", {"eviction": f"sink:sinks=2,window={WINDOW + 4}"}),
    "disk tier": ("llama", {"kv_offload": "disk:{}", "kv_offload_size": "4MiB"}),
    # a preempted sequence's blocks written to the tier and read back when it resumes
    "disk tier swap": ("llama", {"kv_offload": "disk:{}", "kv_offload_size": "4MiB", "preemption_mode": "swap"}),
}


@dataclass
class Seen:
    """What a run went through: forked samples' verifications and the copies their drafts made of a shared block,
    preemptions of a sequence with drafts pending, right after a verification rejected drafts, of a forked sample,
    and those swapped to the tier."""

    forked_verifications: int = 0
    draft_copies: int = 0
    preempted_with_drafts: int = 0
    preempted_after_rollback: int = 0
    preempted_forks: int = 0
    swapped: int = 0
    rolled_back: set[int] = field(default_factory=set)   # sequences whose last verification rejected drafts


def _watch(engine) -> Seen:
    """Count in a Seen what the engine's scheduler and speculation go through (wrapping their methods)."""
    seen, scheduler, kv, speculator = Seen(), engine.scheduler, engine.kv, engine.speculator
    preempt, schedule, allocate, verify = scheduler.preempt, scheduler.schedule, kv.allocate, speculator.verify
    drafting: set[int] = set()      # sequences that reserve blocks for drafts in the step being scheduled

    def watched_preempt(seq, swap=False):
        forked = len(engine.requests[seq.request_id]) > 1
        seen.preempted_with_drafts += bool(seq.spec_token_ids)
        seen.preempted_after_rollback += seq.seq_id in seen.rolled_back
        seen.preempted_forks += forked
        seen.swapped += swap
        preempt(seq, swap)

    def watched_allocate(seq_id, num_computed, num_new):
        copies = allocate(seq_id, num_computed, num_new)
        seen.draft_copies += len(copies) * (seq_id in drafting and num_new > 1)   # a token and drafts
        return copies

    def watched_schedule():
        drafting.update(s.seq_id for s in scheduler.running if s.spec_token_ids)
        out = schedule()
        drafting.clear()
        seen.rolled_back -= {s.seq_id for s in out.seqs}     # their rollback is no longer their last step
        return out

    def watched_verify(seqs, out, masks):
        drafts = {s.seq_id: len(s.spec_token_ids) for s in seqs}
        verified, rest, logits = verify(seqs, out, masks)
        for v in verified:
            seen.forked_verifications += len(engine.requests[v.seq.request_id]) > 1
            if v.result.num_accepted < drafts[v.seq.seq_id]:
                seen.rolled_back.add(v.seq.seq_id)
        return verified, rest, logits

    scheduler.preempt, scheduler.schedule, kv.allocate = watched_preempt, watched_schedule, watched_allocate
    speculator.verify = watched_verify
    return seen


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


@dataclass(frozen=True)
class Run:
    """One run: prompts of a `common` prefix and tails of these lengths, the first (and every other one) with n
    samples; drafts of k tokens from an oracle that spoils each with probability `miss`; a pool of room for the
    longest request and spare_blocks more, so that the others wait or are preempted."""

    case: str
    block_size: int
    common: int
    tails: tuple[int, ...]
    max_tokens: int
    n: int
    miss: float
    k: int
    seed: int
    spare_blocks: int


def _run(models, tmp_path_factory, run: Run) -> tuple[Seen, dict]:
    """Decode `run` plainly and with speculation, checking the speculating engine's cache after every step and its
    cached pages at the end against plain decoding's; what the speculating engine went through, and its stats."""
    model, options = CASES[run.case]
    bs, k, max_tokens = run.block_size, run.k, run.max_tokens
    prompts = [list(range(5, 5 + run.common)) + [100 + 7 * i + j for j in range(t)] for i, t in enumerate(run.tails)]
    params = [SamplingParams(n=1 if i % 2 else run.n, max_tokens=max_tokens, temperature=0, ignore_eos=True)
              for i in range(len(prompts))]
    # room for the longest request in each layer group (and the null block), and a few blocks more: the others wait
    # or are preempted; under eviction room for all at once, as a preempted sequence's recomputation in prompt chunks
    # evicts other blocks than its decode steps did (plain decoding's tokens then depend on where it was preempted)
    blocks = [-(-(len(p) + max_tokens + k) // bs) for p in prompts]
    if "eviction" in options:
        room = max(blocks) + sum(p.n * b for p, b in zip(params, blocks))
    else:
        room = max(blocks) + run.spare_blocks
    groups = 2 if model == "gemma2" else 1
    kw = dict(block_size=bs, num_kv_blocks=groups * room + 2, max_num_seqs=3, long_prefill_token_threshold=8,
              skip_tokenizer_init=True)

    def engine_options() -> dict:
        return {name: value.format(tmp_path_factory.mktemp("tier")) if name == "kv_offload" else value
                for name, value in options.items()}

    plain = LLM(str(models[model]), **kw, **engine_options())
    reference = generate_ids(plain, prompts, params)
    assert "eviction" not in options or plain.stats()["num_preemptions"] == 0
    llm = LLM(str(models[model]), speculative_config={**NGRAM, "num_speculative_tokens": k}, **kw,
              **engine_options())
    with_oracle(llm, prompts, reference, run.miss, run.seed)
    engine, outputs = llm.engine, {}
    seen = _watch(engine)
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
                for sample in samples for key in _keys(prompt + sample, bs)
                for g in range(len(engine.kv.layer_groups))}
    spec_pages, plain_pages = _cached_pages(llm, verified), _cached_pages(plain, verified)
    for block_hash in spec_pages.keys() & plain_pages.keys():
        # the same numbers up to the order of the sums (a token computed by the C step in one engine, op by op in
        # the other), within a step of the quantized formats' grids
        ours, theirs = spec_pages[block_hash], plain_pages[block_hash]
        torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-2 * float(theirs.abs().max()) + 1e-5)
    return seen, llm.stats()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(sorted(CASES)), block_size=st.integers(2, 6), common=st.integers(0, 10),
       tails=st.lists(st.integers(1, 14), min_size=1, max_size=6).map(tuple), max_tokens=st.integers(4, 20),
       n=st.sampled_from([1, 1, 2, 3]), miss=st.sampled_from([0.0, 0.2, 0.5, 0.8]), k=st.integers(1, 5),
       seed=st.integers(0, 2**16), spare_blocks=st.integers(0, 8))
def test_speculation_leaves_the_cache_plain_decoding_leaves(models, tmp_path_factory, case, block_size, common,
                                                            tails, max_tokens, n, miss, k, seed, spare_blocks):
    _run(models, tmp_path_factory, Run(case, block_size, common, tails, max_tokens, n, miss, k, seed, spare_blocks))


FORKED = ("forked_verifications", "draft_copies")
PREEMPTED = ("preempted_with_drafts", "preempted_after_rollback", "preempted_forks")


# runs that surely go through the states named, in each case (found by drawing runs and counting what each went
# through); the property holds in each
SCENARIOS = [
    (Run("full", 3, 0, (11, 3), 8, 2, 0.2, 3, 27362, 0), FORKED + PREEMPTED),
    (Run("int8 pages", 5, 9, (8, 10), 16, 2, 0.5, 4, 9486, 1), FORKED + PREEMPTED),
    (Run("hybrid", 6, 0, (4, 5, 10, 14), 12, 3, 0.5, 2, 30937, 1), FORKED + PREEMPTED),
    (Run("disk tier", 6, 1, (9, 11), 16, 2, 0.2, 4, 35112, 1), FORKED + PREEMPTED + ("kv_offload_blocks_stored",)),
    (Run("disk tier swap", 2, 6, (3, 6, 11, 6), 13, 2, 0.5, 2, 2634, 2), FORKED + PREEMPTED + ("swapped",)),
    # three samples of a request whose drafts are accepted at different steps, each evicting at its own
    (Run("sink", 3, 8, (4, 7, 9, 6, 14), 15, 3, 0.5, 5, 748, 6), ("forked_verifications", "num_evicted_tokens")),
    (Run("hybrid sink", 4, 3, (11, 11, 4, 3), 11, 3, 0.5, 2, 47341, 1), FORKED + ("num_evicted_tokens",)),
]


@pytest.mark.parametrize("run, reached", [pytest.param(run, reached, id=run.case) for run, reached in SCENARIOS])
def test_forks_and_preemption_amid_speculation_leave_the_cache_plain_decoding_leaves(models, tmp_path_factory, run,
                                                                                     reached):
    """Forked samples verify drafts over the blocks they share (copied on write); sequences are preempted with
    drafts pending, right after a verification rejected some, forked ones among them, then recomputed (or swapped
    to the tier and read back): the cache is plain decoding's throughout."""
    seen, stats = _run(models, tmp_path_factory, run)
    counts = {**vars(seen), **stats}
    assert all(counts[name] > 0 for name in reached), {name: counts[name] for name in reached}
