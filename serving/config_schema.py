"""The deployment file's schema, derived from the configuration dataclasses.

Every key of ``superinfer_config.yaml`` is a dataclass field:

- the server's own keys are the fields of ``ModelSection`` and ``ServerSection`` (below);
- every engine knob is a field of one of ``EngineConfig``'s sections
  (``superinfer_jax.config``): ``EngineConfig.hardware`` is the ``hardware:`` section,
  and so on, one key per field (the ``model:`` section holds ``ModelSection``'s keys and
  ``EngineConfig.model``'s).

So a key's section, name, type, bounds and help text are written once, on the field, and
checked by the one validator (``superinfer_jax.config_schema.check_value``). Each key has
one default, its field's. What this module adds is what a dataclass cannot say: the values
a file may give beyond the field's (``FILE_VALUES``: ``auto`` and the like), the profiles
that set some keys for a kind of deployment (``PROFILES``: ``server``, the file's default,
and ``library``), keys that were renamed or moved (``MOVED``) or removed (``REMOVED``),
each an error naming what to do instead, and the rendering of the default file
(``render_default``; ``python -m serving.config_schema --write superinfer_config.yaml``).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from superinfer_jax.config import DTYPES, EngineConfig, default_kv_dtype
from superinfer_jax.config_schema import (
    Check,
    ConfigError,
    check_value,
    knob,
    type_hints,
    validate,
)
from superinfer_jax.request import FIELD_RANGES, PRIORITY_CLASSES, SLO
from superinfer_jax.sched.rotasched_config import (
    DEFAULT_ROTASCHED_PRESET,
    PRESET_KEY,
    ROTASCHED_PRESETS,
    preset_knobs,
)

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_COMPILATION_CACHE = "~/.cache/superinfer/xla"


# -- the server's own sections ----------------------------------------------------------


@dataclass(frozen=True)
class ModelSection:
    name: str | None = knob(None, example=DEFAULT_MODEL,
                            help=f"a preset to load (default {DEFAULT_MODEL}); with `path`, "
                                 "the name clients use")
    path: str | None = knob(None, example="/models/Meta-Llama-3-8B-Instruct",
                            help="HF dir, .gguf file or Orbax dir")
    dtype: str = knob("float32", choices=DTYPES,
                      help="float32 | bfloat16 (weights and compute)")
    chat_template: str | None = knob(
        None, example="serving/templates/smollm2_tools.jinja",
        help="a Jinja chat template file used instead of the model's (tool-aware "
             "templates: serving/templates/)")
    # models.quant.MODES (kept literal: reading the schema loads no model code)
    quantization: str = knob("none", choices=("none", "int8", "fp8", "w8a8_int8"),
                             help="none | int8 | fp8 | w8a8_int8: projection weights "
                                  "quantized at load, one scale per output channel "
                                  "(w8a8_int8: activations too, per token; "
                                  "docs/quantization.md)")

    def __post_init__(self) -> None:
        validate(self, prefix="model.")
        if self.chat_template is not None and not Path(self.chat_template).expanduser() \
                .is_file():
            raise ConfigError("model.chat_template", f"no such file {self.chat_template!r}")

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


@dataclass(frozen=True)
class ServerSection:
    host: str = knob("127.0.0.1",
                     help="both fronts; 0.0.0.0 to listen on every interface")
    grpc_port: int = knob(50051, ge=1, le=65535, help="gRPC (superinfer.v1)")
    http_port: int = knob(8000, ge=1, le=65535, help="OpenAI-compatible HTTP")
    enable_grpc: bool = knob(True, help="serve gRPC")
    enable_http: bool = knob(True, help="serve HTTP")
    api_key: str | None = knob(
        None, example="change-me",
        help='or $SUPERINFER_API_KEY; clients send "Authorization: Bearer <key>"')
    tls_cert: str | None = knob(None, example="/etc/superinfer/cert.pem",
                                help="PEM certificate: TLS on both fronts (with tls_key)")
    tls_key: str | None = knob(None, example="/etc/superinfer/key.pem",
                               help="PEM private key")
    max_queue_len: int = knob(256, ge=1,
                              help="waiting requests before 429 / RESOURCE_EXHAUSTED")
    drain_grace_s: float = knob(30.0, ge=0,
                                help="SIGTERM: time in-flight requests get to finish")
    max_request_bytes: int = knob(
        1 << 20, ge=1024,
        help="larger request bodies are refused (413 / RESOURCE_EXHAUSTED)")
    max_n: int = knob(16, ge=1, le=256,
                      help="HTTP: most choices (n) per request; above is a 400 naming n")
    # HTTP: refuse unknown body fields with a 400 (default: ignore them and log each name
    # once, as vLLM does; clients send vendor extensions). gRPC always refuses them.
    strict_request_fields: bool = knob(
        False, help="HTTP: 400 on unknown body fields (default: ignore, log once)")
    # Tool calls with tool_choice auto are read from the model's own syntax by this parser
    # (serving.tools.parsers); forced calls (required, a named function) need none.
    tool_call_parser: str | None = knob(
        None, example="hermes",
        help="parser of the model's tool calls for tool_choice auto: hermes | llama3_json "
             "| mistral | package.module:Class (unset: auto is refused)")
    reasoning_parser: str | None = knob(
        None, example="qwen3",
        help="moves <think>...</think> into reasoning_content: qwen3 | deepseek_r1 | "
             "package.module:Class")
    # Counting adds a host callback to every step of a mixture-of-experts model, which keeps
    # its step programs out of the persistent and executable caches (compiled at each start).
    moe_expert_counts: bool = knob(
        False, help="export tokens per expert (superinfer:moe_expert_tokens_total) of a "
                    "mixture-of-experts model")
    # KV events for llm-d's precise prefix-aware routing (serving.kv_events): off unless an
    # endpoint is set.
    kv_events_endpoint: str | None = knob(
        None, example="tcp://*:5557",
        help="publish KV-cache events (vLLM's format, msgpack over ZMQ PUB): bind with * "
             "or ipc://, else connect")
    kv_events_topic: str = knob(
        "", help="ZMQ topic of the KV events (llm-d's indexer reads kv@<pod-id>@<model>)")
    kv_events_replay_endpoint: str | None = knob(
        None, example="tcp://*:5558",
        help="ZMQ ROUTER (bound) serving missed KV event batches again")

    def __post_init__(self) -> None:
        validate(self, prefix="server.")
        if (self.tls_cert is None) != (self.tls_key is None):
            given, missing = (("tls_cert", "tls_key") if self.tls_key is None
                              else ("tls_key", "tls_cert"))
            raise ConfigError(f"server.{given}", f"needs server.{missing} too (TLS takes "
                                                 "both)")
        for name in ("tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not Path(path).expanduser().is_file():
                raise ConfigError(f"server.{name}", f"no such file {path!r}")
        if self.api_key == "":
            raise ConfigError("server.api_key", "must not be empty (omit it to disable auth)")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ConfigError("server.kv_events_replay_endpoint",
                              "needs server.kv_events_endpoint (the events to replay)")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value is not None and "://" not in value:
                raise ConfigError(f"server.{name}", f"must be a ZMQ endpoint such as "
                                                    f"tcp://*:5557, got {value!r}")
        if not (self.enable_grpc or self.enable_http):
            raise ConfigError("server.enable_grpc",
                              "is false and so is server.enable_http: nothing to serve")


# -- what the dataclasses cannot say ----------------------------------------------------

SECTION_HELP = {
    "model": "what to serve",
    "hardware": "device memory, KV pages and kernels",
    "engine": "batching and scheduling, for every policy",
    "default_slo": "the SLO of a request that sends none",
    "rotasched": "RotaSched's parameters (engine.policy: rotasched)",
    "duplex_kv": "the host tier: rotated KV pages in pinned host memory, and their copies",
    "prefix_caching": "automatic prefix caching: full KV pages shared by hash, on the "
                      "device and (with a host tier) in host memory",
    "speculative": "speculative decoding: proposed tokens verified in one forward pass "
                   "(docs/speculative.md)",
    "server": "the gRPC and OpenAI HTTP fronts",
}
SECTIONS = tuple(SECTION_HELP)  # in the file's order


@dataclass(frozen=True)
class FileValues:
    """What a key of the file accepts beyond its engine field's values.

    ``auto``: extra values meaning "decide from the rest" (``to_engine`` decides).
    ``to_engine(value, values)``: the engine field's value from the key's and the other
    keys' (``values``, by YAML key)."""

    help: str | None = None  # replaces the field's help in the file
    auto: tuple[Any, ...] = ()
    to_engine: Callable[[Any, Mapping[str, Any]], Any] | None = None
    example: Any = None


