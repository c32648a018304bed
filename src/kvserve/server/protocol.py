"""OpenAI request bodies (with vLLM's extras), validated at the edge.

Strict, as vLLM's models are: no bool, float or string where an integer belongs (`true`, `2.0` and
`"5"` are not 1, 2 and 5), no NaN or infinity. Fields OpenAI or vLLM define are honoured or refused
with a 400 naming them (vLLM's that kvserve lacks are refused unless they ask for nothing); fields nobody
defines are ignored, and logged.
"""
from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import Annotated, ClassVar, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError,
                      ValidationInfo, WrapValidator, field_validator, model_validator)
from pydantic_core import PydanticCustomError

from kvserve.sampling import (MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_TOKENS,
                              MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams)
from kvserve.server.errors import APIError, field_error
from kvserve.server.tool_calls import parameters_schema, required_schema
from kvserve.structured import StructuredOutputsParams
from kvserve.text import valid_unicode

log = logging.getLogger(__name__)

MAX_LOGPROBS = 20

# vLLM's request fields kvserve does not implement, each with the value that asks for nothing (vLLM's default):
# a request that gives another value is refused, naming the field, until kvserve implements it
VLLM_SAMPLING_FIELDS = {
    "use_beam_search": False, "length_penalty": 1.0, "watermarking": False, "truncation_side": None,
    "prompt_logprobs": None, "logprob_token_ids": None, "priority": 0,
    "request_id": None, "session_id": None, "return_tokens_as_token_ids": False, "kv_transfer_params": None,
    "ec_transfer_params": None, "vllm_xargs": None, "repetition_detection": None, "thinking_token_budget": None,
    "stream_interval": None, "routed_experts_prompt_start": 0, "logits_processors": None, "structural_tag": None,
}
VLLM_COMPLETION_FIELDS = {"prompt_embeds": None, "add_special_tokens": True, "return_token_offsets": False,
                          "return_mm_kwargs": True}
VLLM_CHAT_FIELDS = {"echo": False, "continue_final_message": False, "add_special_tokens": False, "documents": None,
                    "chat_template": None, "chat_template_kwargs": None, "mm_processor_kwargs": None,
                    "media_io_kwargs": None, "reasoning_effort": None, "include_reasoning": True,
                    "return_prompt_text": False}
VLLM_TOKENIZE_FIELDS = {"continue_final_message": False, "return_token_strs": False, "chat_template": None,
                        "chat_template_kwargs": None, "mm_processor_kwargs": None}


Text = Annotated[str, AfterValidator(valid_unicode)]
TokenId = Annotated[int, Field(ge=0)]


def _str_or_list(item):
    """A string or a list of `item`: a value's errors are those of the shape it has, not of both."""
    return Annotated[Annotated[Text, Tag("str")] | Annotated[list[item], Tag("list")],
                     Discriminator(lambda v: "str" if isinstance(v, str) else "list")]


def _prompt_shape(value) -> str:
    """Which of the prompt's shapes a value has (by its first item), so that only that one is tried: a union
    tries them all, and a list of a million token ids failing as a list of strings costs a million errors."""
    if isinstance(value, str) or not isinstance(value, list) or not value:
        return "str" if isinstance(value, str) else "token_ids"
    first = value[0]
    return "texts" if isinstance(first, str) else "token_id_lists" if isinstance(first, list) else "token_ids"


def _one_prompt_error(value, handler):
    """The union's several errors (one per shape tried) as one message."""
    try:
        return handler(value)
    except ValidationError:
        raise ValueError("must be a string, a list of strings, a list of token ids (integers >= 0) or a list "
                         "of lists of token ids") from None


def _non_empty_prompts(prompt):
    """vLLM's rule: a prompt may not be empty, as text ("") or as token ids ([]); nor one of a list."""
    if not prompt:
        raise ValueError("the prompt is empty")
    if isinstance(prompt, list) and not isinstance(prompt[0], int):
        for i, p in enumerate(prompt):
            if not p:
                raise ValueError(f"prompt {i} of the list is empty")
            if isinstance(p, str):
                valid_unicode(p)
    elif isinstance(prompt, str):
        valid_unicode(prompt)
    return prompt


