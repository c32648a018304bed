"""Fields real clients send, each honoured or refused by name (never ignored silently), and chat out
of the box: the demo model's template, --chat-template, and a server without a tokenizer."""
from __future__ import annotations

import json
import logging

import httpx
import openai
import pytest

from kvserve import LLM, SamplingParams
from kvserve.cli import build_parser
from kvserve.config import EngineConfig
from kvserve.server.app import ServerConfig, build_app
from kvserve.model.loader import load_tokenizer
from kvserve.server.tokenization import ServerTokenizer, load_chat_template
from servers import ENGINE_ARGS, MODEL, ServerThread
from tiny_models import make_checkpoint

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("llama")


@pytest.fixture(scope="module")
def url(ckpt):
    with ServerThread(build_app(EngineConfig(model=str(ckpt), **ENGINE_ARGS), MODEL)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def offline(ckpt):
    return LLM(str(ckpt), **ENGINE_ARGS)


def complete(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, **body}, timeout=60)


def test_logit_bias_of_100_forces_its_token(url):
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        r = complete(url, max_tokens=6, logit_bias={"42": 100}, return_token_ids=True, **sampling)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [42] * 6


@pytest.mark.parametrize("bias, text", [({"42": 100.5}, "logit_bias"), ({"abc": 1}, "'abc' is not a token id"),
                                        ({"999999": 1}, "not a token id"), ({"-1": 1}, "not a token id")])
def test_a_bad_logit_bias_is_a_400(url, bias, text):
    r = complete(url, max_tokens=2, logit_bias=bias)
    assert r.status_code == 400 and text in r.json()["error"]["message"]
    assert r.json()["error"]["param"].startswith("logit_bias")


def test_echo_puts_the_prompt_and_its_logprobs_before_the_completion(url, client, offline):
    ref = offline.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0, logprobs=1, prompt_logprobs=1),
                           use_tqdm=False)[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=1)
    choice, n_prompt = r.choices[0], len(ref.prompt_token_ids)
    assert choice.text == PROMPT + ref.outputs[0].text
    info = choice.logprobs
    assert len(info.tokens) == len(info.token_logprobs) == len(info.text_offset) == n_prompt + 4
    assert info.token_logprobs[0] is None and info.top_logprobs[0] is None   # nothing before the first token
    want = [entry[t].logprob for t, entry in zip(ref.prompt_token_ids[1:], ref.prompt_logprobs[1:])]
    assert info.token_logprobs[1:n_prompt] == pytest.approx(want, abs=1e-4)
    assert info.text_offset[0] == 0 and info.text_offset[n_prompt] == len(PROMPT)
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                         logprobs=1, stream=True)
    chunks = [c.choices[0] for c in streamed if c.choices]
    assert "".join(c.text for c in chunks) == choice.text
    assert [t for c in chunks for t in c.logprobs.tokens] == info.tokens
    ids = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2, temperature=0, echo=True)
    assert ids.choices[0].text.startswith(offline.get_tokenizer().decode([5, 6, 7]))


def test_top_k_of_minus_one_is_off(url):
    texts = [complete(url, max_tokens=8, temperature=1.0, seed=11, top_k=k).json()["choices"][0]["text"]
             for k in (-1, 0)]
    assert texts[0] == texts[1]


@pytest.mark.parametrize("body, status, param", [
    ({"n": 2, "best_of": 2}, 200, None),
    ({"n": 1, "best_of": 3}, 400, "best_of"),
    ({"response_format": {"type": "text"}}, 200, None),
    ({"response_format": {"type": "json_object"}}, 200, None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, 200, None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400, "response_format"),
    ({"suffix": "return n"}, 400, "suffix"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ({"presence_penalty": 0.0, "frequency_penalty": 0}, 200, None),
    ({"eviction": {"policy": []}}, 400, "eviction"),
    ({"eviction": {"policy": "sink", "sinks": 1e300}}, 400, "eviction"),
    ({"seed": 2**63}, 400, "seed"),
    ({"prompt": [5, 10**6]}, 400, "prompt"),
])
def test_known_completion_fields_are_honoured_or_refused_by_name(url, body, status, param):
    r = complete(url, max_tokens=2, **body)
    assert r.status_code == status
    if status == 400:
        error = r.json()["error"]
        assert error["param"] == param and param in error["message"]


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("body, status", [
    ({"tools": TOOLS}, 400),                                    # "auto", and the template writes no tool calls
    ({"tools": TOOLS, "tool_choice": "auto"}, 400),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, 400),
    ({"tools": TOOLS, "tool_choice": "none"}, 200),
    ({"tools": TOOLS, "tool_choice": "required"}, 200),
    ({"response_format": {"type": "json_object"}}, 200),
    ({"top_logprobs": 2}, 400),
])
def test_chat_s_tool_and_structured_output_fields(url, body, status):
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2, **body},
                   timeout=60)
    assert r.status_code == status
    if status == 400:
        assert r.json()["error"]["param"] in ("tools", "tool_choice", "response_format", "top_logprobs")


