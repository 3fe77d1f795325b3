"""``engine.compile_in_background``: on in the server profile (the file's default), and a
bad value refused naming the key (YAML file, ``--set``) or the flag, before anything
starts."""

from __future__ import annotations

import pytest

from serving.cli import main
from serving.deploy_config import DeploymentConfig
from superinfer_jax.config_schema import ConfigError


def test_a_server_compiles_in_the_background_by_default():
    assert DeploymentConfig.load().engine.engine.compile_in_background is True
    off = DeploymentConfig.load(None, {"engine.compile_in_background": False})
    assert off.engine.engine.compile_in_background is False
    library = DeploymentConfig.load(None, {"profile": "library"})
    assert library.engine.engine.compile_in_background is False


def test_bad_yaml_value_names_the_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("engine:\n  compile_in_background: sometimes\n")
    with pytest.raises(ConfigError) as e:
        DeploymentConfig.load(path)
    assert e.value.key == "engine.compile_in_background"
    assert "must be true or false, got 'sometimes'" in str(e.value)


def test_bad_cli_values_exit_2_naming_the_key_or_flag(capsys):
    assert main(["serve", "--set", "engine.compile_in_background=sometimes"]) == 2
    assert "error: engine.compile_in_background: must be true or false" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["serve", "--compile-in-background=sometimes"])
    assert e.value.code == 2
    assert "--compile-in-background" in capsys.readouterr().err
