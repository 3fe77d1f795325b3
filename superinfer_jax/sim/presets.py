"""Paper-scale setups: a model, a dataset, the request rates swept, the engine knobs.

The rates, engine limits and SLOs (``ttft_ms``, ``tbt_ms``) are those of the SuperInfer
artifact (``AE_AIO_0309_v1.py``: 120 s of Poisson arrivals, ``ignore_eos``, recorded
output lengths). What differs, and why:
- ShareGPT output lengths are the recorded replies (``vllm bench serve``'s choice); the
  paper replayed Llama-3-8B's own, longer replies, so contention starts later here.
- LMSYS-Chat-1M cannot be fetched here; the Azure 2023 conversation trace stands in
  (much longer prompts, so its rates are chosen around the simulator's knee).
- Mooncake (prefix caching): the conversation trace replays its own timestamps scaled to
  each rate, with its 512-token hash ids as prompt content, Llama-3.1-8B's context cut at
  32k; every rate simulates the same first 3000 requests. The hardware pairs put the
  same HBM behind a superchip link and behind PCIe (gh200-144g against h200-pcie,
  gh200-96g against h100-nvl-pcie).
- Mixtral-8x7B (93 GB in bf16) runs on the 144 GB GH200 beside the 141 GB H200 PCIe;
  its fp8-weight copy (47 GB) on the 96 GB GH200 beside the 94 GB H100 NVL.
- Prefill is priced ragged (``pad=False``), as in vLLM: this engine's padded prefill
  buckets cost more than the policies differ on these models; ``--pad`` prices them.
- Quantized serving (``--weight-bytes``, ``--kv-bytes``): a preset's model with fp8
  weights (1 byte a parameter; the per-channel scales add under 0.1%) and fp8 KV (1 byte
  an element; per layer and KV head scales, negligible) at the same FLOPs a token as
  bf16 unless ``--matmul-speedup`` says the weight matmuls run faster (2: FP8 GEMMs at
  Hopper's dense fp8 peak, twice bf16's; attention stays at the bf16 rate).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from superinfer_jax.config import POLICIES, EngineConfig, RotaSchedConfig
from superinfer_jax.config_schema import ConfigError
from superinfer_jax.sched.latency import LatencyModel
from superinfer_jax.sched.rotasched.registry import resolve_policy
from superinfer_jax.sched.rotasched_config import PRESET_KEY, preset_knobs
from superinfer_jax.sim.cost import CalibratedCost, HostOverhead, RooflineCost, latency_model_of
from superinfer_jax.sim.cost_model import HARDWARE, MODELS, ModelShape, num_device_pages_for
from superinfer_jax.sim.simulator import Simulator
from superinfer_jax.sim.speculation import SpeculationSpec


def split_policy(text: str) -> tuple[str, dict[str, Any]]:
    """``name[:knob=value...]`` -> (policy name or module:Class, RotaSchedConfig
    overrides): ``rotasched:parked_replies=auto:reply_stall_cap=5``. A value reads as a
    bool, an int, a float, ``none``, or else a string; an unknown knob is a ValueError.
    ``preset=NAME`` (``ROTASCHED_PRESETS``) sets its knobs first, wherever it stands;
    the other knobs win over it: ``rotasched:preset=attainment:beta_b=10``."""
    parts = text.split(":")
    name = ":".join(x for x in parts if "=" not in x)
    fields = {f.name for f in dataclasses.fields(RotaSchedConfig)}
    preset: dict[str, Any] = {}
    knobs: dict[str, Any] = {}
    for item in (x for x in parts if "=" in x):
        key, _, value = item.partition("=")
        if key == PRESET_KEY:
            if preset:
                raise ValueError(f"policy {text!r}: {PRESET_KEY} given twice")
            try:
                preset = preset_knobs(value)
            except ConfigError as e:
                raise ValueError(f"policy {text!r}: {PRESET_KEY} {e.message}") from None
            continue
        if key not in fields:
            raise ValueError(f"policy {text!r}: {item!r} is not knob=value with knob a "
                             f"rotasched field or {PRESET_KEY} "
                             f"({', '.join(sorted(fields))})")
        knobs[key] = parse_scalar(value)
    return name, {**preset, **knobs}


def with_policy(config: EngineConfig, policy: str) -> EngineConfig:
    """``config`` running ``policy`` (``name[:knob=value...]``: ``split_policy``)."""
    name, knobs = split_policy(policy)
    return config.replace(policy=name,
                          rotasched=dataclasses.replace(config.rotasched, **knobs))


def parse_scalar(text: str) -> Any:
    """``true``/``false``, ``none``, an int, a float, or the string itself."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text.lower() in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text