Prompt = Annotated[Annotated[str, Tag("str")] | Annotated[list[str], Tag("texts")]
                   | Annotated[list[TokenId], Tag("token_ids")] | Annotated[list[list[TokenId]], Tag("token_id_lists")],
                   Discriminator(_prompt_shape), WrapValidator(_one_prompt_error), AfterValidator(_non_empty_prompts)]


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    # vLLM's fields this request lacks: refused unless they ask for nothing (their value here, or None)
    vllm_fields: ClassVar[dict[str, object]] = {}

    @model_validator(mode="before")
    @classmethod
    def _check_unknown_fields(cls, data):
        if not isinstance(data, dict):
            return data
        for name, inert in cls.vllm_fields.items():
            value = data.get(name)
            if value is not None and not (value == inert and isinstance(value, bool) == isinstance(inert, bool)):
                also = "" if inert is None else f" (only its default, {json.dumps(inert)}, is accepted)"
                raise PydanticCustomError("unsupported", "{message}",
                                          {"message": f"{name} is not supported by kvserve{also}", "param": name})
        if cls.model_config.get("extra") == "ignore":
            known = {f.alias or name for name, f in cls.model_fields.items()}     # a field's alias is its key
            ignored = data.keys() - known - cls.vllm_fields.keys()
            if ignored:
                log.warning("ignoring fields of the request kvserve does not know: %s", sorted(map(repr, ignored)))
        return data


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class JsonSchemaResponseFormat(OpenAIBaseModel):
    name: Text
    description: Text | None = None
    json_schema: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's response_format: text, json_object (any JSON object) or json_schema (an instance of its schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None

    @field_validator("type", mode="before")
    @classmethod
    def _known_type(cls, kind):
        if kind == "structural_tag":
            raise _unsupported("response_format structural_tag")
        return kind

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ValueError('a json_schema response_format needs {"json_schema": {"name": ..., "schema": {...}}}')
        return self

    def structured_outputs(self) -> StructuredOutputsParams | None:
        if self.type == "json_schema":
            return StructuredOutputsParams(json=self.json_schema.json_schema)
        return StructuredOutputsParams(json_object=True) if self.type == "json_object" else None


# vLLM's older fields of structured outputs, each the StructuredOutputsParams field it sets
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar", "guided_json_object": "json_object"}
# the grammar engines vLLM's guided_decoding_backend names that are kvserve's (llguidance)
GUIDED_BACKENDS = ("auto", "guidance", "llguidance")


def _unsupported(name: str, why: str = "") -> ValueError:
    return ValueError(f"{name} is not supported by kvserve{': ' + why if why else ''}")


