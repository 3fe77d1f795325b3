"""The deployment file (``superinfer_config.yaml``): what to serve, on what, and how.

Sections ``model``, ``hardware``, ``rotasched``, ``duplex_kv`` and ``server``, each a
frozen dataclass whose fields are the file's keys. The schema lives in the field
metadata (choices, bounds), so loading, validation and the error message come from one
place: an unknown key or a bad value is a ``ValueError`` naming it (``rotasched.alpha``).

Command-line flags override the file key by key (``apply_overrides``), before
validation, so a flag is checked exactly like the file.

``engine_config()`` maps what ``EngineConfig`` supports onto it. Keys the engine does not
have yet (a scheduling knob of a policy still being built, say) are kept, validated and
listed by ``not_applied()``, so the server can say at start which settings do nothing.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from superinfer_jax.config import (
    POLICIES,
    RANKING_MODES,
    EngineConfig,
    RotaSchedConfig,
    default_kv_dtype,
)
from superinfer_jax.request import SLO

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_COMPILATION_CACHE = "~/.cache/superinfer/xla"


def _key(default: Any, *, choices: tuple[Any, ...] | None = None, ge: float | None = None,
         gt: float | None = None, le: float | None = None) -> Any:
    meta = {"choices": choices, "ge": ge, "gt": gt, "le": le}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ModelSection:
    name: str | None = _key(None)  # a preset (loaded) or, with ``path``, the served name
    path: str | None = _key(None)  # HF dir, .gguf or Orbax dir
    dtype: str = _key("float32", choices=("float32", "bfloat16"))
    kv_cache_dtype: str = _key("auto", choices=("auto", "float32", "bfloat16"))
    max_model_len: int = _key(2048, ge=2)
    tensor_parallel_size: int = _key(1, ge=1)  # devices of the "tp" mesh (one host)

    @property
    def source(self) -> str:
        """What ``load_model`` gets: the path when set, else the preset name."""
        return self.path or self.name or DEFAULT_MODEL

    @property
    def served_name(self) -> str:
        """The name clients use (OpenAI ``model``, ``GetModelInfo``)."""
        if self.name:
            return self.name
        if self.path:
            return Path(self.path).name or self.path
        return DEFAULT_MODEL

    @property
    def resolved_kv_cache_dtype(self) -> str:
        if self.kv_cache_dtype == "auto":
            return default_kv_dtype(self.dtype)
        return self.kv_cache_dtype


@dataclass(frozen=True)
class HardwareSection:
    hbm_memory_fraction: float = _key(0.9, gt=0, le=1)
    num_device_pages: int | None = _key(None, ge=2)
    cpu_memory_buffer_gb: float = _key(2.0, ge=0)
    page_size: int = _key(16, ge=1)
    attention_backend: str = _key("auto", choices=("auto", "xla", "pallas"))
    compilation_cache_dir: str = _key(DEFAULT_COMPILATION_CACHE)  # "" disables

    def check(self) -> None:
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"hardware.page_size must be a power of two, got {self.page_size}")


@dataclass(frozen=True)
class RotaSchedSection:
    policy: str = _key("rotasched", choices=POLICIES)
    ttft_slo_target_ms: float = _key(5000.0, gt=0, le=3_600_000)
    tbt_slo_target_ms: float = _key(100.0, gt=0, le=3_600_000)
    proactive_eviction_threshold: float = _key(0.85, gt=0, le=1)
    alpha: float = _key(3.0, ge=0)
    beta_f: float = _key(0.5, ge=0)
    beta_b: float = _key(0.0, ge=0)
    transfer_budget_pages: int = _key(2400, ge=1)
    max_num_seqs: int = _key(32, ge=1)
    max_num_batched_tokens: int = _key(512, ge=1)
    max_prefill_chunk: int | None = _key(None, ge=1)  # default: min(256, batched tokens)
    seed: int = _key(0, ge=0)
    mode: str = _key("vlt", choices=RANKING_MODES)  # rank by virtual lag or predicted slack
    async_scheduling: bool = _key(True)  # plan step t+1 while step t runs
    latency_profile: str | None = _key(None)  # JSON latency model (slack mode); profiled if absent

    def check(self) -> None:
        chunk = self.max_prefill_chunk
        if chunk is not None and chunk > self.max_num_batched_tokens:
            raise ValueError(
                f"rotasched.max_prefill_chunk ({chunk}) must not exceed "
                f"rotasched.max_num_batched_tokens ({self.max_num_batched_tokens})")


@dataclass(frozen=True)
class DuplexKVSection:
    eager_shadowing: bool = _key(True)
    staging_buffer_mb: float = _key(64.0, gt=0)
    num_host_pages: int | None = _key(None, ge=0)


@dataclass(frozen=True)
class ServerSection:
    host: str = _key("127.0.0.1")
    grpc_port: int = _key(50051, ge=1, le=65535)
    http_port: int = _key(8000, ge=1, le=65535)
    enable_grpc: bool = _key(True)
    enable_http: bool = _key(True)
    api_key: str | None = _key(None)
    tls_cert: str | None = _key(None)
    tls_key: str | None = _key(None)
    max_queue_len: int = _key(256, ge=1)
    drain_grace_s: float = _key(30.0, ge=0)
    max_request_bytes: int = _key(1 << 20, ge=1024)  # larger requests are refused
    warmup: bool = _key(True)
    # HTTP: refuse unknown body fields with a 400 (default: ignore them and log each name
    # once, as vLLM does; clients send vendor extensions). gRPC always refuses them.
    strict_request_fields: bool = _key(False)

    def check(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("server.tls_cert and server.tls_key must be given together")
        for name in ("tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not Path(path).expanduser().is_file():
                raise ValueError(f"server.{name}: no such file {path!r}")
        if self.api_key == "":
            raise ValueError("server.api_key must not be empty (omit it to disable auth)")
        if not (self.enable_grpc or self.enable_http):
            raise ValueError("server.enable_grpc and server.enable_http are both false")


SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "hardware": HardwareSection,
    "rotasched": RotaSchedSection,
    "duplex_kv": DuplexKVSection,
    "server": ServerSection,
}

# yaml key -> EngineConfig field, applied when the engine has that field. Host-tier and
# policy keys land here as the engine grows them, with no change to the file format.
_ENGINE_OPTIONAL = {
    "rotasched.policy": "policy",
    "rotasched.transfer_budget_pages": "transfer_budget_pages",
    "hardware.cpu_memory_buffer_gb": "host_memory_gb",
    "duplex_kv.eager_shadowing": "eager_shadowing",
    "duplex_kv.staging_buffer_mb": "staging_buffer_mb",
    "duplex_kv.num_host_pages": "num_host_pages",
}

_ENGINE_DIRECT = {
    "hardware.page_size": "page_size",
    "hardware.num_device_pages": "num_device_pages",
    "hardware.hbm_memory_fraction": "device_memory_fraction",
    "hardware.attention_backend": "attention_backend",
    "hardware.compilation_cache_dir": "compilation_cache_dir",
    "model.max_model_len": "max_model_len",
    "model.kv_cache_dtype": "dtype",
    "model.tensor_parallel_size": "tensor_parallel_size",
    "rotasched.max_num_seqs": "max_num_seqs",
    "rotasched.max_num_batched_tokens": "max_num_batched_tokens",
    "rotasched.max_prefill_chunk": "max_prefill_chunk",
    "rotasched.seed": "seed",
    "rotasched.async_scheduling": "async_scheduling",
    "server.warmup": "warmup",
}


@dataclass(frozen=True)
class DeploymentConfig:
    model: ModelSection = field(default_factory=ModelSection)
    hardware: HardwareSection = field(default_factory=HardwareSection)
    rotasched: RotaSchedSection = field(default_factory=RotaSchedSection)
    duplex_kv: DuplexKVSection = field(default_factory=DuplexKVSection)
    server: ServerSection = field(default_factory=ServerSection)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> DeploymentConfig:
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ValueError(f"config must be a mapping of sections, got {type(data).__name__}")
        sections = {}
        for name, value in data.items():
            if name not in SECTIONS:
                raise ValueError(
                    f"unknown section {name!r} (expected one of {', '.join(SECTIONS)})")
            sections[name] = _build_section(name, SECTIONS[name], value)
        return cls(**sections)

    @classmethod
    def load(cls, path: str | Path | None = None,
             overrides: dict[str, Any] | None = None) -> DeploymentConfig:
        """Read the YAML file (if any), apply ``section.key`` overrides, validate."""
        data: dict[str, Any] = {}
        if path is not None:
            try:
                text = Path(path).expanduser().read_text(encoding="utf-8")
                data = yaml.safe_load(text) or {}
            except OSError as e:
                raise ValueError(f"cannot read config {path}: {e.strerror}") from e
            except yaml.YAMLError as e:
                raise ValueError(f"{path}: invalid YAML: {e}") from e
        return cls.from_dict(apply_overrides(data, overrides or {}))

    def engine_config(self, show_progress: bool = True) -> EngineConfig:
        """The ``EngineConfig`` this deployment asks for; errors name the YAML key."""
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        kwargs: dict[str, Any] = {"show_progress": show_progress}
        for key, engine_field in (_ENGINE_DIRECT | _ENGINE_OPTIONAL).items():
            if engine_field in known:
                kwargs[engine_field] = self.get(key)
        kwargs["dtype"] = self.model.resolved_kv_cache_dtype
        kwargs["compilation_cache_dir"] = (
            str(Path(self.hardware.compilation_cache_dir).expanduser())
            if self.hardware.compilation_cache_dir else None)
        if self.rotasched.max_prefill_chunk is None:
            kwargs["max_prefill_chunk"] = min(256, self.rotasched.max_num_batched_tokens)
        kwargs["default_slo"] = SLO(self.rotasched.ttft_slo_target_ms,
                                    self.rotasched.tbt_slo_target_ms)
        rs = self.rotasched
        try:
            kwargs["rotasched"] = RotaSchedConfig(
                alpha=rs.alpha, beta_f=rs.beta_f, beta_b=rs.beta_b,
                high_water_mark=rs.proactive_eviction_threshold, mode=rs.mode,
                latency_profile=rs.latency_profile)
        except ValueError as e:
            raise ValueError(_name_yaml_key(str(e))) from e
        try:
            return EngineConfig(**kwargs)
        except (TypeError, ValueError) as e:
            raise ValueError(_name_yaml_key(str(e))) from e

    def not_applied(self) -> list[str]:
        """YAML keys (with values) that this engine build does not act on."""
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        out = []
        for key, engine_field in _ENGINE_OPTIONAL.items():
            value = self.get(key)
            if engine_field in known or value is None:
                continue
            out.append(f"{key}={value!r}")
        return out

    def get(self, dotted: str) -> Any:
        section, key = dotted.split(".", 1)
        return getattr(getattr(self, section), key)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


UNSET = object()  # an override value that removes the key (back to the default)


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Copy of ``data`` with ``{"section.key": value}`` set. None values are skipped (a
    flag not given); ``UNSET`` removes the key."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for dotted, value in overrides.items():
        if value is None:
            continue
        if dotted.count(".") != 1:
            raise ValueError(f"override {dotted!r} must look like section.key")
        section, key = dotted.split(".")
        target = out.setdefault(section, {})
        if not isinstance(target, dict):
            raise ValueError(f"section {section!r} must be a mapping")
        if value is UNSET:
            target.pop(key, None)
        else:
            target[key] = value
    return out


def parse_set(items: list[str]) -> dict[str, Any]:
    """``["rotasched.alpha=2", ...]`` from ``--set``, values parsed as YAML scalars."""
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected section.key=value")
        try:
            out[key.strip()] = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ValueError(f"--set {item!r}: bad value ({e})") from e
    return out


def _build_section(name: str, cls: type, value: Any) -> Any:
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ValueError(f"section {name!r} must be a mapping, got {type(value).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key, item in value.items():
        if key not in fields:
            raise ValueError(
                f"unknown key {name}.{key} (known: {', '.join(sorted(fields))})")
        _check_value(f"{name}.{key}", item, hints[key], fields[key].metadata)
    section = cls(**value)
    section_check = getattr(section, "check", None)
    if section_check is not None:
        section_check()
    return section


def _check_value(path: str, value: Any, hint: Any, meta: Any) -> None:
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None:
        if type(None) not in allowed:
            raise ValueError(f"{path} must not be null")
        return
    base = next(t for t in allowed if t is not type(None))
    if base is bool:
        ok = isinstance(value, bool)
    elif base is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool) \
            and math.isfinite(value)
    else:
        ok = isinstance(value, base)
    if not ok:
        raise ValueError(f"{path} must be {_type_word(base)}, got {value!r}")
    if meta.get("choices") is not None and value not in meta["choices"]:
        raise ValueError(f"{path} must be one of {list(meta['choices'])}, got {value!r}")
    for bound, test, word in (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                              ("le", lambda v, b: v <= b, "<=")):
        b = meta.get(bound)
        if b is not None and not test(value, b):
            raise ValueError(f"{path} must be {word} {b}, got {value!r}")


def _type_word(t: type) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        t, t.__name__)


def _name_yaml_key(message: str) -> str:
    for key, engine_field in (_ENGINE_DIRECT | _ENGINE_OPTIONAL).items():
        if message.startswith(engine_field) or f" {engine_field} " in message:
            return f"{key}: {message}"
    return f"engine config: {message}"