def _cache_dir(value: str | None, values: Mapping[str, Any]) -> str | None:
    return str(Path(value).expanduser()) if value else None


def _prefill_chunk(value: int | None, values: Mapping[str, Any]) -> int:
    return min(256, values["engine.max_num_batched_tokens"]) if value is None else value


def _kv_dtype(value: str, values: Mapping[str, Any]) -> str:
    return default_kv_dtype(values["model.dtype"]) if value == "auto" else value


FILE_VALUES: dict[str, FileValues] = {
    "hardware.compilation_cache_dir": FileValues(
        to_engine=_cache_dir, example=DEFAULT_COMPILATION_CACHE,
        help='persistent XLA cache: later starts skip the compiler ("" or null: none)'),
    "engine.max_prefill_chunk": FileValues(
        auto=(None,), to_engine=_prefill_chunk,
        help="longest prefill chunk of one request in one step "
             "(null: min(256, max_num_batched_tokens))"),
    "model.kv_cache_dtype": FileValues(
        auto=("auto",), to_engine=_kv_dtype,
        help="auto (= model.dtype, but float32 on CPU) | float32 | bfloat16 | fp8_e4m3 | "
             "fp8_e5m2 (docs/quantization.md)"),
}

# A profile sets some keys for a kind of deployment, over their defaults (the fields',
# as the Python API takes them); a key the file sets wins over its profile. The file
# names its profile (``profile:``, default ``server``); the generated file shows the
# server profile's keys commented out, each marked with its own default. The knobs a
# RotaSched preset sets are the preset's (it goes over the profile): a profile names
# ``rotasched.preset`` instead.
PROFILES: dict[str, dict[str, Any]] = {
    # A server runs the paper's policy with a host tier, is ready once its smallest
    # buckets are compiled (runner.step_programs), keeps a persistent XLA cache, and sizes
    # its prefill chunk and KV dtype from the other keys.
    "server": {
        "model.kv_cache_dtype": "auto",
        "hardware.compilation_cache_dir": DEFAULT_COMPILATION_CACHE,
        "engine.max_prefill_chunk": None,
        "engine.compile_in_background": True,
        "engine.policy": "rotasched",
        "duplex_kv.host_memory_gb": 2.0,
    },
    # Every key's own default: the engine a library user gets from ``EngineConfig()``.
    "library": {},
}
DEFAULT_PROFILE = "server"
PROFILE_KEY = "profile"  # the file's top-level key naming its profile


