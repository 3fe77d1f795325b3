"""The deployment file: generated from the schema, every engine knob reachable, flags over
the file, profiles, old (moved), removed and unknown keys that name themselves (and the
key to use), and one error shape (``error: <key>: <message>``) from every path."""

from __future__ import annotations

import dataclasses
import socket
import typing
from pathlib import Path

import pytest

from serving import config_schema
from serving.cli import _deployment, build_parser, main
from serving.config_schema import (
    ENGINE_KEYS,
    KEYS,
    MOVED,
    NOT_KEYS,
    PROFILES,
    REMOVED,
    SECTIONS,
    render_default,
)
from serving.deploy_config import ConfigError, DeploymentConfig, apply_overrides, parse_set
from superinfer_jax.config import EngineConfig, RotaSchedConfig
from superinfer_jax.sched.rotasched_config import (
    DEFAULT_ROTASCHED_PRESET,
    ROTASCHED_PRESETS,
    rotasched_preset,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "superinfer_config.yaml"


def test_shipped_file_is_the_generated_one():
    assert EXAMPLE.read_text(encoding="utf-8") == render_default(), (
        "superinfer_config.yaml drifted from the schema: regenerate it with "
        "`superinfer config --write superinfer_config.yaml`")


def test_config_command_prints_and_writes_the_default(tmp_path, capsys):
    assert main(["config"]) == 0
    assert capsys.readouterr().out == render_default()
    out = tmp_path / "c.yaml"
    assert main(["config", "--write", str(out)]) == 0
    assert out.read_text() == render_default()


def test_shipped_example_is_valid_and_maps_onto_the_engine():
    cfg = DeploymentConfig.load(EXAMPLE)
    assert cfg.model.source == "smollm2-135m" and cfg.server.grpc_port == 50051
    assert cfg.server.host == "127.0.0.1" and cfg.server.http_port == 8000
    ec = cfg.engine_config()
    assert (ec.model.max_model_len, ec.engine.max_num_seqs,
            ec.engine.max_num_batched_tokens) == (2048, 32, 512)
    assert ec.hardware.page_size == 16 and ec.hardware.device_memory_fraction == 0.9
    assert ec.default_slo.ttft_ms == 5000 and ec.default_slo.tbt_ms == 100
    assert ec.engine.max_prefill_chunk == 256 and ec.model.kv_cache_dtype == "float32"
    assert ec.engine.policy == "rotasched" and ec.duplex_kv.host_memory_gb == 2.0
    assert ec.hardware.compilation_cache_dir == str(Path("~/.cache/superinfer/xla").expanduser())


def test_each_key_has_one_default_and_profiles_set_keys_visibly():
    """A key's default is its field's; the server profile (the file's default) sets a
    few keys over them, each shown in the generated file with its default."""
    defaults = EngineConfig()
    for path, key in KEYS.items():
        if key.target[:1] == ("engine",):
            value = defaults
            for part in key.target[1:]:
                value = getattr(value, part)
            assert key.default == value, path
    text = render_default()
    assert "\nprofile: server\n" in text
    for name, keys in PROFILES.items():
        for path, value in keys.items():
            KEYS[path].check(value)
            if name == "server":
                assert f"[profile server; default {config_schema._scalar(KEYS[path].default)}]" \
                    in text, path
    library = DeploymentConfig.from_dict({"profile": "library"})
    assert library.engine == EngineConfig() and library.profile == "library"
    server = DeploymentConfig.load(None)
    assert server.profile == "server"
    differs = {p for p in KEYS if server.values[p] != library.values[p]}
    assert differs == set(PROFILES["server"])
    assert (server.engine.engine.policy, server.engine.duplex_kv.host_memory_gb) == ("rotasched",
                                                                                     2.0)
    assert DeploymentConfig.load(None, {"profile": "library"}).engine.engine.policy == "fcfs"
    own = DeploymentConfig.from_dict({"profile": "library", "engine": {"policy": "swap"}})
    assert own.engine.engine.policy == "swap"  # a key set in the file wins over its profile
    with pytest.raises(ConfigError, match=r"profile must be one of \['server', 'library'\], "
                                          r"got 'lab'"):
        DeploymentConfig.from_dict({"profile": "lab"})
    assert DeploymentConfig.load(None, parse_set(["profile=library"])).profile == "library"


def test_a_preset_sets_its_knobs_and_keys_beside_it_win(tmp_path):
    """``rotasched.preset`` switches the tail knobs whole (file, ``--set``, round trip);
    a key the file sets wins over it wherever it stands; the default is the fields'."""
    default = DeploymentConfig.load(None)
    assert default.get("rotasched.preset") == DEFAULT_ROTASCHED_PRESET
    assert default.engine.rotasched == RotaSchedConfig()
    for name in ROTASCHED_PRESETS:
        cfg = DeploymentConfig.from_dict({"rotasched": {"preset": name}})
        assert cfg.engine.rotasched == rotasched_preset(name), name
        dumped = cfg.to_dict()
        assert DeploymentConfig.from_dict(dumped) == cfg
        assert "pool_seat_fraction" not in dumped["rotasched"]  # the preset's, left to it
        dumped["rotasched"]["preset"] = "paper"  # so editing the dump's preset takes effect
        assert DeploymentConfig.from_dict(dumped).engine.rotasched == rotasched_preset("paper")
        via_set = DeploymentConfig.load(None, parse_set([f"rotasched.preset={name}"]))
        assert via_set.engine.rotasched == rotasched_preset(name)
    path = tmp_path / "paper.yaml"
    path.write_text("rotasched:\n  pool_seat_fraction: 1.3\n  preset: paper\n  beta_b: 2\n")
    cfg = DeploymentConfig.load(path)
    assert cfg.engine.rotasched == rotasched_preset("paper", pool_seat_fraction=1.3,
                                                    beta_b=2.0)
    assert cfg.engine.rotasched.parked_replies == "lag"
    assert cfg.to_dict()["rotasched"]["pool_seat_fraction"] == 1.3  # not the preset's: kept
    with pytest.raises(ConfigError) as err:
        DeploymentConfig.from_dict({"rotasched": {"preset": "fast"}})
    assert str(err.value) == ("rotasched.preset must be one of ['bounded', 'attainment', "
                              "'paper'], got 'fast'")
    assert "\n  preset: bounded\n" in render_default()  # the others commented out under it
    assert "\n  # pool_seat_fraction: 1.7\n" in render_default()


def test_a_file_written_before_the_presets_is_named_in_a_warning(tmp_path, caplog):
    """The four rotasched lines every file written before the presets spelled out pin the
    old parked-reply rule under the new default: loading one says so, and what to do;
    naming a preset (or any other value) is taken as a choice, without a warning."""
    old = ("rotasched:\n  beta_b: 30.0\n  late_order: shortest\n"
           "  parked_replies: free_pages\n  due_order: lag\n")
    path = tmp_path / "old.yaml"
    path.write_text(old)
    with caplog.at_level("WARNING", logger="serving.deploy_config"):
        cfg = DeploymentConfig.load(path)
    assert cfg.engine.rotasched.parked_replies == "free_pages"
    assert "written before rotasched.preset" in caplog.text
    assert "preset: attainment" in caplog.text
    for extra in ("  preset: attainment\n", "  preset: bounded\n"):
        caplog.clear()
        path.write_text(old + extra)
        with caplog.at_level("WARNING", logger="serving.deploy_config"):
            DeploymentConfig.load(path)
        assert caplog.text == ""
    caplog.clear()
    path.write_text(old.replace("due_order: lag", "due_order: stall"))
    with caplog.at_level("WARNING", logger="serving.deploy_config"):
        DeploymentConfig.load(path)
    assert caplog.text == ""


def test_defaults_without_a_file_equal_the_example():
    default, example = DeploymentConfig.load(None), DeploymentConfig.load(EXAMPLE)
    assert default == example and default.values == example.values
    assert default.model.served_name == "smollm2-135m"


def test_every_engine_field_is_a_key_or_listed_with_a_reason():
    def fields_of(cls, prefix=""):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):  # RotaSchedConfig, SLO
                yield from fields_of(hints[f.name], f"{f.name}.")
            else:
                yield prefix + f.name

    for name in fields_of(EngineConfig):
        if name in NOT_KEYS:
            assert len(NOT_KEYS[name]) > 20, f"{name}: say why it is not a deployment key"
            continue
        assert name in ENGINE_KEYS, f"EngineConfig.{name} has no key in the deployment file"
    assert set(NOT_KEYS) == {"show_progress"}
    for was in ("min_residency_tokens", "priority_weights", "max_prefill_rows"):
        assert any(path.endswith("." + was) for path in KEYS), was


