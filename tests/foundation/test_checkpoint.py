"""Checkpoint loading: sharded and bf16 safetensors, every error case naming its tensor, Orbax round trip,
unsupported architectures, and the tokenizer against transformers'."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxmoe import CheckpointError, UnsupportedModelError, load_config, load_params
from jaxmoe.checkpoint import restore_converted, save_converted
from jaxmoe.tokenizer import load_tokenizer


def _leaves(params):
    return jax.tree_util.tree_leaves_with_path(params)


def _assert_same_params(a, b):
    la, lb = _leaves(a), _leaves(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32), err_msg=str(path))


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rewrite(path, edit):
    """Apply edit(dict of numpy tensors) to a single-file fp32 checkpoint."""
    f = path / "model.safetensors"
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f)


def test_sharded_and_bf16_checkpoints_load(checkpoint_dir):
    single = checkpoint_dir("qwen2_moe")
    sharded = checkpoint_dir("qwen2_moe", sharded=True)
    assert (sharded / "model.safetensors.index.json").exists()
    cfg = load_config(single)
    a = load_params(single, cfg)
    b = load_params(sharded, cfg)
    _assert_same_params(a, b)
    bf16 = checkpoint_dir("qwen2_moe", dtype="bfloat16")
    c = load_params(bf16, cfg)
    assert c["layers"][1]["moe"]["w_gate"].dtype == jnp.bfloat16
    up = load_params(bf16, cfg, dtype="float32")
    assert up["embed"].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(up["embed"]), np.asarray(a["embed"]), rtol=1e-2, atol=1e-2)


def test_load_places_each_tensor_with_the_callback(checkpoint_dir):
    path = checkpoint_dir("mixtral")
    cfg = load_config(path)
    devices = jax.devices()
    seen = []

    def place(leaf_path, host):
        seen.append(leaf_path)
        return jax.device_put(host, devices[1])

    params = load_params(path, cfg, place=place)
    assert ("layers", 0, "moe", "w_gate") in seen
    assert params["layers"][0]["moe"]["w_gate"].shape == (8, 32, 48)  # [E, D, F], stacked per expert
    assert all(x.devices() == {devices[1]} for x in jax.tree.leaves(params))


def test_load_progress_bar_forced_on_and_off(checkpoint_dir, capsys):

    from jaxmoe.checkpoint import SafetensorsCheckpoint

    path = checkpoint_dir("mixtral")
    cfg = load_config(path)
    ckpt = SafetensorsCheckpoint(path)
    mib = f"{sum(ckpt.nbytes(n) for n in ckpt.names()) / (1 << 20):.1f} MiB"
    capsys.readouterr()
    load_params(path, cfg)  # auto: a tiny checkpoint (< 1 GiB) shows nothing
    load_params(path, cfg, progress=False)
    assert capsys.readouterr().err == ""
    load_params(path, cfg, progress=True)
    err = capsys.readouterr().err  # not a terminal: lines (jaxmoe.progress), bytes read / total bytes
    assert f"loading weights: {mib} to go" in err and f"loading weights: done, {mib}/{mib}" in err


@pytest.mark.parametrize("case", ["missing", "extra", "misshaped", "truncated", "index_missing_shard"])
def test_bad_checkpoints_fail_naming_the_tensor(checkpoint_dir, tmp_path, case):
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    if case == "index_missing_shard":
        path = _copy(checkpoint_dir("qwen2_moe", sharded=True), tmp_path / "ckpt")
        index = json.loads((path / "model.safetensors.index.json").read_text())
        shard = index["weight_map"][name]
        (path / shard).unlink()
        with pytest.raises(CheckpointError, match=shard):
            load_params(path, load_config(path))
        return
    path = _copy(checkpoint_dir("qwen2_moe"), tmp_path / "ckpt")
    cfg = load_config(path)
    if case == "missing":
        _rewrite(path, lambda t: t.pop(name))
        match = f"missing tensor '{name}'"
    elif case == "extra":
        _rewrite(path, lambda t: t.update({"model.layers.1.mlp.bogus.weight": np.ones(3, np.float32)}))
        match = "unexpected tensor 'model.layers.1.mlp.bogus.weight'"
    elif case == "misshaped":
        _rewrite(path, lambda t: t.update({name: np.ones((3, 3), np.float32)}))
        match = rf"tensor '{name}' has shape \(3, 3\)"
    else:
        f = path / "model.safetensors"
        data = f.read_bytes()
        f.write_bytes(data[: len(data) - 64])
        match = "truncated"
    with pytest.raises(CheckpointError, match=match):
        load_params(path, cfg)


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match="supports mixtral, qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3"):
        load_config(tmp_path)


@pytest.mark.slow
def test_orbax_round_trip_keeps_values_and_sharding(checkpoint_dir, tmp_path):
    path = checkpoint_dir("deepseek_v3")
    cfg = load_config(path)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def place(leaf_path, host):
        return jax.device_put(host, sharded if leaf_path[-1] in ("w_gate", "w_up", "w_down") else replicated)

    params = load_params(path, cfg, place=place)
    save_converted(tmp_path / "converted", params, cfg)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
    restored, cfg2 = restore_converted(tmp_path / "converted", target)
    assert cfg2 == cfg
    _assert_same_params(params, restored)
    w = restored["layers"][1]["moe"]["w_gate"]
    assert w.sharding.is_equivalent_to(sharded, w.ndim)


def test_tokenizer_matches_transformers(checkpoint_dir):
    from transformers import AutoTokenizer

    path = checkpoint_dir("qwen3_moe")
    ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    for text in ["hello world", "Mixture of experts!", "a b  c"]:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text), skip_special_tokens=True)
    messages = [{"role": "user", "content": "hi there"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    mixtral = checkpoint_dir("mixtral")
    ours, theirs = load_tokenizer(mixtral), AutoTokenizer.from_pretrained(mixtral)
    assert ours.encode("hello world") == theirs.encode("hello world")