def profile_of(name: Any) -> dict[str, Any]:
    """The keys profile ``name`` sets; a ``ConfigError`` naming ``profile`` if none."""
    if not isinstance(name, str) or name not in PROFILES:
        raise ConfigError(PROFILE_KEY, f"must be one of {list(PROFILES)}, got {name!r}")
    return PROFILES[name]


def _policy(key: str, name: Any) -> str | None:
    """A registered policy or a ``module:Class`` path: the registry's resolver and words
    (``must be one of the registered policies ...``), so a bad name stops the load."""
    from superinfer_jax.sched.rotasched.registry import policy_problem

    return policy_problem(name)


# Checks a config dataclass cannot make without importing what it configures: the loader
# makes them, so a bad file fails at load, before the engine is built.
def _tool_call_parser(key: str, name: Any) -> str | None:
    from serving.tools import tool_parser_problem

    return None if name is None else tool_parser_problem(name)


def _reasoning_parser(key: str, name: Any) -> str | None:
    from serving.tools import reasoning_parser_problem

    return None if name is None else reasoning_parser_problem(name)


LOADER_CHECKS: dict[str, Check] = {
    "engine.policy": _policy,
    "server.tool_call_parser": _tool_call_parser,
    "server.reasoning_parser": _reasoning_parser,
}