def _other_value(key):
    """A valid value of ``key`` that differs from its default."""
    meta, default = key.meta, key.default
    if key.path == "engine.policy":
        return "swap"
    if key.path == "speculative.method":
        return "ngram"
    if meta.get("choices"):
        return next(c for c in meta["choices"] if c != default)
    if isinstance(default, bool):
        return not default
    if isinstance(default, dict):
        return {k: v * 2 for k, v in default.items()}
    if default is None:
        return meta["example"]
    if isinstance(default, str):
        return default + "-x"
    if isinstance(default, int):
        return default * 2 if default else 1
    return default / 2 if default else 0.5


@pytest.mark.parametrize("path", [p for p in KEYS if KEYS[p].target and
                                  not p.startswith(("model.name", "model.path", "server."))])
def test_every_key_reaches_its_field_through_set(path):
    """``--set section.key=value`` for each key: the value lands on its field."""
    key = KEYS[path]
    value = _other_value(key)
    if path == "engine.max_prefill_chunk":
        value = 128
    text = f"{path}={value}" if not isinstance(value, dict) else \
        f"{path}={{{', '.join(f'{k}: {v}' for k, v in value.items())}}}"
    cfg = DeploymentConfig.load(None, parse_set([text]))
    assert cfg.get(path) == value
    target = cfg
    for part in key.target:
        target = getattr(target, part)
    expected = key.to_engine(value, cfg.values) if key.to_engine else value
    assert target == expected


