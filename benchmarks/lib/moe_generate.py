"""The random MoE checkpoint ``benchmarks.moe`` times, and greedy decoding on it in this
engine and in transformers' ``generate``.

The checkpoint is built by transformers itself (``MixtralConfig``, its own random
initialisation) and written with ``save_pretrained``, so both sides read the same file:
this engine through ``models.load_model`` on the directory, transformers through
``from_pretrained``.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from models.config import ModelConfig
from models.servable import LlamaServable


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """The benchmark model: a Mixtral of ``experts`` SwiGLU experts, ``top_k`` per token."""

    experts: int = 16
    top_k: int = 2
    hidden: int = 512
    expert_size: int = 512  # each expert's intermediate size
    layers: int = 4
    vocab: int = 1024

    def __post_init__(self) -> None:
        if self.hidden % 128:
            raise ValueError(f"hidden must be a multiple of 128 (heads of 64, half as many "
                             f"KV heads), got {self.hidden}")


def write_mixtral(path: str | Path, shape: MoEShape, seed: int = 0) -> Path:
    """A random ``MixtralForCausalLM`` of ``shape`` (transformers' own init, float32),
    saved with ``save_pretrained`` (safetensors) in ``path``."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.expert_size,
        num_hidden_layers=shape.layers, num_attention_heads=shape.hidden // 64,
        num_key_value_heads=shape.hidden // 128, head_dim=64,
        num_local_experts=shape.experts, num_experts_per_tok=shape.top_k,
        max_position_embeddings=2048, rope_theta=1e6, rms_norm_eps=1e-5,
        sliding_window=None, bos_token_id=1, eos_token_id=shape.vocab - 1,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = MixtralForCausalLM(config).eval()
    path = Path(path)
    model.save_pretrained(path)
    _write_tokenizer(path, shape.vocab)
    return path


def _write_tokenizer(path: Path, vocab: int) -> None:
    """A word-level ``tokenizer.json`` (``t0`` .. ``t{vocab-1}``): ``models.load_model``
    wants one beside the weights; the benchmark feeds token ids, never text."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


def dense_twin(config: ModelConfig) -> ModelConfig:
    """The dense model with the MoE's active parameters: the same attention and
    embeddings, one SwiGLU MLP of intermediate size ``top_k x expert size``."""
    moe = config.moe
    if moe is None:
        raise ValueError(f"{config.name}: not a mixture-of-experts config")
    return dataclasses.replace(config, name=f"{config.name}-dense", moe=None,
                               intermediate_size=moe.top_k * moe.intermediate_size)


def engine_generate(model: LlamaServable, prompts: np.ndarray, new_tokens: int
                    ) -> tuple[float, np.ndarray]:
    """Greedy ``new_tokens`` for every prompt row at once through ``LLMEngine`` (EOS
    ignored; the per-expert counts off, as in serving): (output tok/s end to end, prefill
    included, compile excluded; tokens [rows, new_tokens])."""
    from superinfer_jax import EngineConfig, LLMEngine, SamplingParams
    from superinfer_jax.config import default_kv_dtype

    model.expert_counts = None
    rows, prompt_len = prompts.shape
    engine = LLMEngine(model, EngineConfig.build(
        max_model_len=prompt_len + new_tokens + 16, max_num_seqs=rows,
        max_prefill_chunk=prompt_len, max_num_batched_tokens=rows * prompt_len,
        dtype=default_kv_dtype(model.dtype), warmup=False))
    sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True)

    def run(prompts: np.ndarray) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        ids = [engine.add_request(p.tolist(), sp) for p in prompts]
        while engine.has_unfinished_requests():
            engine.step()
        elapsed = time.perf_counter() - start
        out = [list(engine.requests[i].output_token_ids) for i in ids]
        for i in ids:
            engine.release(i)
        return elapsed, out

    # compiles every step shape this batch takes; other tokens, so no prefix-cache hit
    run(np.where(prompts > 2, prompts - 1, prompts + 1))
    elapsed, out = run(prompts)
    return rows * new_tokens / elapsed, np.asarray(out)


def hf_generate(model, prompts: np.ndarray, new_tokens: int) -> tuple[float, np.ndarray]:
    """The same with transformers' ``generate`` (greedy, torch.inference_mode); a short
    first call keeps one-time overhead out of the timing."""
    import torch

    ids = torch.tensor(prompts, dtype=torch.long)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        elapsed = time.perf_counter() - start
    return prompts.shape[0] * new_tokens / elapsed, out[:, prompts.shape[1]:].numpy()


def hf_setup(model) -> str:
    """How the transformers baseline runs (versions, attention and experts kernels), so a
    reader can tell a fair baseline from a hobbled one."""
    import torch
    import transformers

    cfg = model.config
    return (f"transformers {transformers.__version__}, torch {torch.__version__}, "
            f"attention {getattr(cfg, '_attn_implementation', None)}, "
            f"experts {getattr(cfg, '_experts_implementation', None)}, inference_mode")


def generate_row(path: Path, model: LlamaServable, batch: int, prompt_len: int,
                 new_tokens: int) -> dict:
    """One dtype and batch: this engine and transformers on the checkpoint at ``path``
    (``model`` is it loaded by ``models.load_model`` in that dtype)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[model.dtype]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
    prompts = np.random.default_rng(batch).integers(2, model.vocab_size - 1,
                                                    (batch, prompt_len))
    ours, our_tokens = engine_generate(model, prompts, new_tokens)
    # torch's threads spin-wait for one another: on a shared machine one thread can be far
    # faster than its default; the baseline gets the faster of the two
    default_threads = torch.get_num_threads()
    runs = {}
    for threads in sorted({1, default_threads}):
        torch.set_num_threads(threads)
        runs[threads] = hf_generate(hf, prompts, new_tokens)
    torch.set_num_threads(default_threads)
    hf_threads = max(runs, key=lambda t: runs[t][0])
    theirs, their_tokens = runs[hf_threads]
    same = (our_tokens == their_tokens).all(axis=0)
    return {"dtype": model.dtype, "batch": batch, "new_tokens": new_tokens,
            "engine_tok_s": round(ours, 1), "hf_tok_s": round(theirs, 1),
            "engine_over_hf": round(ours / theirs, 2), "hf_threads": hf_threads,
            "hf_setup": hf_setup(hf),
            # greedy agreement: leading tokens identical in every row (a near-tie in a
            # random model's logits, or bfloat16 rounding, can part the two later)
            "same_leading_tokens": int(np.argmin(same)) if not same.all() else len(same)}