# Old key -> its key now. An old name does not load: it is an error naming the new key.
MOVED: dict[str, str] = {
    "rotasched.policy": "engine.policy",
    "rotasched.max_num_seqs": "engine.max_num_seqs",
    "rotasched.max_num_batched_tokens": "engine.max_num_batched_tokens",
    "rotasched.max_prefill_chunk": "engine.max_prefill_chunk",
    "rotasched.seed": "engine.seed",
    "rotasched.async_scheduling": "engine.async_scheduling",
    "rotasched.transfer_budget_pages": "duplex_kv.transfer_budget_pages",
    "rotasched.ttft_slo_target_ms": "default_slo.ttft_ms",
    "rotasched.tbt_slo_target_ms": "default_slo.tbt_ms",
    "rotasched.proactive_eviction_threshold": "rotasched.high_water_mark",
    "hardware.hbm_memory_fraction": "hardware.device_memory_fraction",
    "engine.enable_prefix_caching": "prefix_caching.enabled",
    "hardware.cpu_memory_buffer_gb": "duplex_kv.host_memory_gb",
    "server.warmup": "engine.warmup",
}

# Removed key -> why. Such a key in a file is an error naming it.
REMOVED: dict[str, str] = {
    "duplex_kv.staging_buffer_mb": "it never did anything: DuplexKV copies pages straight "
                                   "between the two pools, through no staging buffer",
}

# EngineConfig fields that are not deployment keys, with why (set by the program).
NOT_KEYS: dict[str, str] = {
    f.name: f.metadata["internal"] for f in dataclasses.fields(EngineConfig)
    if "internal" in f.metadata
}


# -- the keys ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Key:
    """One key of the file: ``path`` (``engine.max_num_seqs``), the annotation and field
    metadata its value is checked against, its default, and ``target``: where the value
    lands in ``DeploymentConfig`` (``("engine", "rotasched", "alpha")``)."""

    path: str
    hint: Any
    meta: Mapping[str, Any]
    default: Any
    target: tuple[str, ...]
    to_engine: Callable[[Any, Mapping[str, Any]], Any] | None = None

    @property
    def section(self) -> str:
        return self.path.split(".", 1)[0]

    @property
    def name(self) -> str:
        return self.path.split(".", 1)[1]

    @property
    def help(self) -> str:
        return str(self.meta.get("help") or "")

    def check(self, value: Any) -> None:
        check_value(self.path, value, self.hint, self.meta)


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"{f.name} has no default")


def _slo_meta(name: str) -> dict[str, Any]:
    """``SLO`` keeps its bounds in the request table (``FIELD_RANGES``): read them there."""
    help_ = {"ttft_ms": "time to first token, ms", "tbt_ms": "time between tokens, ms",
             "priority_class": " | ".join(PRIORITY_CLASSES)}[name]
    if name == "priority_class":
        return {"help": help_, "choices": PRIORITY_CLASSES}
    r = FIELD_RANGES[f"slo.{name}"]
    return {"help": help_, "gt" if r.low_open else "ge": r.low, "le": r.high}


def _dataclass_keys(section: str, cls: type, target: tuple[str, ...],
                    metas: Callable[[dataclasses.Field], Mapping[str, Any]]) -> list[Key]:
    hints = type_hints(cls)
    return [Key(f"{section}.{f.name}", hints[f.name], metas(f), _field_default(f),
                (*target, f.name)) for f in dataclasses.fields(cls)]


