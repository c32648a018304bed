"""The `kvserve` command: generate | serve | plan | eval | bench | top."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvserve.arg_utils import add_engine_args, engine_kwargs
from kvserve.config import ServerConfig
from kvserve.engine.cpu_memory import reuse_freed_memory
from kvserve.extras import MissingDependency


def port_number(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is a number in [1, 65535], got {text!r}")
    return port


# --api-key's other sources, in this order after the flag: a file, then the environment (vLLM's variable too)
API_KEY_VARIABLES = ("KVSERVE_API_KEY", "VLLM_API_KEY")


def api_key(args: argparse.Namespace) -> str | None:
    """The key requests must present: --api-key or the one line of --api-key-file, else the first of
    API_KEY_VARIABLES that is set; None: none is asked. ValueError for both flags, or a file that cannot be read or
    holds no key."""
    if args.api_key is not None and args.api_key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if args.api_key_file is None:
        return args.api_key or next(filter(None, map(os.environ.get, API_KEY_VARIABLES)), None)
    try:
        key = Path(args.api_key_file).read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--api-key-file {args.api_key_file}: cannot be read: {e}") from None
    if not key or "\n" in key:
        raise ValueError(f"--api-key-file {args.api_key_file}: must hold one key on one line")
    return key


def cmd_generate(args: argparse.Namespace) -> int:
    from kvserve import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sample_seed, stop=args.stop or None)
    engine = llm.engine
    engine.add_request("cli", args.prompt, params)
    printed = 0
    if args.stream:
        sys.stdout.write(args.prompt)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if args.stream:
                text = out.outputs[0].text
                sys.stdout.write(text[printed:])
                sys.stdout.flush()
                printed = len(text)
            elif out.finished:
                sys.stdout.write(args.prompt + out.outputs[0].text)
    sys.stdout.write("\n")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kvserve.config import EngineConfig
    from kvserve.server.app import build_app
    from kvserve.server.http import uvicorn_config
    from kvserve.server.tokenization import load_chat_template

    name = args.served_model_name or args.model or "kvserve-demo"
    config = ServerConfig(api_key=api_key(args), max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
                          request_read_timeout=args.request_read_timeout, max_connections=args.max_connections,
                          max_n_sequences=args.max_n_sequences, max_completion_prompts=args.max_completion_prompts,
                          max_request_sequences=args.max_request_sequences, max_request_tokens=args.max_request_tokens,
                          chat_template=load_chat_template(args.chat_template), enable_docs=args.enable_docs,
                          tool_call_parser=args.tool_call_parser,
                          kv_dashboard=args.kv_dashboard, kv_dashboard_content=args.kv_dashboard_content)
    app = build_app(EngineConfig(**engine_kwargs(args)), name, config)
    uvicorn.Server(uvicorn_config(app, args.host, args.port, config.request_read_timeout, config.max_connections,
                                  args.log_level)).run()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="A KV-cache-centric LLM inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete one prompt")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--sample-seed", type=int, default=None, help="seed of this request's sampling")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    add_engine_args(g)
    # one prompt: a cache for one sequence (not 256), which also starts faster
    g.set_defaults(func=cmd_generate, max_num_seqs=1)
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=port_number, default=8000)
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (seen by anyone who can list processes: prefer "
                        "--api-key-file, or the KVSERVE_API_KEY or VLLM_API_KEY environment variable)")
    s.add_argument("--api-key-file", default=None, help="a file holding the key on its first line")
    s.add_argument("--served-model-name", default=None, help="the model name clients send")
    s.add_argument("--max-queue", type=int, default=None, help="requests in flight before 429")
    s.add_argument("--max-body-bytes", type=int, default=ServerConfig.max_body_bytes)
    s.add_argument("--request-read-timeout", type=float, default=ServerConfig.request_read_timeout,
                   help="seconds a client has to send a request's head, and then its body, before a 408")
    s.add_argument("--max-connections", type=int, default=ServerConfig.max_connections,
                   help="open connections; a new one past this gets a 503 and is closed")
    s.add_argument("--max-n-sequences", type=int, default=ServerConfig.max_n_sequences,
                   help="the largest n (samples) of one request")
    s.add_argument("--max-completion-prompts", type=int, default=ServerConfig.max_completion_prompts,
                   help="the most prompts of one /v1/completions request")
    s.add_argument("--max-request-sequences", type=int, default=ServerConfig.max_request_sequences,
                   help="the most sequences (prompts x n) of one request")
    s.add_argument("--max-request-tokens", type=int, default=ServerConfig.max_request_tokens,
                   help="the most tokens one request's sequences may generate together (each up to its max_tokens, "
                        "or what max_model_len leaves)")
    s.add_argument("--chat-template", default=None,
                   help="a chat template (jinja) for /v1/chat/completions and /tokenize: a file, or the template "
                        "itself; default: the model's own")
    s.add_argument("--tool-call-parser", choices=("hermes", "llama3_json"), default=None,
                   help='the format of the tool calls the model writes, parsed for tool_choice "auto"; default: the '
                        "one its chat template teaches (Hermes' <tool_call>, Llama 3's <|python_tag|>), if any")
    s.add_argument("--enable-docs", action="store_true", help="serve /docs, /redoc and /openapi.json")
    s.add_argument("--kv-dashboard", default=True, action=argparse.BooleanOptionalAction,
                   help="serve the live view of the KV cache's structure: the page /dashboard and its state, "
                        "/v1/kv/state and /v1/kv/blocks/ID (block states and tables, owners as request ids, prefix "
                        "hashes; with --api-key they need the key)")
    s.add_argument("--kv-dashboard-content", action="store_true",
                   help="also show a block's tokens (ids and text: the requests' prompts and outputs) on "
                        "/v1/kv/blocks/ID, to a caller that presents the block's cache salt (X-Cache-Salt), none "
                        "for an unsalted block")
    s.add_argument("--log-level", default="info")
    add_engine_args(s)
    s.set_defaults(func=cmd_serve)
    from kvserve.planner import add_plan_parser
    add_plan_parser(sub)
    from kvserve.eval.cli import add_eval_parser
    add_eval_parser(sub)
    # the benches' one entry point, imported here alone: no other module depends on them
    from kvserve.bench import add_bench_parser
    add_bench_parser(sub)
    from kvserve.server.top import add_top_parser
    add_top_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "tensor_parallel_size", 1) > 1:
        from kvserve.parallel.torchrun import torchrun_env, torchrun_worker

        if (torchrun_env() or (0,))[0] > 0:
            torchrun_worker()      # torchrun's other ranks hold the shards of rank 0's engine
            return 0
    if args.command == "bench":
        # the suites build their engines themselves: they measure them as the command runs them
        reuse_freed_memory()
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, MissingDependency) as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2


def entry() -> None:
    """The `kvserve` command."""
    try:
        code = main()
    except KeyboardInterrupt:       # Ctrl+C: what was running has stopped (a server after its shutdown); no traceback
        code = 130
    from kvserve.parallel.torchrun import torchrun_env

    if torchrun_env() is not None:
        # a rank torchrun started ends here, before the interpreter's teardown: gloo's threads, still held by
        # PyTorch's C++ objects then, can abort the process after its work is done ("terminate called without an
        # active exception"), and torchrun then reports the whole run failed
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
