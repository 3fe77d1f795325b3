"""Hardware cost model for the simulator: a roofline per step and per-direction transfers.

A model step costs ``max(bytes / HBM bandwidth, flops / compute) + overhead`` (bytes: the
weights, the KV read and the KV written; flops: ``2 * params`` per token plus attention's
``4 * heads * head_dim`` per (query, key) pair). A mixture-of-experts model
(``num_experts > 0``) does ``2 * active params`` per token and reads its dense weights
(attention, router, embeddings) plus only the experts the step's tokens touch: with
top-``k`` of ``E`` routed uniformly, ``B`` tokens touch ``E * (1 - (1 - k/E)^B)``
experts a layer on average (``expected_experts``); every expert stays resident in HBM.
A page transfer costs a per-copy overhead plus bytes over its direction's link; on a
superchip both directions share the host DRAM bandwidth. Two ways to move the same
bytes, priced apart:
- *naive*: one synchronous copy per (page, layer, K|V) plane, as a per-layer pool forces
  (vLLM's swap), each paying ``copy_overhead_s``;
- *batched* (DuplexKV, block-first pages): one batch of whole-page copies, paying
  ``batch_overhead_s`` once and ``batched_copy_overhead_s`` per page (pipelined).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs to know about a model (no weights)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    weight_bytes_per_param: float = 2.0  # bf16; FP8 = 1
    kv_bytes_per_elem: int = 2
    # The weight matmuls' peak against bf16's: 2 for fp8 weights computed as FP8 GEMMs
    # (Hopper's dense fp8 rate); attention stays at the bf16 rate.
    matmul_speedup: float = 1.0
    num_experts: int = 0  # 0: dense; else every layer's MLP is this many routed experts
    experts_per_token: int = 0  # top-k
    expert_intermediate_size: int = 0  # each expert's SwiGLU width

    def __post_init__(self) -> None:
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"{self.name}: experts_per_token must be in 1..num_experts "
                             f"({self.num_experts}), got {self.experts_per_token}")
        if self.num_experts and self.expert_intermediate_size <= 0:
            raise ValueError(f"{self.name}: expert_intermediate_size must be positive")

    @property
    def num_params(self) -> int:
        if self.num_experts:
            return self.dense_params + self.num_layers * self.num_experts * self.expert_params
        d, f = self.hidden_size, self.intermediate_size
        attn = d * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        return self.num_layers * (attn + 3 * d * f) + 2 * self.vocab_size * d

    @property
    def dense_params(self) -> int:
        """Parameters every token uses: attention, the dense MLP (``intermediate_size``,
        0 in an all-MoE model), the router and the embeddings (all of them when dense)."""
        if not self.num_experts:
            return self.num_params
        d, f = self.hidden_size, self.intermediate_size
        attn = d * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        router = d * self.num_experts
        return self.num_layers * (attn + 3 * d * f + router) + 2 * self.vocab_size * d

    @property
    def expert_params(self) -> int:
        """One expert of one layer (gate, up and down projections); 0 when dense."""
        return 3 * self.hidden_size * self.expert_intermediate_size

    @property
    def active_params(self) -> int:
        """Parameters one token computes with (all of them when dense)."""
        if not self.num_experts:
            return self.num_params
        return self.dense_params + self.num_layers * self.experts_per_token * \
            self.expert_params

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.weight_bytes_per_param

    def expected_experts(self, num_tokens: int) -> float:
        """Distinct experts ``num_tokens`` tokens touch in one layer, on average, each
        choosing ``experts_per_token`` of ``num_experts`` uniformly: an expert is missed
        by one token with probability ``1 - k/E``, by all of them ``(1 - k/E)^B``."""
        if not self.num_experts or num_tokens <= 0:
            return 0.0
        e = self.num_experts
        return e * (1.0 - (1.0 - self.experts_per_token / e) ** num_tokens)

    def weight_bytes_read(self, num_tokens: int) -> float:
        """Weight bytes a step over ``num_tokens`` tokens reads: all of them when dense;
        the dense weights plus the experts the tokens touch when MoE."""
        if not self.num_experts:
            return self.weight_bytes
        experts = self.num_layers * self.expected_experts(num_tokens) * self.expert_params
        return (self.dense_params + experts) * self.weight_bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_elem

    def page_bytes(self, page_size: int) -> int:
        return self.kv_bytes_per_token * page_size


MODELS: dict[str, ModelShape] = {
    "smollm2-135m": ModelShape("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, 4.0, 4),
    "llama-3-8b": ModelShape("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256),
    "qwen2.5-32b": ModelShape("qwen2.5-32b", 64, 5120, 40, 8, 128, 27648, 152064),
    "llama-3-70b-fp8": ModelShape("llama-3-70b-fp8", 80, 8192, 64, 8, 128, 28672, 128256,
                                  weight_bytes_per_param=1.0),
    # Mixture of experts (no dense MLP; every layer routed): 46.7B parameters, 12.9B
    # active; the fp8 copy (weights only; KV and compute stay bf16) fits gh200-96g.
    "mixtral-8x7b": ModelShape("mixtral-8x7b", 32, 4096, 32, 8, 128, 0, 32000,
                               num_experts=8, experts_per_token=2,
                               expert_intermediate_size=14336),
    "mixtral-8x7b-fp8": ModelShape("mixtral-8x7b-fp8", 32, 4096, 32, 8, 128, 0, 32000,
                                   weight_bytes_per_param=1.0, num_experts=8,
                                   experts_per_token=2, expert_intermediate_size=14336),
    # Qwen3-MoE: 30.5B / 3.3B active and 235B / 22B active (the latter fits no single
    # device here, in bf16 or fp8: a cost-model shape, no preset).
    "qwen3-30b-a3b": ModelShape("qwen3-30b-a3b", 48, 2048, 32, 4, 128, 0, 151936,
                                num_experts=128, experts_per_token=8,
                                expert_intermediate_size=768),
    "qwen3-235b-a22b": ModelShape("qwen3-235b-a22b", 94, 4096, 64, 4, 128, 0, 151936,
                                  num_experts=128, experts_per_token=8,
                                  expert_intermediate_size=1536),
}


@dataclass(frozen=True)
class Hardware:
    """One accelerator and its host link. Bandwidths in bytes/s, times in seconds."""

    name: str
    hbm_bytes: float
    hbm_bandwidth: float
    compute_flops: float  # dense bf16 peak the step can reach
    link_bandwidth_one_way: float  # one direction alone
    link_bandwidth_duplex: float  # each direction when both run at once
    copy_overhead_s: float  # fixed cost of one copy issued alone (launch, descriptor, sync)
    step_overhead_s: float  # fixed cost of one model call (launches, host work)
    compute_efficiency: float = 0.6  # achieved share of peak for large matmuls
    bandwidth_efficiency: float = 0.8  # achieved share of peak HBM bandwidth
    batched_copy_overhead_s: float = 0.6e-6  # per page inside one pipelined batch
    batch_overhead_s: float = 20e-6  # once per batch (one launch and one completion event)


HARDWARE: dict[str, Hardware] = {
    # GH200: HBM3 ~4 TB/s; NVLink-C2C 450 GB/s a way, but host LPDDR5X (~384 GB/s) is
    # shared, so duplex gets ~190 GB/s each way (the paper measured 181 + 179).
    # copy_overhead_s 3 us: a 32 KiB plane then moves at ~10 GB/s (the paper's naive
    # offload); 0.6 us per batched 2 MiB page gives ~180 GB/s of the 190 (paper: 181).
    "gh200-96g": Hardware("gh200-96g", 96e9, 4.0e12, 989e12, 380e9, 190e9, 3e-6, 2e-3),
    "gh200-144g": Hardware("gh200-144g", 144e9, 4.9e12, 989e12, 380e9, 190e9, 3e-6, 2e-3),
    # PCIe Gen5 x16: ~55 GB/s each way, full duplex (separate lanes), so duplex == one way.
    "h100-pcie": Hardware("h100-pcie", 80e9, 3.35e12, 989e12, 55e9, 55e9, 10e-6, 2e-3,
                          batched_copy_overhead_s=1e-6),
    "h200-pcie": Hardware("h200-pcie", 141e9, 4.8e12, 989e12, 55e9, 55e9, 10e-6, 2e-3,
                          batched_copy_overhead_s=1e-6),
    # H100 NVL: 94 GB at 3.9 TB/s on PCIe Gen5, dense bf16 835 TFLOP/s. Next to gh200-96g
    # (96 GB, 4 TB/s) it isolates what the link is worth at the same KV capacity.
    "h100-nvl-pcie": Hardware("h100-nvl-pcie", 94e9, 3.9e12, 835e12, 55e9, 55e9, 10e-6, 2e-3,
                              batched_copy_overhead_s=1e-6),
}


def num_device_pages_for(model: ModelShape, hw: Hardware, page_size: int,
                         memory_fraction: float = 0.9) -> int:
    """KV pages that fit: ``(HBM * fraction - weights) / page bytes``, plus the null page
    (activations and scratch fit in what ``fraction`` leaves)."""
    free = hw.hbm_bytes * memory_fraction - model.weight_bytes
    pages = int(free // model.page_bytes(page_size))
    if pages < 1:
        raise ValueError(f"{model.name} ({model.weight_bytes / 1e9:.1f} GB of weights) does "
                         f"not fit in {memory_fraction:.0%} of {hw.name}'s "
                         f"{hw.hbm_bytes / 1e9:.0f} GB")
    return pages + 1


@dataclass
class StepWork:
    """What one model step does, in counts the roofline prices (``__init__`` written out:
    ``NATIVE_INIT`` in mypyc_build)."""

    num_tokens: int  # query tokens (prefill chunk tokens + decode rows)
    kv_tokens_read: int  # sum over rows of the context each row attends to
    attn_pairs: int  # sum over query tokens of the keys each one sees

    def __init__(self, num_tokens: int, kv_tokens_read: int, attn_pairs: int) -> None:
        self.num_tokens = num_tokens
        self.kv_tokens_read = kv_tokens_read
        self.attn_pairs = attn_pairs


def step_time(model: ModelShape, hw: Hardware, work: StepWork) -> float:
    if work.num_tokens == 0:
        return 0.0
    kv_read = work.kv_tokens_read * model.kv_bytes_per_token
    kv_write = work.num_tokens * model.kv_bytes_per_token
    mem_s = (model.weight_bytes_read(work.num_tokens) + kv_read + kv_write) / \
        (hw.hbm_bandwidth * hw.bandwidth_efficiency)
    flops = 2 * model.active_params * work.num_tokens / model.matmul_speedup + \
        4 * model.num_heads * model.head_dim * model.num_layers * work.attn_pairs
    compute_s = flops / (hw.compute_flops * hw.compute_efficiency)  # bf16-equivalent
    return max(mem_s, compute_s) + hw.step_overhead_s


def transfer_time(hw: Hardware, num_bytes: int, num_copies: int, duplex: bool,
                  batched: bool = False) -> float:
    """Seconds to move ``num_bytes`` in ``num_copies`` copies one way; ``duplex``: the
    other direction runs meanwhile (shared host DRAM on a superchip)."""
    if num_bytes <= 0:
        return 0.0
    bw = hw.link_bandwidth_duplex if duplex else hw.link_bandwidth_one_way
    if batched:
        return hw.batch_overhead_s + num_copies * hw.batched_copy_overhead_s + num_bytes / bw
    return num_copies * hw.copy_overhead_s + num_bytes / bw