THIS_MACHINE = "this-machine"  # the hardware name of a ``Calibration``


@dataclass(frozen=True)
class Calibration:
    """This machine, as the engine measured it: its profiled latency model (``profile_
    engine``, or a saved ``rotasched.latency_profile``) and the pool it was measured with."""

    latency: LatencyModel
    page_bytes: int
    num_device_pages: int
    num_host_pages: int = 0
    host: HostOverhead = HostOverhead()


def paper_engine_config() -> EngineConfig:
    """The engine knobs of a paper-scale run (the policy is set per run)."""
    return EngineConfig.build(
        page_size=16, max_model_len=8192, max_num_seqs=16384, max_num_batched_tokens=16384,
        max_prefill_chunk=2048, max_prefill_rows=4, transfer_budget_pages=2400,
        eager_shadowing=True, warmup=False, show_progress=False)


@dataclass(frozen=True)
class SimPreset:
    """One paper experiment: sweep ``rates`` x ``policies`` on each of ``hardware``."""

    name: str
    description: str
    model: str  # a key of cost_model.MODELS
    dataset: str  # a workload dataset (superinfer_jax.sim.workloads)
    rates: tuple[float, ...]  # requests per second
    duration_s: float = 120.0  # arrivals are generated for this long
    num_requests: int | None = None  # instead of duration_s: this many requests
    hardware: tuple[str, ...] = ("gh200-96g", "h200-pcie")
    policies: tuple[str, ...] = POLICIES  # registered names or module:Class paths
    ttft_ms: float = 5000.0
    tbt_ms: float = 100.0
    max_prompt: int = 4096
    max_total: int = 8192
    memory_fraction: float = 0.9
    host_memory_gb: float = 400.0
    pad: bool = False
    engine: EngineConfig = field(default_factory=paper_engine_config)
    calibration: Calibration | None = None  # makes THIS_MACHINE a hardware choice
    # The model's bytes per weight and per KV element, when not its shape's (fp8: 1 and 1)
    weight_bytes_per_param: float | None = None
    kv_bytes_per_elem: int | None = None
    matmul_speedup: float | None = None  # weight matmuls' peak over bf16's (FP8 GEMM: 2)

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {sorted(MODELS)}, got {self.model!r}")
        for hw in self.hardware:
            if hw == THIS_MACHINE and self.calibration is None:
                raise ValueError(f"hardware {THIS_MACHINE!r} needs a latency profile")
            if hw not in HARDWARE and hw != THIS_MACHINE:
                raise ValueError(f"hardware must be in {sorted(HARDWARE) + [THIS_MACHINE]}, "
                                 f"got {hw!r}")
        for p in self.policies:
            resolve_policy(split_policy(p)[0])  # a name or module:Class, else a ValueError
        if not self.rates or any(r <= 0 for r in self.rates):
            raise ValueError(f"rates must be positive, got {self.rates}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.weight_bytes_per_param is not None and not self.weight_bytes_per_param > 0:
            raise ValueError(f"weight_bytes_per_param must be positive, got "
                             f"{self.weight_bytes_per_param}")
        if self.kv_bytes_per_elem is not None and self.kv_bytes_per_elem not in (1, 2, 4):
            raise ValueError(f"kv_bytes_per_elem must be 1, 2 or 4, got {self.kv_bytes_per_elem}")
        if self.matmul_speedup is not None and not self.matmul_speedup > 0:
            raise ValueError(f"matmul_speedup must be positive, got {self.matmul_speedup}")

    @property
    def model_shape(self) -> ModelShape:
        """The cost model's shape of ``model``, with this preset's byte sizes (fp8 weights
        and KV read and move half of bf16's bytes) and weight-matmul speed (FP8 GEMMs:
        twice bf16's peak; unset, the FLOPs a token costs stay bf16's)."""
        shape = MODELS[self.model]
        if self.matmul_speedup is not None:
            shape = dataclasses.replace(shape, matmul_speedup=self.matmul_speedup)
        if self.weight_bytes_per_param is not None:
            shape = dataclasses.replace(shape,
                                        weight_bytes_per_param=self.weight_bytes_per_param)
        if self.kv_bytes_per_elem is not None:
            shape = dataclasses.replace(shape, kv_bytes_per_elem=self.kv_bytes_per_elem)
        return shape

    def simulator(self, hardware: str, policy: str, transfer_mode: str = "duplex",
                  pad: bool | None = None, speculation: SpeculationSpec | None = None
                  ) -> Simulator:
        """A simulator of this preset on ``hardware`` under ``policy`` (``speculation``:
        decode rows verify proposals, ``sim.speculation``)."""
        config = with_policy(self.engine, policy)
        policy = config.engine.policy
        if hardware == THIS_MACHINE and self.calibration is not None:
            c = self.calibration
            calibrated = CalibratedCost(c.latency, config, c.page_bytes, c.host)
            return Simulator(config, calibrated, c.num_device_pages, c.num_host_pages, c.latency,
                             speculation)
        if hardware not in HARDWARE:
            raise ValueError(f"hardware must be one of {sorted(HARDWARE)}, got {hardware!r}")
        model, hw = self.model_shape, HARDWARE[hardware]
        cost = RooflineCost(model, hw, config, pad=self.pad if pad is None else pad,
                            transfer_mode=transfer_mode)
        pages = num_device_pages_for(model, hw, config.hardware.page_size, self.memory_fraction)
        host = int(self.host_memory_gb * (1 << 30)) // cost.page_bytes
        uses_latency = getattr(resolve_policy(policy), "uses_latency", False)
        latency = latency_model_of(cost, config) if uses_latency else None
        return Simulator(config, cost, pages, host, latency, speculation)


PRESETS: dict[str, SimPreset] = {p.name: p for p in (
    SimPreset("paper-qwen32b-sharegpt", "Qwen2.5-32B, ShareGPT, the paper's rates",
              "qwen2.5-32b", "sharegpt", (5, 10, 13, 15, 18, 20)),
    SimPreset("paper-llama8b-sharegpt", "Llama-3-8B, ShareGPT, the paper's rates",
              "llama-3-8b", "sharegpt", (35, 40, 45, 50, 55, 60)),
    SimPreset("paper-qwen32b-azure-conv", "Qwen2.5-32B, Azure 2023 conversation lengths "
              "(stand-in for LMSYS)", "qwen2.5-32b", "azure_conv", (1, 2, 3, 4, 5, 6)),
    SimPreset("paper-llama8b-azure-conv", "Llama-3-8B, Azure 2023 conversation lengths "
              "(stand-in for LMSYS)", "llama-3-8b", "azure_conv", (5, 10, 15, 20, 25, 30)),
    SimPreset("paper-llama8b-mooncake-conv", "Llama-3(.1)-8B, Mooncake conversation trace "
              "with its prefix hash ids (prefix caching), 32k context",
              "llama-3-8b", "mooncake_conv", (0.5, 1, 1.5, 2, 2.5, 3), num_requests=3000,
              hardware=("gh200-144g", "h200-pcie", "gh200-96g", "h100-nvl-pcie"),
              max_prompt=32767, max_total=32768,
              engine=paper_engine_config().replace(max_model_len=32768)),
    SimPreset("paper-mixtral8x7b-sharegpt", "Mixtral-8x7B (MoE, bf16), ShareGPT, the "
              "paper's rates", "mixtral-8x7b", "sharegpt", (5, 10, 13, 15, 18, 20),
              hardware=("gh200-144g", "h200-pcie")),
    SimPreset("paper-mixtral8x7b-fp8-sharegpt", "Mixtral-8x7B (MoE, fp8 weights), "
              "ShareGPT, the paper's rates", "mixtral-8x7b-fp8", "sharegpt",
              (5, 10, 13, 15, 18, 20), hardware=("gh200-96g", "h100-nvl-pcie")),
    SimPreset("paper-mixtral8x7b-azure-conv", "Mixtral-8x7B (MoE, bf16), Azure 2023 "
              "conversation lengths (stand-in for LMSYS)", "mixtral-8x7b", "azure_conv",
              (4, 6, 8, 10, 12, 14), hardware=("gh200-144g", "h200-pcie")),
)}


def get_preset(name: str) -> SimPreset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]