@pytest.mark.parametrize("data, message", [
    ({"rotasched": {"alpha": -1}}, "rotasched.alpha must be >= 0, got -1"),
    ({"engine": {"policy": "lottery"}}, "engine.policy must be one of"),
    ({"model": {"tensor_parallel_size": 0}}, "model.tensor_parallel_size must be >= 1"),
    ({"model": {"dtype": "int4"}}, "model.dtype must be one of"),
    ({"hardware": {"page_size": "16"}}, "hardware.page_size must be an integer, got '16'"),
    ({"hardware": {"page_size": 12}}, "hardware.page_size must be a power of two"),
    ({"hardware": {"device_memory_fraction": 1.5}},
     "hardware.device_memory_fraction must be <= 1"),
    ({"server": {"grpc_port": True}}, "server.grpc_port must be an integer, got True"),
    ({"server": {"http_port": 70000}}, "server.http_port must be <= 65535"),
    ({"server": {"tls_cert": "/nonexistent.pem"}}, "server.tls_cert needs server.tls_key"),
    ({"server": {"api_key": ""}}, "server.api_key must not be empty"),
    ({"duplex_kv": {"eager_shadowing": "yes"}}, "duplex_kv.eager_shadowing must be true or"),
    ({"engine": {"max_prefill_rows": 0}}, "engine.max_prefill_rows must be >= 1, got 0"),
    ({"rotasched": {"min_residency_tokens": 2.5}},
     "rotasched.min_residency_tokens must be an integer"),
    ({"rotasched": {"residency_share": 0}}, "rotasched.residency_share must be > 0, got 0"),
    ({"rotasched": {"residency_share": 1.5}}, "rotasched.residency_share must be <= 1"),
    ({"rotasched": {"parked_share": 0}}, "rotasched.parked_share must be > 0, got 0"),
    ({"rotasched": {"parked_share": 2}}, "rotasched.parked_share must be <= 1"),
    ({"rotasched": {"priority_weights": {"critical": 1, "standard": 1}}},
     "rotasched.priority_weights.batch must be > 0, got None"),
    ({"default_slo": {"ttft_ms": 0}}, "default_slo.ttft_ms must be > 0"),
    ({"default_slo": {"priority_class": "gold"}}, "default_slo.priority_class must be one of"),
    ({"model": ["name"]}, "model must be a mapping of keys"),
    ({"engine": {"max_num_batched_tokens": 64, "max_prefill_chunk": 128}},
     "engine.max_prefill_chunk must not exceed max_num_batched_tokens (64), got 128"),
])
def test_bad_values_name_the_key(data, message):
    with pytest.raises(ConfigError) as err:
        DeploymentConfig.from_dict(data)
    assert message in str(err.value)
    assert str(err.value) == f"{err.value.key} {err.value.message}"
    assert str(err.value).startswith(err.value.key)