class _SamplingRequest(OpenAIBaseModel):
    vllm_fields: ClassVar[dict[str, object]] = VLLM_SAMPLING_FIELDS

    model: Text | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    best_of: int | None = Field(None, ge=1)
    stop: _str_or_list(Text) | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS_TOKENS)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    response_format: ResponseFormat | None = None
    # vLLM's extras
    top_k: int = Field(0, ge=-1)           # 0 or -1: off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)
    bad_words: list[Text] | None = Field(None, max_length=MAX_BAD_WORDS)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)     # the prompt's last k tokens; -1: max_model_len
    cache_salt: Text | None = Field(None, min_length=1)
    return_token_ids: bool = False          # the token ids beside the text (prompt's and completion's)
    # kvserve's: this request's KV eviction policy (kvserve.kv.eviction) and sparse attention (kvserve.kv.sparse)
    eviction: str | dict | None = None
    sparse_attention: str | dict | None = None
    # structured outputs: vLLM's field (StructuredOutputsParams' fields), and its older ones
    structured_outputs: dict | None = None
    guided_json: dict | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: str | None = None
    guided_json_object: bool = False
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop):
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ValueError(f"stop takes up to {MAX_STOP_STRINGS} non-empty strings")
        return stop

    @field_validator("best_of")
    @classmethod
    def _check_best_of(cls, best_of, info: ValidationInfo):
        n = info.data.get("n", 1)
        if best_of is not None and best_of > n:
            raise _unsupported("best_of > n", "it returns every sample it draws; ask for n of them")
        if best_of is not None and best_of < n:
            raise ValueError(f"best_of ({best_of}) must be at least n ({n})")
        return best_of

    @field_validator("stream_options")
    @classmethod
    def _only_with_stream(cls, options, info: ValidationInfo):
        if options is not None and not info.data.get("stream"):
            raise ValueError("stream_options can only be given with stream=true")
        return options

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, value, info: ValidationInfo):
        if value != 0:
            raise _unsupported(f"{info.field_name} other than 0")
        return value

    @field_validator("repetition_penalty")
    @classmethod
    def _no_repetition_penalty(cls, value):
        if value != 1:
            raise _unsupported("repetition_penalty other than 1")
        return value

    @field_validator("guided_decoding_backend")
    @classmethod
    def _our_backend(cls, backend):
        if backend is not None and backend not in GUIDED_BACKENDS:
            raise ValueError(f"{backend!r} is not kvserve's grammar engine: llguidance (vLLM's 'guidance'), or 'auto'")
        return backend

    def structured_outputs_params(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The request's constraint on its output and the field that asks for it (structured_outputs, one of vLLM's
        guided_* or response_format); a 400 naming the field where it is wrong or where two ask."""
        given = [name for name in ("structured_outputs", *GUIDED_FIELDS) if getattr(self, name) not in (None, False)]
        if self.response_format is not None and self.response_format.type != "text":
            given.append("response_format")
        if len(given) > 1:
            raise APIError(400, f"{given[1]}: give one of {' and '.join(given)}: each constrains the whole output",
                           given[1])
        if not given:
            return None, None
        name = given[0]
        try:
            if name == "structured_outputs":
                params = StructuredOutputsParams.from_dict(self.structured_outputs)
            elif name == "response_format":
                params = self.response_format.structured_outputs()
            else:
                params = StructuredOutputsParams(**{GUIDED_FIELDS[name]: getattr(self, name)})
        except ValueError as e:
            raise APIError(400, f"{name}: {str(e).removeprefix('structured_outputs: ')}", name) from None
        return self.with_whitespace(params), name

    def with_whitespace(self, params: StructuredOutputsParams) -> StructuredOutputsParams:
        """A JSON constraint with guided_whitespace_pattern as its whitespace, where it names none of its own."""
        if self.guided_whitespace_pattern is None or params.kind not in ("json", "json_object") \
                or params.whitespace_pattern is not None:
            return params
        return replace(params, whitespace_pattern=self.guided_whitespace_pattern)

    def sampling_params(self, max_tokens: int | None, vocab_size: int, logprobs: int | None = None,
                        prompt_logprobs: int | None = None,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """The engine's SamplingParams of this request, with the constraint on its output (structured_outputs:
        structured_outputs_params' or its tools'); a 400 for values the engine refuses."""
        kwargs = {"n": self.n, "max_tokens": max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                  "top_k": max(self.top_k, 0), "min_p": self.min_p, "seed": self.seed, "stop": self.stop,
                  "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos, "logprobs": logprobs,
                  "prompt_logprobs": prompt_logprobs, "eviction": self.eviction,
                  "sparse_attention": self.sparse_attention,
                  "logit_bias": self._token_bias(vocab_size) if self.logit_bias else None,
                  "min_tokens": self.min_tokens, "include_stop_str_in_output": self.include_stop_str_in_output,
                  "skip_special_tokens": self.skip_special_tokens,
                  "spaces_between_special_tokens": self.spaces_between_special_tokens,
                  "allowed_token_ids": self.allowed_token_ids, "bad_words": self.bad_words,
                  "truncate_prompt_tokens": self.truncate_prompt_tokens, "structured_outputs": structured_outputs}
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            raise field_error(e, kwargs) from None

    def _token_bias(self, vocab_size: int) -> dict[int, float]:
        """logit_bias with its keys (token ids written as strings, as OpenAI's API has them) as ints."""
        bias = {}
        for key, value in self.logit_bias.items():
            if not (key.isascii() and key.isdigit()) or int(key) >= vocab_size:
                raise APIError(400, f"logit_bias: {key!r} is not a token id in [0, {vocab_size})", "logit_bias")
            bias[int(key)] = value
        return bias


class CompletionRequest(_SamplingRequest):
    vllm_fields: ClassVar[dict[str, object]] = {**VLLM_SAMPLING_FIELDS, **VLLM_COMPLETION_FIELDS}

    prompt: Prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix):
        if suffix:
            raise _unsupported("suffix", "no insertion; put the text in the prompt")
        return suffix

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: a text or token ids."""
        p = self.prompt
        return [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)


class ContentPart(OpenAIBaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: str
    text: Text | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type != "text" or self.text is None:
            raise _unsupported(f"a content part of type {self.type!r}", 'only {"type": "text", "text": ...}')
        return self


class ChatMessage(OpenAIBaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Text
    content: _str_or_list(ContentPart) | None = None

    def for_template(self) -> dict:
        """The message as chat templates take it: content parts joined into one string, and the arguments of an
        assistant's tool calls as objects, not JSON text (as vLLM does)."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "\n".join(part.text for part in self.content)
        for call in message.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError:
                    pass            # the template gets the text as sent
        return message


