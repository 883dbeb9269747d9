"""The built-in models: ``demo`` and ``tiny-random``.

``demo`` is a small Mixtral trained on the Python standard library (``jaxmoe train``; how it was
made: docs/demo_model.md), shipped as a Hugging Face checkpoint in ``jaxmoe/assets/demo``.
``tiny-random`` is a tiny Mixtral-style MoE with random weights from a fixed seed and the byte-level
tokenizer: a test fixture (fast to compile), its text is noise.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxmoe.config import ModelConfig, from_hf_config
from jaxmoe.checkpoint.hf_names import param_plan

DEMO_DIR = Path(__file__).parent / "assets" / "demo"
TINY_RANDOM = "tiny-random"

DEMO_HF_CONFIG = {  # tiny-random
    "model_type": "mixtral",
    "vocab_size": 320,  # 258 byte-level ids, padded
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "tie_word_embeddings": False,
}


def demo_config() -> ModelConfig:
    return from_hf_config(DEMO_HF_CONFIG)


def demo_params(cfg: ModelConfig, seed: int = 0, dtype=np.float32) -> dict:
    """Random parameters with the same layout a checkpoint load produces."""
    from jaxmoe.checkpoint.loader import empty_tree, set_leaf
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    params = empty_tree(cfg)
    for leaf in param_plan(cfg):
        shape = leaf.shape[::-1] if leaf.transpose else leaf.shape
        if leaf.stack:
            shape = (len(leaf.sources),) + shape
        if len(shape) == 1:  # norms
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) * (1.0 / np.sqrt(shape[-2]))
        set_leaf(params, leaf.path, jnp.asarray(value.astype(dtype)))
    return params
