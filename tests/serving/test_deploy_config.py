"""The deployment file: the shipped example, the mapping onto EngineConfig, flags over the
file, and errors that name the key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from serving.cli import _ENGINE_FLAGS, _SERVER_FLAGS, _deployment, build_parser
from serving.deploy_config import (
    DeploymentConfig,
    _name_yaml_key,
    apply_overrides,
    parse_set,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "superinfer_config.yaml"


def test_shipped_example_is_valid_and_maps_onto_the_engine():
    cfg = DeploymentConfig.load(EXAMPLE)
    assert cfg.model.source == "smollm2-135m" and cfg.server.grpc_port == 50051
    assert cfg.server.host == "127.0.0.1" and cfg.server.http_port == 8000
    ec = cfg.engine_config()
    assert (ec.max_model_len, ec.max_num_seqs, ec.max_num_batched_tokens) == (2048, 32, 512)
    assert ec.page_size == 16 and ec.device_memory_fraction == 0.9
    assert ec.default_slo.ttft_ms == 5000 and ec.default_slo.tbt_ms == 100
    assert ec.max_prefill_chunk == 256 and ec.dtype == "float32"


def test_defaults_without_a_file_equal_the_example():
    default, example = DeploymentConfig.load(None), DeploymentConfig.load(EXAMPLE)
    assert dataclasses.replace(default, model=example.model) == example
    assert default.model.source == example.model.source == "smollm2-135m"
    assert default.model.served_name == example.model.served_name


@pytest.mark.parametrize("data, message", [
    ({"rotasched": {"alpha": -1}}, "rotasched.alpha must be >= 0, got -1"),
    ({"rotasched": {"alpah": 1}}, "unknown key rotasched.alpah"),
    ({"rotasched": {"policy": "lottery"}}, "rotasched.policy must be one of"),
    ({"model": {"tensor_parallel_size": 0}}, "model.tensor_parallel_size must be >= 1"),
    ({"model": {"dtype": "int4"}}, "model.dtype must be one of"),
    ({"hardware": {"page_size": "16"}}, "hardware.page_size must be an integer, got '16'"),
    ({"hardware": {"page_size": 12}}, "hardware.page_size must be a power of two"),
    ({"hardware": {"hbm_memory_fraction": 1.5}}, "hardware.hbm_memory_fraction must be <= 1"),
    ({"server": {"grpc_port": True}}, "server.grpc_port must be an integer, got True"),
    ({"server": {"http_port": 70000}}, "server.http_port must be <= 65535"),
    ({"server": {"tls_cert": "/nonexistent.pem"}}, "must be given together"),
    ({"server": {"api_key": ""}}, "server.api_key must not be empty"),
    ({"duplex_kv": {"eager_shadowing": "yes"}}, "duplex_kv.eager_shadowing must be true or"),
    ({"gpu": {}}, "unknown section 'gpu'"),
    ({"model": ["name"]}, "section 'model' must be a mapping"),
    ({"rotasched": {"max_num_batched_tokens": 64, "max_prefill_chunk": 128}},
     "rotasched.max_prefill_chunk (128) must not exceed"),
])
def test_bad_values_name_the_key(data, message):
    with pytest.raises(ValueError) as err:
        DeploymentConfig.from_dict(data).engine_config()
    assert message in str(err.value)


def test_tensor_parallel_size_reaches_the_engine():
    cfg = DeploymentConfig.from_dict({"model": {"tensor_parallel_size": 4}})
    assert cfg.engine_config().tensor_parallel_size == 4
    assert DeploymentConfig.load(None).engine_config().tensor_parallel_size == 1


def test_engine_errors_are_mapped_back_to_the_yaml_key():
    assert _name_yaml_key("max_num_seqs must be a positive int, got 0") == \
        "rotasched.max_num_seqs: max_num_seqs must be a positive int, got 0"
    assert _name_yaml_key("something else").startswith("engine config: ")


def test_rotasched_keys_reach_the_engine_and_the_rest_are_listed():
    cfg = DeploymentConfig.from_dict({
        "rotasched": {"policy": "swap", "alpha": 2.0, "beta_f": 0.25, "beta_b": 0.1,
                      "proactive_eviction_threshold": 0.7, "mode": "slack"},
        "duplex_kv": {"staging_buffer_mb": 32}})
    engine = cfg.engine_config()
    assert engine.policy == "swap"
    rs = engine.rotasched
    assert (rs.alpha, rs.beta_f, rs.beta_b, rs.high_water_mark, rs.mode) == (
        2.0, 0.25, 0.1, 0.7, "slack")
    assert cfg.not_applied() == ["duplex_kv.staging_buffer_mb=32"]
    with pytest.raises(ValueError, match="rotasched.mode"):
        DeploymentConfig.from_dict({"rotasched": {"mode": "edf"}})


def test_yaml_errors_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ValueError, match="invalid YAML"):
        DeploymentConfig.load(bad)
    with pytest.raises(ValueError, match="cannot read config"):
        DeploymentConfig.load(tmp_path / "missing.yaml")


def test_overrides_and_set():
    data = apply_overrides({"rotasched": {"alpha": 1.0}},
                           {"rotasched.alpha": 2.5, "server.grpc_port": None})
    assert data == {"rotasched": {"alpha": 2.5}}
    assert parse_set(["rotasched.alpha=2", "server.api_key=abc", "duplex_kv.eager_shadowing=no"]) \
        == {"rotasched.alpha": 2, "server.api_key": "abc", "duplex_kv.eager_shadowing": False}
    with pytest.raises(ValueError, match="expected section.key=value"):
        parse_set(["alpha"])


def test_flags_override_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {path: /models/x, name: served}\nrotasched: {max_num_seqs: 4}\n"
                    "server: {grpc_port: 6000}\n")
    args = build_parser().parse_args([
        "serve", "--config", str(path), "--max-num-seqs", "8", "--http-port", "9000",
        "--no-grpc", "--model", "smollm2-135m", "--set", "rotasched.beta_f=0.25"])
    cfg = _deployment(args, _ENGINE_FLAGS | _SERVER_FLAGS)
    assert cfg.rotasched.max_num_seqs == 8 and cfg.rotasched.beta_f == 0.25
    assert cfg.server.grpc_port == 6000 and cfg.server.http_port == 9000
    assert not cfg.server.enable_grpc and cfg.server.enable_http
    assert cfg.model.path is None and cfg.model.source == "smollm2-135m"
    bad = build_parser().parse_args(["serve", "--set", "rotasched.alpha=-3"])
    with pytest.raises(ValueError, match="rotasched.alpha must be >= 0"):
        _deployment(bad, _ENGINE_FLAGS | _SERVER_FLAGS)


def test_served_name_defaults_to_the_directory_name():
    cfg = DeploymentConfig.from_dict({"model": {"path": "/models/Llama-3-8B/"}})
    assert cfg.model.served_name == "Llama-3-8B" and cfg.model.source == "/models/Llama-3-8B/"


def test_auto_kv_dtype_keeps_cpu_engines_off_bfloat16_scatter():
    import jax

    cfg = DeploymentConfig.from_dict({"model": {"dtype": "bfloat16"}})
    want = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    assert cfg.engine_config().dtype == want
    forced = DeploymentConfig.from_dict({"model": {"dtype": "bfloat16",
                                                   "kv_cache_dtype": "bfloat16"}})
    assert forced.engine_config().dtype == "bfloat16"