@pytest.mark.parametrize("path, suggestion", [
    ("rotasched.alpah", "did you mean rotasched.alpha?"),
    ("engine.max_num_seq", "did you mean engine.max_num_seqs?"),
    ("rotasched.max_prefill_rows", "did you mean engine.max_prefill_rows?"),  # wrong section
    ("duplex_kv.proactive_eviction_threshold", "did you mean rotasched.high_water_mark?"),
    ("hardwre.page_size", "did you mean hardware?"),
])
def test_unknown_key_names_it_with_a_close_match(path, suggestion):
    section, key = path.split(".")
    with pytest.raises(ConfigError) as err:
        DeploymentConfig.from_dict({section: {key: 1}})
    assert suggestion in err.value.message
    assert err.value.key in (path, section)
    with pytest.raises(ConfigError, match="is not a known key"):
        DeploymentConfig.from_dict({"server": {"colour": "blue"}})


def test_removed_key_is_an_error_that_says_so(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("duplex_kv:\n  eager_shadowing: true\n  staging_buffer_mb: 64\n")
    with pytest.raises(ConfigError) as err:
        DeploymentConfig.load(path)
    assert err.value.key == "duplex_kv.staging_buffer_mb"
    assert err.value.message.startswith("was removed (it never did anything")
    assert set(REMOVED) == {"duplex_kv.staging_buffer_mb"}
    assert "staging_buffer_mb" not in render_default()


def test_an_old_key_fails_naming_its_new_key(tmp_path, capsys):
    """A moved or renamed key does not load: the file, --set and the CLI name the key to
    use instead."""
    path = tmp_path / "old.yaml"
    path.write_text("rotasched:\n  policy: swap\n")
    with pytest.raises(ConfigError) as err:
        DeploymentConfig.load(path)
    assert str(err.value) == "rotasched.policy was renamed: use engine.policy"
    for old, new in MOVED.items():
        section, key = old.split(".")
        with pytest.raises(ConfigError) as err:
            DeploymentConfig.from_dict({section: {key: 1}})
        assert (err.value.key, err.value.message) == (old, f"was renamed: use {new}")
        with pytest.raises(ConfigError, match=f"was renamed: use {new}"):
            DeploymentConfig.load(None, parse_set([f"{old}=1"]))
    assert main(["config", "--set", "rotasched.proactive_eviction_threshold=0.7"]) == 2
    assert ("superinfer: error: rotasched.proactive_eviction_threshold: was renamed: use "
            "rotasched.high_water_mark") in capsys.readouterr().err


def test_moved_keys_point_at_keys_and_removed_ones_are_gone():
    for old, new in MOVED.items():
        assert new in KEYS and old not in KEYS, old
    assert set(REMOVED).isdisjoint(KEYS) and set(REMOVED).isdisjoint(MOVED)
    assert {k.section for k in KEYS.values()} == set(SECTIONS)


def test_engine_errors_name_the_yaml_key():
    """A section's own check (cross-field) reports the YAML key; the flat builder names
    the knob as its caller spelled it."""
    with pytest.raises(ConfigError) as err:
        DeploymentConfig.from_dict({"model": {"kv_cache_dtype": "float8"}})
    assert err.value.key == "model.kv_cache_dtype"
    with pytest.raises(ConfigError) as err:
        EngineConfig.build(max_prefill_chunk=1024)
    assert err.value.key == "max_prefill_chunk"
    with pytest.raises(TypeError, match="EngineConfig has no knob 'max_num_seq'"):
        EngineConfig.build(max_num_seq=4)
    with pytest.raises(ConfigError) as err:
        RotaSchedConfig(alpha=True)
    assert (err.value.key, err.value.message) == ("rotasched.alpha",
                                                  "must be a finite number, got True")


def test_yaml_errors_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        DeploymentConfig.load(bad)
    with pytest.raises(ConfigError, match="cannot be read"):
        DeploymentConfig.load(tmp_path / "missing.yaml")
    bad.write_text("- model\n")
    with pytest.raises(ConfigError, match="must be a mapping of sections"):
        DeploymentConfig.load(bad)


def test_overrides_and_set():
    data = apply_overrides({"rotasched": {"alpha": 1.0}},
                           {"rotasched.alpha": 2.5, "server.grpc_port": None})
    assert data == {"rotasched": {"alpha": 2.5}}
    assert parse_set(["rotasched.alpha=2", "server.api_key=abc", "duplex_kv.eager_shadowing=no"]) \
        == {"rotasched.alpha": 2, "server.api_key": "abc", "duplex_kv.eager_shadowing": False}
    with pytest.raises(ConfigError, match="expected section.key=value"):
        parse_set(["alpha"])
    weights = parse_set(["rotasched.priority_weights={critical: 8, standard: 1, batch: 0.5}"])
    cfg = DeploymentConfig.load(None, weights)
    assert cfg.engine.rotasched.priority_weights == {"critical": 8, "standard": 1,
                                                     "batch": 0.5}


def test_flags_override_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {path: /models/x, name: served}\nengine: {max_num_seqs: 4}\n"
                    "server: {grpc_port: 6000}\n")
    args = build_parser().parse_args([
        "serve", "--config", str(path), "--max-num-seqs", "8", "--http-port", "9000",
        "--no-grpc", "--model", "smollm2-135m", "--set", "rotasched.beta_f=0.25",
        "--no-warmup"])
    cfg = _deployment(args)
    assert cfg.engine.engine.max_num_seqs == 8 and cfg.engine.rotasched.beta_f == 0.25
    assert cfg.server.grpc_port == 6000 and cfg.server.http_port == 9000
    assert not cfg.server.enable_grpc and cfg.server.enable_http
    assert cfg.model.path is None and cfg.model.source == "smollm2-135m"
    assert cfg.engine.engine.warmup is False
    bad = build_parser().parse_args(["serve", "--set", "rotasched.alpha=-3"])
    with pytest.raises(ConfigError, match="rotasched.alpha must be >= 0"):
        _deployment(bad)


