"""``superinfer``: thin command-line wiring from flags to library calls.

``generate``, ``serve`` and ``batch`` build their configuration one way: the deployment
file (``--config``), then flags over it key by key (``--max-num-seqs`` is
``engine.max_num_seqs``; ``--set section.key=value`` reaches any key), checked by the one
validator (``serving.deploy_config``). A flag's type and help come from its key's field.
A bad value exits 2 with ``error: <key>: <message>``, before any port is bound.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from typing import Any

# flag -> deployment key. Type and help come from the key's field; a flag not given
# (None) does not override the file.
ENGINE_FLAGS = {
    "--dtype": "model.dtype", "--kv-cache-dtype": "model.kv_cache_dtype",
    "--quantization": "model.quantization",
    "--max-model-len": "model.max_model_len", "--page-size": "hardware.page_size",
    "--num-device-pages": "hardware.num_device_pages",
    "--attention-backend": "hardware.attention_backend",
    "--compilation-cache": "hardware.compilation_cache_dir", "--policy": "engine.policy",
    "--max-num-seqs": "engine.max_num_seqs",
    "--max-num-batched-tokens": "engine.max_num_batched_tokens",
    "--prefix-caching": "prefix_caching.enabled",  # --no-prefix-caching turns it off
    "--chat-template": "model.chat_template",
}
SERVER_FLAGS = {
    "--host": "server.host", "--grpc-port": "server.grpc_port",
    "--http-port": "server.http_port", "--grpc": "server.enable_grpc",
    "--http": "server.enable_http", "--api-key": "server.api_key",
    "--tls-cert": "server.tls_cert", "--tls-key": "server.tls_key",
    "--max-queue-len": "server.max_queue_len", "--drain-grace-s": "server.drain_grace_s",
    "--warmup": "engine.warmup",
    "--compile-in-background": "engine.compile_in_background",
    "--kv-events-endpoint": "server.kv_events_endpoint",
    "--kv-events-topic": "server.kv_events_topic",
    "--tool-call-parser": "server.tool_call_parser",
    "--reasoning-parser": "server.reasoning_parser",
}
# ``generate`` runs one request: no other request to rotate for, so no host tier and
# vLLM's policy unless the file or a flag says otherwise; one row, chunks sized to the
# prompt (so warm-up compiles only the shapes this run uses).
GENERATE_DEFAULTS = {"engine.policy": "fcfs", "duplex_kv.host_memory_gb": 0.0}
# Background compilation is a server's: its deferred warm-up runs while the serving loop
# idles. ``generate`` and ``batch`` drive the engine themselves: they compile first.
FOREGROUND = {"engine.compile_in_background": False}


def _add_key_flags(p: argparse.ArgumentParser, flags: dict[str, str]) -> None:
    from serving.config_schema import KEYS

    keys: dict[str, str] = dict(p.get_default("flag_keys") or {})
    for flag, path in flags.items():
        key = KEYS[path]
        base = next(t for t in getattr(key.hint, "__args__", (key.hint,))
                    if t is not type(None))
        dest = flag.removeprefix("--").replace("-", "_")
        text = f"{key.help} ({path})"
        if base is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                           help=text)
        else:
            default = os.environ.get("SUPERINFER_API_KEY") if path == "server.api_key" \
                else None
            p.add_argument(flag, type=base if base in (int, float) else str,
                           default=default, help=text)
        keys[dest] = path
    p.set_defaults(flag_keys=keys)


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="deployment YAML (see superinfer_config.yaml)")
    p.add_argument("--model", help="preset name, HF dir, .gguf or Orbax dir (model.name/path)")
    p.add_argument("--served-model-name", help="name clients use (model.name)")
    _add_key_flags(p, ENGINE_FLAGS)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any config key (repeatable), e.g. --set rotasched.alpha=2")


def _deployment(args: argparse.Namespace, base: dict[str, Any] | None = None,
                extra: dict[str, Any] | None = None):
    """The one way a command builds its configuration: ``base`` (the command's own
    defaults), the file, the flags, ``--set``, then ``extra`` (what the command fixes)."""
    from serving.deploy_config import UNSET, DeploymentConfig, parse_set

    overrides = {path: getattr(args, dest) for dest, path in args.flag_keys.items()}
    if args.model is not None and os.path.exists(args.model):
        overrides.update({"model.path": args.model, "model.name": UNSET})
    elif args.model is not None:
        overrides.update({"model.name": args.model, "model.path": UNSET})
    if args.served_model_name is not None:
        overrides["model.name"] = args.served_model_name
    overrides.update(parse_set(args.set))
    overrides.update(extra or {})
    return DeploymentConfig.load(args.config, overrides, base=base)


def _load_model(config: Any) -> Any:
    from models import load_model
    from serving.server import with_chat_template

    return with_chat_template(load_model(
        config.model.source, dtype=config.model.dtype,
        tensor_parallel_size=config.engine.model.tensor_parallel_size,
        quantization=config.model.quantization), config)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="sampling seed of this request")
    _add_engine_flags(p)
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from serving.server import load_draft_of
    from superinfer_jax import LLMEngine, SamplingParams

    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    config = _deployment(args, base=GENERATE_DEFAULTS)
    model = _load_model(config)
    prompt = args.prompt
    if args.chat:
        prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    token_ids = model.tokenizer.encode(prompt)
    chunk = min(256, max(16, len(token_ids)))
    config = _deployment(args, base=GENERATE_DEFAULTS, extra={
        "engine.max_num_seqs": 1, "engine.max_prefill_rows": 1,
        "engine.max_prefill_chunk": chunk, "engine.max_num_batched_tokens": chunk,
        **FOREGROUND})
    engine = LLMEngine(model, config.engine_config(), load_draft_of(config))
    req_id = engine.add_request(token_ids, sampling)
    start = time.perf_counter()
    if not args.chat:
        sys.stdout.write(args.prompt)
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    req = engine.release(req_id)
    assert req is not None  # finished: the loop above ran until it was
    elapsed = time.perf_counter() - start
    n = len(req.output_token_ids)
    sys.stdout.write("\n")
    print(f"[{n} tokens, {n / elapsed:.1f} tok/s, TTFT {(req.ttft or 0.0) * 1000:.0f} ms, "
          f"finish: {req.status.finish_reason}]", file=sys.stderr)
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start the gRPC and OpenAI-compatible HTTP servers")
    _add_engine_flags(p)
    _add_key_flags(p, SERVER_FLAGS)
    from serving.group import add_flags

    add_flags(p)
    p.set_defaults(func=cmd_serve)


def _add_batch(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("batch", help="run a JSONL file of prompts offline (resumable)")
    _add_engine_flags(p)
    p.add_argument("--input", required=True, help="JSONL: id, prompt or messages, "
                   "optional sampling and slo")
    p.add_argument("--output", required=True, help="JSONL results; ids in it are skipped")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_batch)


def _add_config(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="print the default deployment file (generated from "
                       "the schema), or check a file and print what it resolves to")
    p.add_argument("--config", help="a deployment YAML to check (with --set)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--write", metavar="PATH", help="write the default file to PATH")
    p.set_defaults(func=cmd_config)


def cmd_config(args: argparse.Namespace) -> int:
    import yaml

    from serving.config_schema import write_default
    from serving.deploy_config import DeploymentConfig, parse_set

    if args.config is None and not args.set:
        return write_default(args.write)
    config = DeploymentConfig.load(args.config, parse_set(args.set))
    sys.stdout.write(yaml.safe_dump(config.to_dict(), sort_keys=False))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from serving.group import group_config
    from serving.server import serve

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    for name in ("serving", "superinfer", "superinfer_jax"):  # ours; libraries stay quiet
        logging.getLogger(name).setLevel(logging.INFO)
    config = _deployment(args)
    dist = group_config(args, os.environ)  # checked before any port is bound
    if dist is None:
        return serve(config)
    from serving.group import LeaderEngine, follow_group
    from superinfer_jax.dist.distributed import GroupError

    try:
        return serve(config, LeaderEngine(dist)) if dist.is_leader \
            else follow_group(config, dist)
    except GroupError as e:  # the group did not form (a formed group's failure exits 1)
        print(f"superinfer: error: {e}", file=sys.stderr)
        return 2


def cmd_batch(args: argparse.Namespace) -> int:
    from serving.batch import BatchRunner
    from serving.server import load_draft_of
    from superinfer_jax.engine import LLMEngine

    config = _deployment(args, extra=FOREGROUND)
    engine_config = config.engine_config(show_progress=not args.no_progress)
    model = _load_model(config)
    engine = LLMEngine(model, engine_config, load_draft_of(config))
    runner = BatchRunner(engine, model.tokenizer, engine_config.default_slo,
                         show_progress=not args.no_progress,
                         tool_call_parser=config.server.tool_call_parser,
                         reasoning_parser=config.server.reasoning_parser)
    report = runner.run(args.input, args.output)
    print(f"[batch: {report.num_done} done, {report.num_errors} errors, "
          f"{report.num_skipped} skipped (already in {args.output}), {report.num_tokens} "
          f"tokens in {report.elapsed_s:.1f} s, {report.tokens_per_s:.1f} tok/s]",
          file=sys.stderr)
    return 0


# The measuring tools, as subcommands: (name, module, one-line help). Their modules are
# imported only when the command is one of them, so `superinfer serve` never imports them.
_TOOLS = {
    "bench": ("serving.bench.cli", "measure a running server (gRPC or OpenAI HTTP) on "
              "a workload: TTFT, TPOT, ITL, SLO attainment, goodput"),
    "simulate": ("superinfer_jax.sim.cli", "simulate the policies at paper scale (GH200, "
                 "H200 PCIe, ...) with a cost model"),
}


def _add_tool(sub: argparse._SubParsersAction, name: str, load: bool) -> None:
    """The ``name`` subcommand: complete (its module loaded) when it is the one run, else
    only its name and help for ``superinfer --help``."""
    module_name, help_text = _TOOLS[name]
    if not load:
        sub.add_parser(name, help=help_text, add_help=False)
        return
    module = importlib.import_module(module_name)
    p = sub.add_parser(name, help=help_text, description=module.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(p)
    if name == "simulate":  # the engine layer loads no model: ShareGPT's tokenizer is given
        from serving.bench.sharegpt import default_tokenizer

        p.set_defaults(func=lambda args: module.run(args, load_tokenizer=default_tokenizer))
    else:
        p.set_defaults(func=module.run)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; ``command`` (the first argument) says which benchmark tool, if any, to
    load (None: all of them, e.g. for documentation)."""
    parser = argparse.ArgumentParser(prog="superinfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    _add_batch(sub)
    _add_config(sub)
    for name in _TOOLS:
        _add_tool(sub, name, load=command is None or command == name)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else "").parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:
        # A ConfigError names its key. (Its module is loaded whenever one was raised; not
        # importing it here keeps `superinfer --help` and `bench` free of JAX.)
        schema = sys.modules.get("superinfer_jax.config_schema")
        if schema is not None and isinstance(e, schema.ConfigError):
            print(f"superinfer: error: {e.key}: {e.message}", file=sys.stderr)
        else:
            print(f"superinfer: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
