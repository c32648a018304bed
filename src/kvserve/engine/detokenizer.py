"""Incremental detokenization: text grows by whole characters as tokens arrive."""
from __future__ import annotations

from kvserve.engine.sequence import Sequence


def detokenize_step(tokenizer, seq: Sequence) -> str:
    """Append the text of the newest tokens to seq.output_text; returns the new text (maybe empty).

    Decoding a short window (prefix_offset..) rather than the whole output keeps a step O(1); the
    window starts inside the prompt so that tokenizers that strip a leading space keep the first
    output token's space; text ending in U+FFFD waits for the rest of a multi-byte character.
    """
    ids = seq.token_ids
    skip = seq.params.skip_special_tokens
    prefix = tokenizer.decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip)
    full = tokenizer.decode(ids[seq.prefix_offset:], skip_special_tokens=skip)
    if len(full) <= len(prefix) or full.endswith("\ufffd"):
        return ""
    delta = full[len(prefix):]
    seq.output_text += delta
    seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
    return delta
