"""Random-weight Mixtral-shaped checkpoints of any size, written tensor by tensor (``bench/big_checkpoint.py``
and the loader's memory tests): a Hugging Face directory (``config.json``, sharded safetensors and
their index) whose tensors are drawn one at a time with numpy, so writing one never holds more than a
tensor in memory."""

from __future__ import annotations

import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
from tqdm import tqdm

from jaxmoe.checkpoint.hf_names import param_plan
from jaxmoe.checkpoint.safetensors_reader import write_safetensors
from jaxmoe.config import from_hf_config


def mixtral_config(
    hidden: int = 2048,
    intermediate: int = 5632,
    layers: int = 10,
    experts: int = 8,
    top_k: int = 2,
    heads: int = 32,
    kv_heads: int = 8,
    vocab: int = 32000,
) -> dict:
    """A Mixtral ``config.json`` (the defaults: about 3.0 B parameters)."""
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_local_experts": experts,
        "num_experts_per_tok": top_k,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }


def tensors(hf: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor (name, shape) of the checkpoint, in the loader's order."""
    return [(s, leaf.shape) for leaf in param_plan(from_hf_config(hf)) for s in leaf.sources]


def num_params(hf: dict) -> int:
    return sum(math.prod(shape) for _, shape in tensors(hf))


def write_random_checkpoint(
    directory: str | Path,
    hf: dict,
    dtype=ml_dtypes.bfloat16,
    shard_bytes: int = 2 << 30,
    seed: int = 0,
    progress: bool = False,
) -> int:
    """Write a random checkpoint of config ``hf`` into ``directory`` (shards of at most ``shard_bytes``,
    but one tensor each at least); returns its tensor bytes. Matrices ~ N(0, 1 / fan_in), norms 1."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(dtype)
    specs = tensors(hf)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    rng = np.random.default_rng(seed)
    shapes = dict(specs)

    def produce(name):
        shape = shapes[name]
        if len(shape) == 1:
            return np.ones(shape, dtype)
        return (rng.standard_normal(shape, dtype=np.float32) / np.float32(math.sqrt(shape[-1]))).astype(dtype)

    weight_map, total = {}, 0
    bar = tqdm(
        total=sum(math.prod(s) for _, s in specs) * dtype.itemsize,
        unit="B",
        unit_scale=True,
        desc="writing checkpoint",
        disable=not progress,
    )
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"

        def produce_counted(name):
            a = produce(name)
            bar.update(a.nbytes)
            return a

        write_safetensors(directory / file, [(n, s, dtype) for n, s in shard], produce_counted)
        weight_map.update({n: file for n, _ in shard})
        total += sum(math.prod(s) for _, s in shard) * dtype.itemsize
    bar.close()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(hf, indent=2))
    return total
