"""``superinfer``: thin command-line wiring from flags to library calls.

``serve`` and ``batch`` read the deployment file (``--config``) and let flags override it
key by key (``--max-num-seqs`` is ``rotasched.max_num_seqs``; ``--set section.key=value``
reaches any key), so a flag is validated exactly like the file.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "superinfer", "xla")


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--model", default=DEFAULT_MODEL, help="preset name, HF dir, .gguf or Orbax dir")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--attention-backend", default="auto", choices=("auto", "xla", "pallas"))
    p.add_argument("--compilation-cache", default=DEFAULT_CACHE,
                   help="persistent XLA cache dir ('' disables)")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from models import load_model
    from superinfer_jax import EngineConfig, LLMEngine, SamplingParams

    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    model = load_model(args.model, dtype=args.dtype)
    prompt = args.prompt
    if args.chat:
        prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    token_ids = model.tokenizer.encode(prompt)
    # One prompt: one request row, and prefill chunks sized to this prompt, so warm-up
    # compiles only the shapes this run uses.
    chunk = min(256, max(16, len(token_ids)))
    config = EngineConfig(
        max_model_len=args.max_model_len, max_num_seqs=1, max_prefill_rows=1,
        max_prefill_chunk=chunk, max_num_batched_tokens=chunk, dtype=args.dtype,
        attention_backend=args.attention_backend,
        compilation_cache_dir=args.compilation_cache or None,
    )
    engine = LLMEngine(model, config)
    req_id = engine.add_request(token_ids, sampling)
    start = time.perf_counter()
    if not args.chat:
        sys.stdout.write(args.prompt)
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    req = engine.release(req_id)
    elapsed = time.perf_counter() - start
    n = len(req.output_token_ids)
    sys.stdout.write("\n")
    print(f"[{n} tokens, {n / elapsed:.1f} tok/s, TTFT {req.ttft * 1000:.0f} ms, "
          f"finish: {req.status.finish_reason}]", file=sys.stderr)
    return 0


# flag dest -> deployment key. Flags left at None do not override the file.
_ENGINE_FLAGS = {
    "dtype": "model.dtype", "max_model_len": "model.max_model_len",
    "kv_cache_dtype": "model.kv_cache_dtype", "page_size": "hardware.page_size",
    "num_device_pages": "hardware.num_device_pages",
    "attention_backend": "hardware.attention_backend",
    "compilation_cache": "hardware.compilation_cache_dir", "policy": "rotasched.policy",
    "max_num_seqs": "rotasched.max_num_seqs",
    "max_num_batched_tokens": "rotasched.max_num_batched_tokens",
}
_SERVER_FLAGS = {
    "host": "server.host", "grpc_port": "server.grpc_port", "http_port": "server.http_port",
    "api_key": "server.api_key", "tls_cert": "server.tls_cert", "tls_key": "server.tls_key",
    "max_queue_len": "server.max_queue_len", "drain_grace_s": "server.drain_grace_s",
    "grpc": "server.enable_grpc", "http": "server.enable_http", "warmup": "server.warmup",
}


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="deployment YAML (see superinfer_config.yaml)")
    p.add_argument("--model", help="preset name, HF dir, .gguf or Orbax dir (model.name/path)")
    p.add_argument("--served-model-name", help="name clients use (model.name)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"))
    p.add_argument("--kv-cache-dtype", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--page-size", type=int)
    p.add_argument("--num-device-pages", type=int)
    p.add_argument("--attention-backend", choices=("auto", "xla", "pallas"))
    p.add_argument("--compilation-cache", help="persistent XLA cache dir ('' disables)")
    p.add_argument("--policy", choices=("fcfs", "swap", "rotasched"))
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any config key (repeatable), e.g. --set rotasched.alpha=2")


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start the gRPC and OpenAI-compatible HTTP servers")
    _add_engine_flags(p)
    p.add_argument("--host", help="bind address of both fronts (default 127.0.0.1)")
    p.add_argument("--grpc-port", type=int, help="default 50051")
    p.add_argument("--http-port", type=int, help="default 8000")
    p.add_argument("--grpc", action=argparse.BooleanOptionalAction, default=None,
                   help="serve gRPC (default on)")
    p.add_argument("--http", action=argparse.BooleanOptionalAction, default=None,
                   help="serve HTTP (default on)")
    p.add_argument("--api-key", default=os.environ.get("SUPERINFER_API_KEY"),
                   help="required bearer key (default: $SUPERINFER_API_KEY; none: open)")
    p.add_argument("--tls-cert", help="PEM certificate (enables TLS on both fronts)")
    p.add_argument("--tls-key", help="PEM private key")
    p.add_argument("--max-queue-len", type=int, help="waiting requests before 429 / "
                   "RESOURCE_EXHAUSTED")
    p.add_argument("--drain-grace-s", type=float, help="SIGTERM: seconds to finish in-flight")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="compile every bucket before serving (default on)")
    p.set_defaults(func=cmd_serve)


def _add_batch(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("batch", help="run a JSONL file of prompts offline (resumable)")
    _add_engine_flags(p)
    p.add_argument("--input", required=True, help="JSONL: id, prompt or messages, "
                   "optional sampling and slo")
    p.add_argument("--output", required=True, help="JSONL results; ids in it are skipped")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_batch)


def _deployment(args: argparse.Namespace, flags: dict[str, str]):
    from serving.deploy_config import UNSET, DeploymentConfig, parse_set

    overrides = {key: getattr(args, dest) for dest, key in flags.items()}
    if args.model is not None and os.path.exists(args.model):
        overrides.update({"model.path": args.model, "model.name": UNSET})
    elif args.model is not None:
        overrides.update({"model.name": args.model, "model.path": UNSET})
    if args.served_model_name is not None:
        overrides["model.name"] = args.served_model_name
    overrides.update(parse_set(args.set))
    return DeploymentConfig.load(args.config, overrides)


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from serving.server import serve

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    for name in ("serving", "superinfer", "superinfer_jax"):  # ours; libraries stay quiet
        logging.getLogger(name).setLevel(logging.INFO)
    return serve(_deployment(args, _ENGINE_FLAGS | _SERVER_FLAGS))


def cmd_batch(args: argparse.Namespace) -> int:
    from models import load_model
    from serving.batch import BatchRunner
    from superinfer_jax.engine import LLMEngine

    config = _deployment(args, _ENGINE_FLAGS)
    engine_config = config.engine_config(show_progress=not args.no_progress)
    model = load_model(config.model.source, dtype=config.model.dtype)
    engine = LLMEngine(model, engine_config)
    runner = BatchRunner(engine, model.tokenizer, engine_config.default_slo,
                         show_progress=not args.no_progress)
    report = runner.run(args.input, args.output)
    print(f"[batch: {report.num_done} done, {report.num_errors} errors, "
          f"{report.num_skipped} skipped (already in {args.output}), {report.num_tokens} "
          f"tokens in {report.elapsed_s:.1f} s, {report.tokens_per_s:.1f} tok/s]",
          file=sys.stderr)
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from benchmarks import serve_bench

    p = sub.add_parser("bench", help="measure a running server (gRPC or OpenAI HTTP) on a "
                       "workload: TTFT, TPOT, ITL, SLO attainment, goodput",
                       description=serve_bench.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    serve_bench.add_arguments(p)
    p.set_defaults(func=serve_bench.run)


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    from benchmarks import simulate

    p = sub.add_parser("simulate", help="simulate the policies at paper scale (GH200, H200 "
                       "PCIe, ...) with a cost model", description=simulate.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    simulate.add_arguments(p)
    p.set_defaults(func=simulate.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="superinfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    _add_batch(sub)
    _add_bench(sub)
    _add_simulate(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:
        print(f"superinfer: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
