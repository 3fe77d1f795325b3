"""The deployment file (``superinfer_config.yaml``): what to serve, on what, and how.

Loading is one path for ``serve``, ``batch`` and ``generate``: read the YAML (an old key
name is an error naming its new key, ``serving.config_schema.MOVED``), apply the command
line's
``section.key`` overrides, start every key from its default and its profile's value
(``profile:``, default ``server``; ``serving.config_schema.PROFILES``), check every value
with the one validator against its field's schema, and build the ``EngineConfig`` from it.
Every failure is a ``ConfigError`` whose ``key`` is the YAML key (``rotasched.alpha``),
whether the YAML layer or ``EngineConfig.__post_init__`` found it.

The keys themselves, their sections, defaults and help live on the dataclass fields
(``serving.config_schema``); nothing here lists them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from serving.config_schema import (
    DEFAULT_MODEL,
    DEFAULT_PROFILE,
    KEYS,
    PROFILE_KEY,
    ROTASCHED_PRESET_PATH,
    SECTIONS,
    ModelSection,
    ServerSection,
    preset_values,
    profile_of,
    resolve,
    unknown,
)
from superinfer_jax.config import EngineConfig
from superinfer_jax.config_schema import ConfigError, type_hints
from superinfer_jax.request import SLO, FieldError
from superinfer_jax.sched.rotasched_config import DEFAULT_ROTASCHED_PRESET

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_MODEL", "UNSET", "ConfigError", "DeploymentConfig", "ModelSection",
           "ServerSection", "apply_overrides", "parse_set"]


@dataclass(frozen=True)
class DeploymentConfig:
    """A validated deployment: the server's sections and the engine's configuration.

    ``values``: every key's value as the file holds it, or its profile's, or its default
    (``engine.max_prefill_chunk: null`` means "from the token budget"); ``engine`` holds
    what they resolve to."""

    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    server: ServerSection = dataclasses.field(default_factory=ServerSection)
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    profile: str = DEFAULT_PROFILE
    values: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> DeploymentConfig:
        """From a mapping of sections (a parsed file, ``profile`` beside them)."""
        sections = check_sections(data)
        profile = sections.get(PROFILE_KEY, DEFAULT_PROFILE)
        values = {path: key.default for path, key in KEYS.items()}
        values.update(profile_of(profile))
        given = _flatten(sections)
        _warn_if_written_before_presets(given)
        preset = given.get(ROTASCHED_PRESET_PATH, values[ROTASCHED_PRESET_PATH])
        values.update(preset_values(preset))
        for path, value in given.items():
            KEYS[path].check(value)
            values[path] = value
        return cls._build(values, profile)

    @classmethod
    def load(cls, path: str | Path | None = None,
             overrides: Mapping[str, Any] | None = None,
             base: Mapping[str, Any] | None = None) -> DeploymentConfig:
        """Read the YAML file (if any) over ``base`` (a command's own defaults, by key),
        apply ``section.key`` overrides, validate."""
        data: dict[str, Any] = apply_overrides({}, dict(base or {}))
        if path is not None:
            try:
                text = Path(path).expanduser().read_text(encoding="utf-8")
                loaded = yaml.safe_load(text)
            except OSError as e:
                raise ConfigError(str(path), f"cannot be read: {e.strerror}") from e
            except yaml.YAMLError as e:
                raise ConfigError(str(path), f"is not valid YAML: {e}") from e
            loaded = check_sections(loaded)
            if PROFILE_KEY in loaded:
                data[PROFILE_KEY] = loaded[PROFILE_KEY]
            for dotted, value in _flatten(loaded).items():
                section, key = dotted.split(".", 1)
                data.setdefault(section, {})[key] = value
        return cls.from_dict(apply_overrides(data, overrides or {}))

    @classmethod
    def _build(cls, values: dict[str, Any], profile: str) -> DeploymentConfig:
        parts: dict[tuple[str, ...], dict[str, Any]] = {}
        for path, key in KEYS.items():
            if not key.target:  # a key that sets others (rotasched.preset), applied above
                continue
            value = values[path]
            if key.to_engine is not None:
                value = key.to_engine(value, values)
            parts.setdefault(key.target[:-1], {})[key.target[-1]] = value
        model = ModelSection(**parts[("model",)])
        server = ServerSection(**parts[("server",)])
        sections: dict[str, Any] = {}
        for name, section in type_hints(EngineConfig).items():
            kwargs = parts.get(("engine", name))
            if kwargs is not None:  # each section's errors name its YAML keys
                sections[name] = _slo(kwargs) if section is SLO else section(**kwargs)
        engine = EngineConfig.build(**sections)
        return cls(model, server, engine, profile, dict(values))

    def engine_config(self, show_progress: bool = True) -> EngineConfig:
        """The ``EngineConfig`` this deployment asks for."""
        return self.engine.replace(show_progress=show_progress)

    def get(self, dotted: str) -> Any:
        """A key's value as the file holds it (``"engine.max_num_seqs"``)."""
        return self.values[resolve(dotted)]

    def to_dict(self) -> dict[str, Any]:
        """The profile and sections of keys: a file that loads back to this deployment. A
        knob at its preset's value is left out, so editing ``preset`` in it takes effect."""
        out: dict[str, Any] = {PROFILE_KEY: self.profile, **{s: {} for s in SECTIONS}}
        preset = preset_values(self.values[ROTASCHED_PRESET_PATH])
        for path, value in self.values.items():
            if path in preset and preset[path] == value:
                continue
            section, key = path.split(".", 1)
            out[section][key] = value
        return out


def _slo(kwargs: dict[str, Any]) -> SLO:
    try:
        return SLO(**kwargs)
    except FieldError as e:  # "slo.ttft_ms must be in (0, 3600000], got 0"
        name = e.field.removeprefix("slo.")
        message = str(e).removeprefix(e.field).strip()
        raise ConfigError(f"default_slo.{name}", message) from e


def check_sections(data: Any) -> dict[str, Any]:
    """``data`` (sections of keys, and ``profile``, as parsed) as a dict of dicts.

    An unknown section, key or profile, or a moved or removed key, is a ``ConfigError``
    naming it."""
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError("config", f"must be a mapping of sections, got "
                                    f"{type(data).__name__}")
    out: dict[str, Any] = {}
    for section, keys in data.items():
        if section == PROFILE_KEY:
            profile_of(keys)
            out[PROFILE_KEY] = keys
            continue
        if section not in SECTIONS:
            raise unknown(f"{section}.")
        if keys is None:
            continue
        if not isinstance(keys, Mapping):
            raise ConfigError(section, f"must be a mapping of keys, got {type(keys).__name__}")
        for key, value in keys.items():
            resolve(f"{section}.{key}")
            out.setdefault(section, {})[key] = value
    return out


# What ``superinfer config --write`` spelled out before the presets (the old defaults, now
# preset ``attainment``, that were not None; the others were commented out): such a file
# pins these under any preset, so the default (``bounded``) would run with ``free_pages``.
_WRITTEN_BEFORE_PRESETS = {path: value for path, value in preset_values("attainment").items()
                           if value is not None}


def _warn_if_written_before_presets(given: Mapping[str, Any]) -> None:
    if ROTASCHED_PRESET_PATH in given or any(
            given.get(k) != v for k, v in _WRITTEN_BEFORE_PRESETS.items()):
        return
    log.warning("rotasched: this file sets %s as files written before rotasched.preset did; "
                "they win over the preset (%s), so the policy mixes both. Delete those "
                "lines to follow the preset, or add 'preset: attainment' to keep the old "
                "policy (docs/configuration.md#overrides)",
                ", ".join(k.split(".", 1)[1] for k in _WRITTEN_BEFORE_PRESETS),
                DEFAULT_ROTASCHED_PRESET)


def _flatten(data: Mapping[str, Any]) -> dict[str, Any]:
    return {f"{s}.{k}": v for s, keys in data.items() if s != PROFILE_KEY
            for k, v in keys.items()}


UNSET = object()  # an override value that removes the key (back to the default)


def apply_overrides(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Copy of ``data`` (sections of keys) with ``{"section.key": value}`` set (or
    ``{"profile": name}``). None values are skipped (a flag not given); ``UNSET`` removes
    the key."""
    out = check_sections(data)
    for dotted, value in overrides.items():
        if value is None:
            continue
        if dotted == PROFILE_KEY:
            if value is UNSET:
                out.pop(PROFILE_KEY, None)
            else:
                out[PROFILE_KEY] = value
                profile_of(value)
            continue
        if dotted.count(".") != 1:
            raise ConfigError(dotted, "must look like section.key")
        section, key = resolve(dotted).split(".")
        target = out.setdefault(section, {})
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
            raise ConfigError("--set", f"{item!r}: expected section.key=value")
        try:
            out[key.strip()] = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ConfigError(key.strip(), f"bad value {raw!r} ({e})") from e
    return out
