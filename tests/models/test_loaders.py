"""load_model dispatch, error messages for bad inputs, and the Orbax round trip."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from models import PRESETS, load_model, random_servable, save_orbax
from models.loaders import ORBAX_MARKER, ParamSink, abstract_model, embedded_gguf_path


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# --------------------------------------------------------------------------- names and paths
def test_unknown_name_lists_presets() -> None:
    with pytest.raises(ValueError, match="no-such-model") as err:
        load_model("no-such-model")
    assert "smollm2-135m" in str(err.value) and "llama-3-8b" in str(err.value)


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "model"
    with pytest.raises(ValueError, match=str(missing)):
        load_model(str(missing))


@pytest.mark.parametrize("name", ["llama-3-8b", "llama-3-70b", "qwen2.5-32b"])
def test_big_presets_need_a_directory(name: str) -> None:
    with pytest.raises(ValueError, match=rf"{name}.*--model /path"):
        load_model(name)


def test_bad_dtype() -> None:
    with pytest.raises(ValueError, match="dtype"):
        load_model("smollm2-135m", dtype="int8")


def test_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path))


# --------------------------------------------------------------------------- GGUF
@pytest.mark.parametrize("size", [2, 200, 1_000_000])
def test_truncated_gguf(tmp_path: Path, size: int) -> None:
    src = embedded_gguf_path("smollm2-135m")
    bad = tmp_path / "truncated.gguf"
    with open(src, "rb") as f:
        bad.write_bytes(f.read(size))
    with pytest.raises(ValueError, match=r"truncated\.gguf.*(truncated|not a GGUF)"):
        load_model(str(bad))


def test_non_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "weights.gguf"
    bad.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ValueError, match="weights.gguf.*magic"):
        load_model(str(bad))


# --------------------------------------------------------------------------- Hugging Face dirs
def test_hf_dir_missing_config(tmp_path: Path, tiny_llama) -> None:
    path = copy_dir(tiny_llama[1], tmp_path / "m")
    (path / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(path))


def test_corrupt_safetensors(tmp_path: Path, tiny_llama) -> None:
    path = copy_dir(tiny_llama[1], tmp_path / "m")
    (path / "model.safetensors").write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ValueError, match=r"model\.safetensors.*corrupt"):
        load_model(str(path))


def test_truncated_safetensors(tmp_path: Path, tiny_llama) -> None:
    path = copy_dir(tiny_llama[1], tmp_path / "m")
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors.*(corrupt|truncated)"):
        load_model(str(path))


def test_shape_mismatch_names_tensor(tmp_path: Path, tiny_llama) -> None:
    path = copy_dir(tiny_llama[1], tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] += 8
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"mlp\.(gate|up|down)_proj.*does not match"):
        load_model(str(path))


def test_index_with_missing_shard(tmp_path: Path, tiny_llama) -> None:
    path = copy_dir(tiny_llama[2], tmp_path / "m")
    shard = sorted(path.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(ValueError, match=shard.name):
        load_model(str(path))


def test_unsupported_rope_type(tmp_path: Path, tiny_llama) -> None:
    path = copy_dir(tiny_llama[1], tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"]["rope_type"] = "yarn"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="yarn"):
        load_model(str(path))


def test_missing_tokenizer(tmp_path: Path, tiny_llama) -> None:
    path = copy_dir(tiny_llama[1], tmp_path / "m")
    (path / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_model(str(path))


# --------------------------------------------------------------------------- building
def test_abstract_model_allocates_nothing() -> None:
    _, state = abstract_model(PRESETS["llama-3-8b"], "bfloat16")
    leaves = jax.tree.leaves(nnx.to_pure_dict(state))
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


def test_param_sink_reports_missing_tensors() -> None:
    cfg = PRESETS["smollm2-135m"].replace(num_layers=1, vocab_size=64)
    sink = ParamSink(cfg, "float32")
    sink.put(("embed",), np.zeros((64, 576), np.float32), "test")
    with pytest.raises(ValueError, match="missing .* weight tensors.*final_norm"):
        sink.build("test-source")


# --------------------------------------------------------------------------- Orbax
def params_equal(a, b) -> None:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_orbax_round_trip(tmp_path: Path, tiny_llama) -> None:
    original = load_model(str(tiny_llama[1]))
    saved = save_orbax(original, tmp_path / "ckpt")
    assert (saved / ORBAX_MARKER).is_file()
    restored = load_model(str(saved))
    assert restored.config == original.config
    params_equal(restored.params, original.params)
    ids = original.tokenizer.encode("The quick brown fox jumps")
    assert restored.tokenizer.encode("The quick brown fox jumps") == ids
    assert restored.tokenizer.meta() == original.tokenizer.meta()
    np.testing.assert_array_equal(restored.logits(ids), original.logits(ids))


def test_orbax_restore_casts_and_overwrites(tmp_path: Path) -> None:
    cfg = PRESETS["smollm2-135m"].replace(num_layers=2, vocab_size=128, name="tiny")
    first = random_servable(cfg, seed=1)
    second = random_servable(cfg, seed=2)
    save_orbax(first, tmp_path / "ckpt")
    save_orbax(second, tmp_path / "ckpt")  # replacing a checkpoint in place works
    restored = load_model(str(tmp_path / "ckpt"), dtype="bfloat16")
    assert restored.tokenizer is None and restored.dtype == "bfloat16"
    expected = jax.tree.map(lambda x: x.astype("bfloat16"), second.params)
    params_equal(restored.params, expected)


def test_orbax_incomplete_checkpoint_is_rejected(tmp_path: Path) -> None:
    cfg = PRESETS["smollm2-135m"].replace(num_layers=1, vocab_size=64, name="tiny")
    path = save_orbax(random_servable(cfg), tmp_path / "ckpt")
    shutil.rmtree(path / "params")
    with pytest.raises(ValueError, match="params"):
        load_model(str(path))