def test_return_token_ids_gives_the_prompt_s_and_the_completion_s(url, offline):
    tok = offline.get_tokenizer()
    r = complete(url, max_tokens=5, temperature=0, return_token_ids=True).json()["choices"][0]
    assert r["prompt_token_ids"] == tok.encode(PROMPT) and tok.decode(r["token_ids"]) == r["text"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0,
            "return_token_ids": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["prompt_token_ids"] and sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 5


def test_unknown_fields_are_ignored_and_logged(url, caplog):
    with caplog.at_level(logging.WARNING, logger="kvserve.server.protocol"):
        assert complete(url, max_tokens=2, not_a_field=1, guided_json=None).status_code == 200
    assert any("not_a_field" in r.getMessage() for r in caplog.records)
    assert not any("guided_json" in r.getMessage() for r in caplog.records)     # vLLM's: known, and asks nothing


X = 90                                  # "x" in the tiny tokenizer; "xa" is its tokens 90 and 67


@pytest.mark.parametrize("fields", [
    dict(min_tokens=4, logit_bias={1: 100.0}),                          # EOS (1) forced, held back 4 tokens
    dict(min_tokens=3, logit_bias={X: 100.0}, stop=["x"]),              # no stop string before min_tokens
    dict(logit_bias={X: 100.0}, stop=["x"], include_stop_str_in_output=True),
    dict(logit_bias={X: 100.0}, stop_token_ids=[X], include_stop_str_in_output=True),
    dict(logit_bias={0: 100.0}, skip_special_tokens=False),             # "<s>" written out
    dict(logit_bias={0: 100.0}, skip_special_tokens=False, spaces_between_special_tokens=False),
    dict(allowed_token_ids=[7, 50, 200]),
    dict(logit_bias={X: 100.0, 67: 100.0}, bad_words=["xa"]),
    dict(truncate_prompt_tokens=3),
], ids=["min_tokens-eos", "min_tokens-stop", "include_stop_str", "include_stop_token", "skip_special_tokens",
        "spaces_between", "allowed_token_ids", "bad_words", "truncate_prompt_tokens"])
def test_vllm_s_sampling_fields_are_honoured_as_offline(url, offline, fields):
    """Each field as vLLM defines it (tests/engine/test_sampling_fields.py): the server answers what the offline API
    does, streamed or not."""
    ref = offline.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, **fields), use_tqdm=False)[0]
    body = {**fields, "logit_bias": {str(t): b for t, b in fields.get("logit_bias", {}).items()}}
    choice = complete(url, max_tokens=8, temperature=0, return_token_ids=True, **body).json()["choices"][0]
    assert (choice["text"], choice["token_ids"]) == (ref.outputs[0].text, ref.outputs[0].token_ids)
    assert choice["prompt_token_ids"] == ref.prompt_token_ids
    assert choice["finish_reason"] == ref.outputs[0].finish_reason
    streamed = complete(url, max_tokens=8, temperature=0, stream=True, **body)
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == ref.outputs[0].text


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"structural_tag": "{}"}, "structural_tag"),
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"priority": 1}, "priority"),
    ("/v1/completions", {"prompt_logprobs": 2}, "prompt_logprobs"),
    ("/v1/completions", {"add_special_tokens": False}, "add_special_tokens"),
    ("/v1/completions", {"length_penalty": 2.0}, "length_penalty"),
    ("/v1/chat/completions", {"continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"echo": True}, "echo"),
    ("/tokenize", {"return_token_strs": True}, "return_token_strs"),
])
def test_vllm_s_fields_kvserve_lacks_are_refused_by_name(url, path, body, param):
    base = {"prompt": PROMPT} if path != "/v1/chat/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{url}{path}", json={**base, **body}, timeout=60)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and f"{param} is not supported" in error["message"]


def test_vllm_s_fields_that_ask_for_nothing_are_accepted(url):
    inert = {"use_beam_search": False, "guided_json": None, "priority": 0, "length_penalty": 1,
             "add_special_tokens": True, "structured_outputs": None, "prompt_logprobs": None}
    assert complete(url, max_tokens=2, **inert).status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "echo": False,
            "add_special_tokens": False, "continue_final_message": False, "include_reasoning": True}
    assert httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60).status_code == 200


