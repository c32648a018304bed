"""Incremental detokenization: text grows by whole characters as tokens arrive."""
from __future__ import annotations

from collections.abc import Callable

from tokenizers.decoders import DecodeStream

from kvserve.engine.sequence import Sequence

Decode = Callable[..., str]     # (token ids, skip_special_tokens=...) -> text


class Detokenizer:
    """Appends each new token's text to its sequence's output_text.

    With a fast tokenizer that does not clean up spaces (whose decode is then the Rust tokenizer's),
    each sequence keeps a `tokenizers` DecodeStream, one Rust call a token, which costs less than
    decoding two windows of tokens per sequence, which the others do.
    Either way a token is decoded in the context of the ones before it, starting inside the prompt so
    that tokenizers that strip a leading space keep the first output token's space, and text ending in
    U+FFFD waits for the rest of a multi-byte character. With no tokenizer (skip_tokenizer_init) there is
    no text: output_text stays "".
    A request with skip_special_tokens=False and spaces_between_special_tokens=False gets an added token that
    follows another output added token as its bare text, without the space a decoder may put before it (vLLM's
    fast detokenizer; the windows' decode takes no such option).
    """

    def __init__(self, tokenizer):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.stream_of = None if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False) \
            else backend
        self.decode = None if tokenizer is None else tokenizer.decode
        # a DecodeStream takes any number of new tokens with the same result: text that is not needed until
        # a request ends can wait for it (the windows wait while a character is incomplete, so not those)
        self.deferrable = self.stream_of is not None or tokenizer is None
        self.added = {} if self.stream_of is None else {
            i: t.content for i, t in self.stream_of.get_added_tokens_decoder().items()}

    def __call__(self, seq: Sequence, end: int | None = None) -> str:
        """The text of seq's tokens since the last call (maybe empty, until a character is whole), appended to
        output_text; `end`: the tokens before it only (DecodeStream)."""
        if self.decode is None:
            return ""
        if self.stream_of is None:
            return detokenize_step(self.decode, seq)
        # read_offset: the tokens the stream has taken
        end = len(seq.token_ids) if end is None else end
        ids = seq.token_ids[seq.read_offset:end]
        delta = None
        if seq.detokenize_stream is None and len(ids) > 1 and not self._joins_added(seq):
            # a deferred text: all its tokens in one Rust call, not one call a token
            delta = self._stream(seq).step(self.stream_of, ids)
            if delta is None:
                # it ends inside a character: token by token keeps the text before that character
                seq.detokenize_stream = None
        if delta is None:
            stream = seq.detokenize_stream or self._stream(seq)
            delta = "".join(filter(None, (self._step(seq, stream, i) for i in range(seq.read_offset, end))))
        seq.read_offset = end
        seq.output_text += delta
        return delta

    def _step(self, seq: Sequence, stream: DecodeStream, index: int) -> str | None:
        """The text of token `index` of seq, through its stream."""
        token = seq.token_ids[index]
        text = stream.step(self.stream_of, token)
        if (self._joins_added(seq) and token in self.added and index > seq.num_prompt_tokens
                and seq.token_ids[index - 1] in self.added):
            return self.added[token]
        return text

    def _joins_added(self, seq: Sequence) -> bool:
        p = seq.params
        return bool(self.added) and not (p.skip_special_tokens or p.spaces_between_special_tokens)

    def _stream(self, seq: Sequence) -> DecodeStream:
        """A new DecodeStream for seq, fed the prompt's last tokens as context."""
        stream = seq.detokenize_stream = DecodeStream(skip_special_tokens=seq.params.skip_special_tokens)
        for token in seq.token_ids[seq.prefix_offset:seq.read_offset]:
            stream.step(self.stream_of, token)
        return stream


def detokenize_step(decode: Decode, seq: Sequence) -> str:
    """Append the text of the newest tokens to seq.output_text; returns the new text (maybe empty).

    Decoding a short window (prefix_offset..) rather than the whole output keeps a step O(1).
    """
    ids = seq.token_ids
    skip = seq.params.skip_special_tokens
    prefix = decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip)
    full = decode(ids[seq.prefix_offset:], skip_special_tokens=skip)
    if len(full) <= len(prefix) or full.endswith("\ufffd"):
        return ""
    delta = full[len(prefix):]
    seq.output_text += delta
    seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
    return delta