class FunctionDefinition(OpenAIBaseModel):
    name: Text = Field(min_length=1, max_length=64)
    description: Text | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


def tool_dicts(tools: list[ChatCompletionToolsParam] | None) -> list[dict] | None:
    """The tools as chat templates take them."""
    return None if tools is None else [t.model_dump(exclude_none=True) for t in tools]


class NamedFunction(OpenAIBaseModel):
    name: Text


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    vllm_fields: ClassVar[dict[str, object]] = {**VLLM_SAMPLING_FIELDS, **VLLM_CHAT_FIELDS}

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatCompletionToolsParam] | None = None
    # "none", "auto" (the default with tools), "required", or a named function
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top, info: ValidationInfo):
        if top and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return top

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools):
        names = [t.function.name for t in tools or ()]
        if len(set(names)) < len(names):
            raise ValueError(f"each tool needs a name of its own, got {names}")
        return tools

    @model_validator(mode="after")
    def _tool_choice_of_the_tools(self):
        """OpenAI's default: "auto" with tools, else "none"; a choice of tools needs them, a named one among them."""
        if self.tool_choice is None:
            self.tool_choice = "auto" if self.tools else "none"
        if self.tool_choice != "none" and not self.tools:
            raise PydanticCustomError("tool_choice", "{message}", {
                "message": f"tool_choice {self.tool_choice_name!r} needs tools", "param": "tool_choice"})
        if isinstance(self.tool_choice, NamedToolChoice) and self.named_tool() is None:
            raise PydanticCustomError("tool_choice", "{message}", {
                "message": f"tool_choice names {self.tool_choice.function.name!r}, which is none of the tools",
                "param": "tool_choice"})
        return self

    @property
    def tool_choice_name(self) -> str:
        """"none", "auto", "required", or the function tool_choice names."""
        choice = self.tool_choice
        return choice.function.name if isinstance(choice, NamedToolChoice) else choice

    def named_tool(self) -> dict | None:
        """The tool tool_choice names, as a dict, if it names one."""
        if not isinstance(self.tool_choice, NamedToolChoice):
            return None
        name = self.tool_choice.function.name
        return next((t.model_dump(exclude_none=True) for t in self.tools if t.function.name == name), None)

    def tool_constraint(self) -> StructuredOutputsParams | None:
        """What a tool_choice of "required" or a named function makes of the output: the function's arguments (its
        parameters' schema), or an array of calls (required_schema)."""
        if self.tool_choice == "required":
            return self.with_whitespace(StructuredOutputsParams(
                json=required_schema(tool_dicts(self.tools), self.parallel_tool_calls)))
        tool = self.named_tool()
        return None if tool is None else self.with_whitespace(StructuredOutputsParams(json=parameters_schema(tool)))


class TokenizeRequest(OpenAIBaseModel):
    vllm_fields: ClassVar[dict[str, object]] = VLLM_TOKENIZE_FIELDS

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[ChatCompletionToolsParam] | None = None     # given to the chat template, as chat's

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(OpenAIBaseModel):
    model: Text | None = None
    tokens: list[TokenId]
