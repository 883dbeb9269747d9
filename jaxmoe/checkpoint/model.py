"""A model by name: a built-in (``demo``, ``tiny-random``), a jaxmoe-converted directory (Orbax) or a
Hugging Face checkpoint directory (config.json + safetensors + tokenizer.json)."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp

from jaxmoe.checkpoint.loader import load_params
from jaxmoe.checkpoint.orbax_io import is_converted, restore_converted
from jaxmoe.config import ModelConfig, load_config
from jaxmoe.demo import DEMO_DIR, TINY_RANDOM, demo_config, demo_params
from jaxmoe.quantization import check_method, quantize_params
from jaxmoe.tokenizer import ByteTokenizer, load_tokenizer


def model_dir(model: str | Path) -> Path:
    """The directory a model name stands for (``demo``: the shipped demo checkpoint)."""
    return DEMO_DIR if str(model) == "demo" else Path(model)


def load_model(
    model: str | Path, dtype=None, quantization: str | None = None, quantize_attention: bool = False
) -> tuple[ModelConfig, dict, object]:
    """(config, params, tokenizer) for a built-in name (``demo``: the trained demo model shipped in
    ``jaxmoe/assets/demo``; ``tiny-random``: a tiny random-weight model with the byte tokenizer, for
    tests), a jaxmoe-converted directory or an HF checkpoint. ``quantization`` ("int8" / "fp8"): the
    routed expert weights (with ``quantize_attention`` the attention projections too) are quantized on
    load (``jaxmoe.quantization``)."""
    check_method(quantization)
    if quantize_attention and quantization is None:
        raise ValueError("quantize_attention needs quantization='int8' or 'fp8'")
    cfg, params, tokenizer = _load_model(model, dtype)
    return cfg, quantize_params(params, quantization, quantize_attention), tokenizer


def _load_model(model: str | Path, dtype=None) -> tuple[ModelConfig, dict, object]:
    if str(model) == TINY_RANDOM:
        cfg = demo_config()
        return cfg, demo_params(cfg, dtype=jnp.dtype(dtype or jnp.float32)), ByteTokenizer()
    path = model_dir(model)
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {str(model)!r} is neither a built-in name ('demo', '{TINY_RANDOM}') nor a checkpoint directory"
        )
    if is_converted(path):
        params, cfg = restore_converted(path)
    else:
        cfg = load_config(path)
        params = load_params(path, cfg, dtype=dtype)
    tokenizer = load_tokenizer(path) if (path / "tokenizer.json").exists() else ByteTokenizer()
    return cfg, params, tokenizer


def generation_config(model: str | Path) -> dict:
    """A model's suggested sampling: its ``generation_config.json``'s temperature, top_p and top_k
    when it sets ``do_sample``, as ``SamplingParams`` keyword arguments; {} otherwise (greedy). Every
    front end fills the fields a request leaves unset from it (docs/serving.md)."""
    try:
        conf = json.loads((model_dir(model) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(conf, dict) or not conf.get("do_sample"):
        return {}
    return {
        k: conf[k]
        for k in ("temperature", "top_p", "top_k")
        if isinstance(conf.get(k), (int, float)) and not isinstance(conf.get(k), bool)
    }
