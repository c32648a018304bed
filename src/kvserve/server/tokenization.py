"""The HTTP side's tokenizer: encoding, decoding and chat templates in worker threads, off the event loop."""
from __future__ import annotations

import asyncio
import codecs
import copy
import functools
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jinja2

from kvserve.server.errors import APIError
from kvserve.server.tool_calls import detect_tool_call_parser
from kvserve.text import valid_unicode

log = logging.getLogger(__name__)

# a few threads: the tokenizer's Rust code runs without the GIL, so a long text takes one thread
# for its duration while the others, and the event loop, go on
TOKENIZER_THREADS = min(4, os.cpu_count() or 1)
# the utility endpoints' (/tokenize, /detokenize, the dashboard's text) threads, apart from the requests': however
# many such calls are in flight, a completion's prompt never queues behind them
UTILITY_TOKENIZER_THREADS = max(1, TOKENIZER_THREADS // 2)


def load_chat_template(template: str | None) -> str | None:
    """--chat-template as vLLM reads it: the path of a file, else the template's own text (with
    backslash escapes such as \\n interpreted). A value with none of "{}\\n" is taken for a path
    and must exist."""
    if template is None:
        return None
    try:
        return Path(template).read_text()
    except OSError as e:
        if not any(c in template for c in "{}\n"):
            raise ValueError(f"--chat-template {template!r} looks like a file path, but it cannot be read: "
                             f"{e}") from None
    return codecs.decode(template, "unicode_escape")


class ServerTokenizer:
    """Encodes, decodes and renders chat templates in a few worker threads, never on the event loop
    (a long text can hold a thread for seconds). Text that cannot fit the model is refused
    before it is encoded: no token covers more than `max_token_chars` characters (the longest entry
    of the vocabulary), so a text longer than max_model_len times that is over max_model_len tokens.
    `utility()` is the same tokenizer over threads of its own. `tool_call_parser`: the format of the tool calls
    the model writes (server/tool_calls.py), by default the one its chat template teaches, if any."""

    def __init__(self, tokenizer, max_model_len: int, chat_template: str | None = None,
                 tool_call_parser: str | None = None):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.chat_template = chat_template
        self.tool_call_parser = tool_call_parser or detect_tool_call_parser(self._template_text())
        self.max_token_chars = max(map(len, tokenizer.get_vocab()), default=1) if tokenizer is not None else 0
        self.max_prompt_chars = max_model_len * self.max_token_chars
        if chat_template is not None and tokenizer is not None:
            self._check_chat_template()
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="kvserve-tokenizer")

    def _check_chat_template(self) -> None:
        """--chat-template must parse: a syntax error is the server's, not any request's, so it stops
        the server at start (ValueError). It is parsed by rendering it as requests will be, with the
        jinja extensions transformers gives templates."""
        try:
            self.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                               chat_template=self.chat_template)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"--chat-template is not a valid jinja template: {e.message} (line {e.lineno})") from None
        except Exception as e:  # noqa: BLE001
            # it parsed: a template may refuse this one conversation (raise_exception), not every request's
            log.info("--chat-template refuses a one-message conversation (%s: %s); requests it refuses get a 400",
                     type(e).__name__, e)

    def _template_text(self) -> str | None:
        """The chat template's text (--chat-template's, or all of the model's named ones)."""
        if self.chat_template is not None or self.tokenizer is None:
            return self.chat_template
        template = self.tokenizer.chat_template
        return "\n".join(template.values()) if isinstance(template, dict) else template

    def utility(self) -> ServerTokenizer:
        """This tokenizer, with a pool of UTILITY_TOKENIZER_THREADS of its own: for the calls that serve no request
        to the engine (/tokenize, /detokenize, the dashboard), which then never delay a request's prompt."""
        other = copy.copy(self)
        other._pool = ThreadPoolExecutor(UTILITY_TOKENIZER_THREADS, thread_name_prefix="kvserve-tokenizer-utility")
        return other

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def require(self, what: str, param: str | None = None):
        """The tokenizer, or a 400: the engine runs without one (--skip-tokenizer-init)."""
        if self.tokenizer is None:
            raise APIError(400, f"{what} needs the tokenizer, and this server runs without one "
                                f"(--skip-tokenizer-init): send prompt token ids", param)
        return self.tokenizer

    async def encode_prompt(self, text: str, add_special_tokens: bool, param: str = "prompt",
                            truncated: bool = False) -> list[int]:
        """A prompt's token ids; a 400 for text that can never fit max_model_len, before encoding it (unless it is
        to be `truncated` to its last tokens: the body's size bounds it then)."""
        self.require("a text prompt", param)
        if len(text) > self.max_prompt_chars and not truncated:
            raise APIError(400, f"{param} is {len(text)} characters; one longer than {self.max_prompt_chars} "
                                f"(max_model_len {self.max_model_len} x {self.max_token_chars}, the most characters "
                                f"one token covers) cannot fit max_model_len", param)
        return await self.encode(text, add_special_tokens, param)

    async def encode(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        """Any text's token ids, in a worker thread."""
        tok = self.require("text", param)
        return await self._run(tok.encode, text, add_special_tokens=add_special_tokens)

    async def decode(self, token_ids: list[int]) -> str:
        tok = self.require("text")
        return await self._run(tok.decode, token_ids)

    async def render_chat(self, conversation: list[dict], add_generation_prompt: bool,
                          tools: list[dict] | None = None) -> str:
        """The conversation (and the tools the model may call) through the chat template (--chat-template, else
        the model's own)."""
        tok = self.require("chat", "messages")
        if self.chat_template is None and not tok.chat_template:
            raise APIError(400, "this model has no chat template: start the server with --chat-template, "
                                "or use /v1/completions", "messages")
        try:
            text = await self._run(tok.apply_chat_template, conversation, tools=tools, tokenize=False,
                                   add_generation_prompt=add_generation_prompt, chat_template=self.chat_template)
        except Exception as e:  # noqa: BLE001
            # a template error (jinja's raise_exception, say) is the request's fault
            raise APIError(400, f"cannot apply the chat template: {type(e).__name__}: {e}", "messages") from None
        try:        # the messages' own text is checked; what else the template wrote is checked here
            return valid_unicode(text)
        except ValueError as e:
            raise APIError(400, f"messages: {e}", "messages") from None

    async def _run(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))