def _build_keys() -> dict[str, Key]:
    keys: list[Key] = []
    keys += _dataclass_keys("model", ModelSection, ("model",), lambda f: f.metadata)
    keys += _dataclass_keys("server", ServerSection, ("server",), lambda f: f.metadata)
    hints = type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):  # one section each
        if "internal" in f.metadata:
            continue
        metas = _slo_meta_of if hints[f.name] is SLO else (lambda g: g.metadata)
        keys += _dataclass_keys(f.name, hints[f.name], ("engine", f.name), metas)
    first = next(i for i, k in enumerate(keys) if k.section == "rotasched")
    keys.insert(first, _ROTASCHED_PRESET)  # first in its section: the others start from it
    out = {}
    for key in keys:
        rule = FILE_VALUES.get(key.path)
        if rule is not None:
            meta = dict(key.meta)
            hint = key.hint
            if rule.help is not None:
                meta["help"] = rule.help
            if rule.example is not None:
                meta["example"] = rule.example
            if None in rule.auto:
                hint = hint | None
            extra = tuple(a for a in rule.auto if a is not None)
            if extra:
                meta["choices"] = (*extra, *meta["choices"])
            key = dataclasses.replace(key, hint=hint, meta=meta, to_engine=rule.to_engine)
        if key.path in LOADER_CHECKS:
            key = dataclasses.replace(key, meta={**key.meta, "check": LOADER_CHECKS[key.path]})
        out[key.path] = key
    order = {s: i for i, s in enumerate(SECTIONS)}
    return dict(sorted(out.items(), key=lambda kv: order[kv[1].section]))


# Not a field: it sets the knobs of ``ROTASCHED_PRESETS[name]`` before the file's own
# ``rotasched:`` keys (``DeploymentConfig.from_dict``), so one key switches policies whole.
ROTASCHED_PRESET_PATH = f"rotasched.{PRESET_KEY}"
_ROTASCHED_PRESET = Key(
    ROTASCHED_PRESET_PATH, str,
    {"help": " | ".join(ROTASCHED_PRESETS) + ": the knobs below start from this preset "
             "(bounded tails | most first tokens on time | the paper's rule); keys set "
             "here win (docs/scheduling.md#presets)",
     "choices": tuple(ROTASCHED_PRESETS)},
    DEFAULT_ROTASCHED_PRESET, ())


def preset_values(name: Any) -> dict[str, Any]:
    """The keys preset ``name`` sets (``rotasched.pool_seat_fraction``) and their values; a
    ``ConfigError`` naming ``rotasched.preset`` if there is no such preset."""
    return {f"rotasched.{k}": v for k, v in preset_knobs(name, ROTASCHED_PRESET_PATH).items()}


def _slo_meta_of(f: dataclasses.Field) -> Mapping[str, Any]:
    return _slo_meta(f.name)


KEYS: dict[str, Key] = _build_keys()

# The YAML key of each EngineConfig field (``"rotasched.alpha"`` for the nested field).
ENGINE_KEYS: dict[str, str] = {".".join(k.target[1:]): k.path for k in KEYS.values()
                               if k.target[:1] == ("engine",)}


def keys_of(section: str) -> list[Key]:
    return [k for k in KEYS.values() if k.section == section]


# -- lookups: moved, removed and unknown keys -------------------------------------------


def resolve(path: str) -> str:
    """``path`` if it is a key; else a ``ConfigError`` naming it: a moved key with its
    new key, a removed key with why, an unknown key with the closest key."""
    if path in KEYS:
        return path
    if path in MOVED:
        raise ConfigError(path, f"was renamed: use {MOVED[path]}")
    if path in REMOVED:
        raise ConfigError(path, f"was removed ({REMOVED[path]}); delete it")
    raise unknown(path)


