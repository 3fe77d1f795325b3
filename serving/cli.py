"""``superinfer``: thin command-line wiring from flags to library calls."""

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="superinfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"superinfer: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
