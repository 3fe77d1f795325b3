"""Policies by name and by ``module:Class`` path: one resolver, clear errors naming what is
missing, from every place a policy is resolved (the scheduler's factory, the simulator, the
CLI and the deployment file)."""

from __future__ import annotations

import ast
import sys
import textwrap
from pathlib import Path

import pytest

import superinfer_jax
from serving.cli import main as cli_main
from superinfer_jax.config import EngineConfig
from superinfer_jax.kv.two_tier import TwoTierKVManager
from superinfer_jax.sched.rotasched import (
    HOST,
    Policy,
    RotaSchedPolicy,
    make_policy,
    make_scheduler,
    register_policy,
    registered_policies,
    resolve_policy,
)
from superinfer_jax.sim.presets import get_preset


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """A directory on sys.path holding policy modules written by the test."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(name: str, source: str) -> None:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        sys.modules.pop(name, None)

    yield write


def test_builtins_are_registered_in_order():
    assert registered_policies()[:3] == ("fcfs", "swap", "rotasched")
    assert resolve_policy("rotasched") is RotaSchedPolicy


def test_the_builtins_do_not_import_the_registry():
    """The registry names the built-ins in a static table; ``policies`` never imports it
    back (no import cycle, no registration on import)."""
    source = (Path(superinfer_jax.__file__).parent / "sched/rotasched/policies.py").read_text()
    imported = {n.module for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)}
    assert not any("registry" in (m or "") for m in imported)
    assert "register_policy" not in source
    assert resolve_policy("superinfer_jax.sched.rotasched.policies:RotaSchedPolicy") \
        is RotaSchedPolicy


@pytest.mark.parametrize("spec, message", [
    ("lifo", "policy must be one of the registered policies ['fcfs', 'swap', 'rotasched'"),
    ("a:b:c", "package.module:Class path, got 'a:b:c'"),
    (":Cls", "package.module:Class path"),
    ("no_such_pkg.mod:Cls", "cannot import module 'no_such_pkg.mod' (ModuleNotFoundError"),
    ("superinfer_jax.request:Nothing", "module 'superinfer_jax.request' has no attribute "
                                       "'Nothing'"),
    ("superinfer_jax.request:PRIORITY_CLASSES", "PRIORITY_CLASSES is not a class"),
    ("superinfer_jax.request:Request", "Request does not implement the policy interface "
                                       "(missing contended, rank, evict_to, token_budget)"),
])
def test_bad_policy_names_say_what_is_missing(spec, message):
    with pytest.raises(ValueError) as e:
        resolve_policy(spec)
    assert message in str(e.value)
    config = EngineConfig.build(policy=spec)  # the config holds a name; the scheduler resolves it
    with pytest.raises(ValueError) as e:  # the same resolver behind the scheduler's factory
        make_policy(config)
    assert message in str(e.value)
    with pytest.raises(ValueError) as e:
        make_scheduler(config, TwoTierKVManager(7, 4, 64))
    assert message in str(e.value)


def test_a_module_that_fails_to_import_is_named_with_its_error(plugin_dir):
    plugin_dir("broken_policy", "raise RuntimeError('boom')\n")
    with pytest.raises(ValueError, match=r"cannot import module 'broken_policy' "
                                         r"\(RuntimeError: boom\)"):
        resolve_policy("broken_policy:P")


def test_a_partial_duck_typed_policy_names_the_missing_methods(plugin_dir):
    plugin_dir("half_policy", """
        class P:
            def __init__(self, config): pass
            def contended(self, s): return False
            def rank(self, s, now): return []
    """)
    with pytest.raises(ValueError, match=r"missing evict_to, token_budget"):
        make_policy(EngineConfig.build(policy="half_policy:P"))


def test_a_plugin_by_path_drives_the_scheduler(plugin_dir):
    """A Policy subclass in a user module, named by path: the config accepts it and the
    scheduler runs its decisions (here: every victim goes to the host, like swap)."""
    plugin_dir("my_policy", """
        from superinfer_jax.sched.rotasched import HOST, Policy

        class ToHost(Policy):
            def evict_to(self, s, req):
                return HOST
    """)
    cfg = EngineConfig.build(page_size=4, max_model_len=64, warmup=False,
                             policy="my_policy:ToHost", max_num_batched_tokens=64,
                             max_prefill_chunk=32)
    kv = TwoTierKVManager(7, 4, 64)
    sched = make_scheduler(cfg, kv)
    assert type(sched.policy).__name__ == "ToHost"
    from superinfer_jax.request import Request, SamplingParams

    reqs = [Request(r, list(range(1, 9)), SamplingParams(max_tokens=6)) for r in "abc"]
    for r in reqs:
        sched.add(r)
    plan = sched.schedule(0.0)
    for rid, n in plan.prefill:
        r = next(x for x in reqs if x.req_id == rid)
        r.num_computed_tokens += n
        r.output_token_ids.append(7)
    plan = sched.schedule(1.0)  # each needs a third page: the tail goes to the host
    assert plan.rotate_out == ["c"] and plan.preempted == []


def test_register_policy_adds_a_name_and_checks_the_interface():
    @register_policy("test-host-evictor")
    class HostEvictor(Policy):
        def evict_to(self, s, req):
            return HOST

    assert resolve_policy("test-host-evictor") is HostEvictor
    assert EngineConfig.build(policy="test-host-evictor").engine.policy == "test-host-evictor"
    with pytest.raises(TypeError, match="does not implement the policy interface"):
        register_policy("test-bad")(object)


def test_simulator_presets_take_paths_and_refuse_unknown_names():
    preset = get_preset("paper-llama8b-sharegpt")
    sim = preset.simulator("gh200-96g", "superinfer_jax.sched.rotasched.policies:SwapPolicy")
    assert sim.config.engine.policy.endswith(":SwapPolicy") and sim.latency is None
    assert preset.simulator("gh200-96g", "rotasched").latency is not None  # uses_latency
    from dataclasses import replace

    with pytest.raises(ValueError, match="cannot import module 'nope'"):
        replace(preset, policies=("fcfs", "nope:X"))


def test_simulate_command_names_the_bad_path(capsys):
    rc = cli_main(["simulate", "--no-progress", "--preset", "paper-llama8b-sharegpt",
                   "--policies", "fcfs,superinfer_jax.request:Request"])
    assert rc == 2
    assert "does not implement the policy interface" in capsys.readouterr().err