def test_tokenize_takes_a_prompt_or_messages(url):
    both = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    for body in (both, {}):
        r = httpx.post(f"{url}/tokenize", json=body, timeout=60)
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and "prompt and messages" in message and "JSON object" not in message


# ---- chat templates --------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo():
    """The bundled demo model, served: its tokenizer writes a BOS before every text."""
    with ServerThread(build_app(EngineConfig(max_model_len=256, num_kv_blocks=64, max_num_seqs=4), "demo")) as base:
        yield base


def test_the_demo_model_chats_out_of_the_box(demo):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    r = httpx.post(f"{demo}/v1/chat/completions", json={"messages": messages, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    tokens = httpx.post(f"{demo}/tokenize", json={"messages": messages}).json()["tokens"]
    text = httpx.post(f"{demo}/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert text == "<s><|system|>\nBe brief.\n<|user|>\nhello\n<|assistant|>\n"


@pytest.mark.parametrize("prompt", ["", [], [""], [[]], ["ok", ""]])
def test_an_empty_prompt_is_a_400_however_it_is_written(demo, prompt):
    # "" is one token (the BOS) to this tokenizer: vLLM's rule refuses it all the same
    r = httpx.post(f"{demo}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400 and "empty" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "prompt"


@pytest.fixture(scope="module")
def no_template(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("no-template"), "llama")
    (path / "chat_template.jinja").unlink()
    return path


def test_chat_template_from_the_command_line(no_template, tmp_path):
    engine = EngineConfig(model=str(no_template), **ENGINE_ARGS)
    messages = [{"role": "user", "content": "hi"}]
    with ServerThread(build_app(engine, MODEL)) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json={"messages": messages}, timeout=60)
        assert r.status_code == 400 and "--chat-template" in r.json()["error"]["message"]
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    flag = build_parser().parse_args(["serve", "--chat-template", str(template)]).chat_template
    with ServerThread(build_app(engine, MODEL, ServerConfig(chat_template=load_chat_template(flag)))) as base:
        tokens = httpx.post(f"{base}/tokenize", json={"messages": messages}).json()["tokens"]
        assert httpx.post(f"{base}/detokenize", json={"tokens": tokens}).json()["prompt"] == "[user] hi\n"
        r = httpx.post(f"{base}/v1/chat/completions", json={"messages": messages, "max_tokens": 2}, timeout=60)
        assert r.status_code == 200


def test_load_chat_template_takes_a_file_or_the_template_itself(tmp_path):
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    assert load_chat_template(str(tmp_path / "t.jinja")) == "{{ messages }}"
    assert load_chat_template("{% for m in messages %}{{ m['content'] }}\\n{% endfor %}").endswith("}\n{% endfor %}")
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_a_chat_template_that_does_not_parse_stops_the_server_at_start(ckpt):
    tokenizer = load_tokenizer(ckpt)
    with pytest.raises(ValueError, match="--chat-template is not a valid jinja template"):
        ServerTokenizer(tokenizer, 128, "{% for m in messages %}{{ m['content'] }")
    # one that parses but refuses some conversations is the requests' business
    ServerTokenizer(tokenizer, 128, "{{ raise_exception('a system message first') }}").close()


# ---- no tokenizer ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def no_tokenizer(ckpt):
    """Served as `kvserve serve --skip-tokenizer-init` serves it."""
    config = EngineConfig(model=str(ckpt), skip_tokenizer_init=True, **ENGINE_ARGS)
    with ServerThread(build_app(config, MODEL)) as base:
        yield base


def test_without_a_tokenizer_token_ids_in_token_ids_out(no_tokenizer):
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "logprobs": 1, "temperature": 0}
    r = httpx.post(f"{no_tokenizer}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert len(choice["token_ids"]) == 3 and choice["prompt_token_ids"] == [5, 6, 7]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    for path, body in (("/v1/completions", {"prompt": "text"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/tokenize", {"prompt": "text"}), ("/detokenize", {"tokens": [5]})):
        r = httpx.post(f"{no_tokenizer}{path}", json=body, timeout=60)
        assert r.status_code == 400 and "--skip-tokenizer-init" in r.json()["error"]["message"]


def test_echo_without_a_tokenizer_has_no_text_and_token_id_logprobs(no_tokenizer):
    body = {"prompt": [5, 6, 7], "max_tokens": 2, "logprobs": 1, "echo": True, "temperature": 0}
    r = httpx.post(f"{no_tokenizer}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == "" and choice["prompt_token_ids"] == [5, 6, 7]
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in [5, 6, 7, *choice["token_ids"]]]
    assert logprobs["token_logprobs"][0] is None and None not in logprobs["token_logprobs"][1:]