def unknown(path: str) -> ConfigError:
    """The error for a key that does not exist, with the closest key if one is near."""
    section, _, name = path.partition(".")
    if section not in SECTIONS:
        near = difflib.get_close_matches(section, SECTIONS, n=1)
        hint = f"; did you mean {near[0]}?" if near else ""
        return ConfigError(section, f"is not a known section{hint} "
                                    f"(sections: {', '.join(SECTIONS)})")
    same = [k.name for k in keys_of(section)]
    near = difflib.get_close_matches(name, same, n=1)
    if near:
        return ConfigError(path, f"is not a known key; did you mean {section}.{near[0]}?")
    elsewhere = [p for p in (*KEYS, *MOVED) if p.split(".", 1)[1] == name]
    if not elsewhere:
        elsewhere = difflib.get_close_matches(path, [*KEYS, *MOVED], n=1, cutoff=0.75)
    if elsewhere:
        return ConfigError(path, f"is not a known key; did you mean "
                                 f"{MOVED.get(elsewhere[0], elsewhere[0])}?")
    return ConfigError(path, f"is not a known key ({section} keys: {', '.join(same)})")


# -- the default file -------------------------------------------------------------------

HEADER = """\
# superinfer deployment config: `superinfer serve --config superinfer_config.yaml`
#
# Generated from the schema by `superinfer config --write superinfer_config.yaml` (the
# keys are the fields of EngineConfig, RotaSchedConfig and serving/config_schema.py; a
# test keeps this file equal to it). Every key is optional: a line shows its default or,
# commented out, an example or the value its profile gives it. Flags override keys
# (`--max-num-seqs 8`, or `--set section.key=value` for any key). An unknown key or a bad
# value stops the server with an error naming it, e.g.
# "error: rotasched.alpha: must be >= 0, got -1".

# The defaults the keys start from. server: sets the keys marked [profile server] below
# (commented out, with the value it gives them). library: every key at its own default, as
# EngineConfig and the Python API take them. A key set in this file wins over its profile.
profile: server
"""
_COMMENT_COLUMN = 32
_WIDTH = 100


def _scalar(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=1000, sort_keys=False)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def render_default() -> str:
    """The default ``superinfer_config.yaml``: the profile, every key, its default (or,
    commented out, its profile's value), its help."""
    assert f"profile: {DEFAULT_PROFILE}\n" in HEADER
    profile = PROFILES[DEFAULT_PROFILE]
    # a key the preset sets stays commented out, so that naming another preset changes it
    preset = set(preset_values(DEFAULT_ROTASCHED_PRESET))
    out = [HEADER]
    for section in SECTIONS:
        out.append(f"\n# {SECTION_HELP[section]}\n{section}:\n")
        for key in keys_of(section):
            help_ = key.help
            if key.path in profile:
                line = f"  # {key.name}: {_scalar(profile[key.path])}"
                help_ = f"[profile {DEFAULT_PROFILE}; default {_scalar(key.default)}] {help_}"
            elif key.path in preset:
                line = f"  # {key.name}: {_scalar(key.default)}"
                help_ = f"[set by preset {DEFAULT_ROTASCHED_PRESET}] {help_}"
            elif key.default is None:
                line = f"  # {key.name}: {_scalar(key.meta['example'])}"
            else:
                line = f"  {key.name}: {_scalar(key.default)}"
            inline = f"{line.ljust(_COMMENT_COLUMN - 2)}  # {help_}"
            if len(inline) <= _WIDTH:
                out.append(inline.rstrip() + "\n")
                continue
            for part in textwrap.wrap(help_, _WIDTH - 4, break_on_hyphens=False):
                out.append(f"  # {part}\n")
            out.append(line + "\n")
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serving.config_schema",
                                     description="Print or write the default deployment "
                                                 "file, generated from the schema.")
    parser.add_argument("--write", metavar="PATH", help="write it to PATH (else: stdout)")
    args = parser.parse_args(argv)
    return write_default(args.write)


def write_default(path: str | None) -> int:
    text = render_default()
    if path is None:
        sys.stdout.write(text)
    else:
        Path(path).write_text(text, encoding="utf-8")
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