def test_flags_take_type_and_help_from_the_schema():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    helps = {a.option_strings[0]: a.help for a in serve._actions if a.option_strings}
    assert "(engine.max_num_seqs)" in helps["--max-num-seqs"]
    assert KEYS["engine.max_num_seqs"].help in helps["--max-num-seqs"]
    assert "(engine.warmup)" in helps["--warmup"]


def test_policy_flag_errors_like_the_file(capsys):
    assert main(["config", "--set", "engine.policy=lottery"]) == 2
    assert "superinfer: error: engine.policy: must be one of" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("argv, key, message", [
    (["--set", "rotasched.alpha=-1"], "rotasched.alpha", "must be >= 0, got -1"),
    (["--set", "duplex_kv.staging_buffer_mb=64"], "duplex_kv.staging_buffer_mb",
     "was removed"),
    (["--set", "engine.max_num_seq=4"], "engine.max_num_seq",
     "is not a known key; did you mean engine.max_num_seqs?"),
    (["--max-num-seqs", "0"], "engine.max_num_seqs", "must be >= 1, got 0"),
])
def test_cli_prints_key_and_message_and_exits_2_before_binding(argv, key, message, capsys,
                                                               monkeypatch):
    import serving.server

    def no_fronts(runtime):
        raise AssertionError("fronts started with a bad config")

    monkeypatch.setattr(serving.server, "_start_fronts", no_fronts)
    port = _free_port()
    commands = [["serve", "--grpc-port", str(port)], ["batch", "--input", "x", "--output", "y"],
                ["generate", "hi"]]
    if argv[0] == "--set":
        commands.append(["config"])
    for command in commands:
        assert main([*command, *argv]) == 2
        err = capsys.readouterr().err
        assert f"superinfer: error: {key}: {message}" in err, (command, err)
    with socket.socket() as s:  # nothing was bound
        s.bind(("127.0.0.1", port))


