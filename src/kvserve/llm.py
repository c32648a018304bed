"""LLM: the offline API, named after vLLM's."""
from __future__ import annotations

from itertools import count
from typing import Any, Sequence as Seq

from tqdm.auto import tqdm

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.outputs import RequestOutput
from kvserve.sampling import SamplingParams

PromptType = str | list[int] | dict[str, Any]


class LLM:
    """Load a model once, then generate for batches of prompts with continuous batching."""

    def __init__(self, model: str | None = None, **kwargs: Any):
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._request_ids = count()

    def get_tokenizer(self):
        """The engine's tokenizer; ValueError if it has none (skip_tokenizer_init), as in vLLM."""
        if self.engine.tokenizer is None:
            raise ValueError("this LLM has no tokenizer (skip_tokenizer_init=True)")
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Completions for every prompt, in input order."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        return self._run([(p, sp) for p, sp in zip(prompts, params)], use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template (given the `tools` the
        model may call, OpenAI's function definitions, as vLLM's LLM.chat)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.get_tokenizer()
        if chat_template is None and not tok.chat_template:
            raise ValueError("this model's tokenizer has no chat template; pass chat_template=")
        prompts = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, tools=tools, tokenize=False, add_generation_prompt=True,
                                           chat_template=chat_template)
            prompts.append({"prompt": text,
                            "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, requests: list[tuple[PromptType, SamplingParams]], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        ids: list[str] = []
        finished: dict[str, RequestOutput] = {}
        try:
            for prompt, params in requests:
                rid = str(next(self._request_ids))
                engine.add_request(rid, prompt, params, final_only=True)
                ids.append(rid)
            with tqdm(total=len(ids), desc="generating", disable=not use_tqdm or len(ids) < 2) as bar:
                while len(finished) < len(ids):
                    for out in engine.step():
                        if out.finished:
                            finished[out.request_id] = out
                            bar.update(1)
        finally:   # an error or an interrupt leaves none of this call's requests in the engine
            for rid in ids:
                if rid not in finished:
                    engine.abort_request(rid)
        return [finished[rid] for rid in ids]

    def stats(self) -> dict:
        return self.engine.stats()

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor_parallel_size > 1): none is left running. Also done when
        the LLM is garbage-collected and at exit."""
        self.engine.shutdown()
