"""What llama.cpp's convert_hf_to_gguf.py writes for Mixtral (arch "llama", Q/K rows
permuted, experts merged into ``ffn_*_exps``), Qwen3 ("qwen3") and Qwen3-MoE
("qwen3moe"), float32 tensors: the GGUF copies of the tiny transformers checkpoints."""

from __future__ import annotations

import json

import gguf
import numpy as np

_ARCH = {"mixtral": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3moe"}
_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim in numpy."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _metadata(writer: gguf.GGUFWriter, cfg, tokenizer, chat_template: str) -> None:
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if cfg.model_type in ("mixtral", "qwen3_moe"):
        writer.add_expert_count(getattr(cfg, "num_local_experts", None) or cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
    if cfg.model_type == "qwen3_moe":
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_expert_weights_norm(bool(cfg.norm_topk_prob))
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), cfg.vocab_size)]
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_eos_token_id(2)
    writer.add_chat_template(chat_template)


def write_gguf(model, tokenizer, path, chat_template: str, skip: tuple[str, ...] = (),
               q8_0: bool = False) -> None:
    """``model`` (transformers) as a GGUF at ``path``; tensors named in ``skip`` are left
    out (a broken file for the error tests); ``q8_0``: every matrix but the embedding
    (projections, experts, router) stored in llama.cpp's Q8_0 blocks."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), _ARCH[cfg.model_type])
    _metadata(writer, cfg, tokenizer, chat_template)
    permute = cfg.model_type == "mixtral"
    tensors: dict[str, np.ndarray] = {}
    for name, tensor in model.state_dict().items():
        w = tensor.numpy().astype(np.float32)
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            tensors[{"model.embed_tokens.weight": "token_embd.weight",
                     "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]] = w
            continue
        _, _, layer, *rest = name.split(".")
        if rest[-1] == "gate_up_proj":  # transformers' fused [experts, 2 * ffn, hidden]
            gate, up = np.split(w, 2, axis=1)
            tensors[f"blk.{layer}.ffn_gate_exps.weight"] = gate
            tensors[f"blk.{layer}.ffn_up_exps.weight"] = up
            continue
        if rest[-1] == "down_proj" and "experts" in rest:  # [experts, hidden, ffn]
            tensors[f"blk.{layer}.ffn_down_exps.weight"] = w
            continue
        if permute and "q_proj" in name:
            w = llama_cpp_permute(w, cfg.num_attention_heads)
        elif permute and "k_proj" in name:
            w = llama_cpp_permute(w, cfg.num_key_value_heads)
        tensors[f"blk.{layer}.{_NAMES['.'.join(rest[:-1])]}.{rest[-1]}"] = w
    for out, w in tensors.items():
        if out in skip:
            continue
        if q8_0 and w.ndim >= 2 and out != "token_embd.weight":
            kind = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(out, gguf.quants.quantize(np.ascontiguousarray(w), kind),
                              raw_dtype=kind)
        else:
            writer.add_tensor(out, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
