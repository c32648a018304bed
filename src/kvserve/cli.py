"""The `kvserve` command: generate | serve | plan | eval | bench | top."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvserve.bench import MissingDependency
from kvserve.config import ATTENTION_BACKENDS, CACHE_MODES, KV_CACHE_DTYPES, QUANTIZATIONS, ServerConfig
from kvserve.engine.cpu_memory import reuse_freed_memory


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The LLM(...) options, as flags shared by every subcommand that builds an engine."""
    p.add_argument("--model", default=None, help="checkpoint directory or hub id (default: the bundled demo model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory", default=None, help="bytes, or a size such as 2GiB")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--long-prefill-token-threshold", type=int, default=None,
                   help="most prompt tokens of one sequence per step (chunked prefill)")
    p.add_argument("--cache-mode", default="paged", choices=CACHE_MODES)
    p.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    p.add_argument("--enable-prefix-caching", default=True, action=argparse.BooleanOptionalAction)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="store K/V as int8, fp8 or int4 pages (auto: the model's dtype)")
    p.add_argument("--kv-cache-dtype-skip-layers", type=layer_list, default=(),
                   help="comma-separated layers kept in the model's dtype, e.g. 0,31")
    p.add_argument("--eviction", default=None,
                   help='KV eviction of every request: "sink:sinks=4,window=1020", '
                        '"h2o:budget=512,recent=64,score=max" or "snapkv:budget=512,window=32"')
    p.add_argument("--allow-long-max-model-len", action="store_true",
                   help="accept a --max-model-len past the model's trained positions")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU for weights, activations and the KV cache (when its size is not given)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="decode op by op: no CUDA graphs on a GPU; on the CPU, no native decode step")
    p.add_argument("--cpu-allocator-tuning", default=True, action=argparse.BooleanOptionalAction,
                   help="on the CPU, keep freed memory in the process for the next step's tensors (glibc malloc "
                        "settings, process-wide)")
    p.add_argument("--num-scheduler-steps", type=int, default=8,
                   help="decode steps one native CPU call may run where nobody sees the steps between (offline "
                        "greedy batches); 1: one a call")
    p.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="one block table for all layers of a sliding-window model: every layer keeps every token "
                        "(default: each layer group its own, a sliding group only its window)")
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="weight-only quantization of every linear layer (lm_head too) at load, CPU only: int8 per "
                        "output channel, int4 in groups of 32")
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="load no tokenizer: prompts must be token ids, and outputs have token ids but no text")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks the model and the KV cache are split across: this process and N-1 spawned workers "
                        "(gloo on the CPU, NCCL on CUDA); --kv-cache-memory is then per rank")
    p.add_argument("--kv-offload", default=None, metavar="disk:PATH|cpu",
                   help="a second tier for the blocks the prefix cache evicts: disk:PATH keeps them in files that "
                        "a restarted engine finds; cpu (CUDA only) in pinned host memory")
    p.add_argument("--kv-offload-size", default=None, help="the tier's size, e.g. 16GiB (default 16GiB)")
    p.add_argument("--preemption-mode", default=None, choices=["swap", "recompute"],
                   help="with --kv-offload, what a preempted sequence's blocks do: swap (written to the tier and "
                        "read back when it resumes) or recompute; by default, whichever a prefill and a transfer "
                        "timed at start-up say costs less")


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


def layer_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers such as 0,31, got {text!r}") from None


def engine_kwargs(args: argparse.Namespace) -> dict:
    keys = ["dtype", "device", "seed", "max_model_len", "block_size", "num_kv_blocks", "kv_cache_memory",
            "max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold", "cache_mode",
            "attention_backend", "enable_prefix_caching", "kv_cache_dtype", "kv_cache_dtype_skip_layers", "eviction",
            "allow_long_max_model_len", "gpu_memory_utilization", "enforce_eager", "num_scheduler_steps",
            "cpu_allocator_tuning", "skip_tokenizer_init", "tensor_parallel_size",
            "disable_hybrid_kv_cache_manager", "kv_offload", "kv_offload_size", "preemption_mode", "quantization"]
    return {k: getattr(args, k) for k in keys}


def cmd_generate(args: argparse.Namespace) -> int:
    from kvserve import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
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
                          kv_dashboard=args.kv_dashboard, kv_dashboard_content=args.kv_dashboard_content)
    app = build_app(EngineConfig(model=args.model, **engine_kwargs(args)), name, config)
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
    add_eval_parser(sub, add_engine_args, engine_kwargs)
    from kvserve.bench import add_bench_parser
    add_bench_parser(sub)
    from kvserve.server.top import add_top_parser
    add_top_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "tensor_parallel_size", 1) > 1:
        from kvserve.engine.workers import torchrun_env, torchrun_worker

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
    from kvserve.engine.workers import torchrun_env

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