def test_generate_builds_its_engine_through_the_deployment_path(tmp_path, monkeypatch):
    """generate reads --config and --set like serve and batch, with its own defaults
    (one request: no host tier, fcfs) under the file."""
    import serving.cli

    seen = []

    class Stop(Exception):
        pass

    def load(config):
        seen.append(config)
        raise Stop

    monkeypatch.setattr(serving.cli, "_load_model", load)
    path = tmp_path / "c.yaml"
    path.write_text("model: {max_model_len: 512}\nrotasched: {alpha: 1.5}\n")
    with pytest.raises(Stop):
        serving.cli.cmd_generate(build_parser().parse_args(
            ["generate", "hi", "--config", str(path), "--set", "engine.policy=swap"]))
    (cfg,) = seen
    assert cfg.engine.model.max_model_len == 512 and cfg.engine.rotasched.alpha == 1.5
    assert cfg.engine.engine.policy == "swap" and cfg.engine.duplex_kv.host_memory_gb == 0.0


def test_served_name_defaults_to_the_directory_name():
    cfg = DeploymentConfig.from_dict({"model": {"path": "/models/Llama-3-8B/"}})
    assert cfg.model.served_name == "Llama-3-8B" and cfg.model.source == "/models/Llama-3-8B/"


def test_tensor_parallel_size_reaches_the_engine():
    cfg = DeploymentConfig.from_dict({"model": {"tensor_parallel_size": 4}})
    assert cfg.engine_config().model.tensor_parallel_size == 4
    assert DeploymentConfig.load(None).engine_config().model.tensor_parallel_size == 1


def test_auto_kv_dtype_keeps_cpu_engines_off_bfloat16_scatter():
    import jax

    cfg = DeploymentConfig.from_dict({"model": {"dtype": "bfloat16"}})
    want = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    assert cfg.engine_config().model.kv_cache_dtype == want
    forced = DeploymentConfig.from_dict({"model": {"dtype": "bfloat16",
                                                   "kv_cache_dtype": "bfloat16"}})
    assert forced.engine_config().model.kv_cache_dtype == "bfloat16"


def test_auto_prefill_chunk_follows_the_token_budget():
    cfg = DeploymentConfig.from_dict({"engine": {"max_num_batched_tokens": 128}})
    assert cfg.engine.engine.max_prefill_chunk == 128
    assert cfg.get("engine.max_prefill_chunk") is None
    assert DeploymentConfig.load(None).engine.engine.max_prefill_chunk == 256
