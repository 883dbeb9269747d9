"""Write a trained model as a checkpoint directory that serves with no training code.

An MoE model becomes a Hugging Face Mixtral checkpoint (``config.json``, ``model.safetensors``,
``generation_config.json``, tokenizer files) that ``LLM(dir)`` and transformers'
``AutoModelForCausalLM.from_pretrained(dir)`` both load: every tensor is the inverse of what
``checkpoint.hf_names.param_plan`` maps (transposed back to [out, in], experts unstacked).
A dense baseline has no Mixtral form; it is saved converted (``checkpoint.save_converted``, weights
rounded to bf16 as the safetensors are), which ``LLM(dir)`` and ``jaxmoe eval`` read as well.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.checkpoint.hf_names import param_plan
from jaxmoe.checkpoint.orbax_io import save_converted
from jaxmoe.config import ModelConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def hf_tensors(params: dict, cfg: ModelConfig, dtype=jnp.bfloat16) -> dict[str, np.ndarray]:
    """Hugging Face tensor name -> array, for every leaf of ``param_plan(cfg)``."""
    tensors = {}
    for leaf in param_plan(cfg):
        value = params
        for key in leaf.path:
            value = value[key]
        value = jnp.asarray(value, dtype)
        if leaf.transpose:
            value = jnp.swapaxes(value, -1, -2)
        parts = list(value) if leaf.stack else [value]
        for name, part in zip(leaf.sources, parts):
            if tuple(part.shape) != leaf.shape:
                raise ValueError(f"{name}: shape {tuple(part.shape)}, config implies {leaf.shape}")
            tensors[name] = np.ascontiguousarray(np.asarray(part))
    return tensors


def export_model(
    directory: str | Path,
    params: dict,
    cfg: ModelConfig,
    hf_config: dict | None,
    tokenizer_dir: str | Path,
    generation_config: dict | None = None,
) -> Path:
    """Write the model to ``directory``: HF Mixtral form when ``hf_config`` is given, else converted."""
    from safetensors.numpy import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if hf_config is None:  # bf16-valued like the safetensors, stored fp32 (Orbax)
        save_converted(directory, jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16).astype(jnp.float32), params), cfg)
    else:
        (directory / "config.json").write_text(json.dumps({**hf_config, "torch_dtype": "bfloat16"}, indent=2) + "\n")
        save_file(hf_tensors(params, cfg), str(directory / "model.safetensors"), metadata={"format": "pt"})
    if generation_config is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copyfile(Path(tokenizer_dir) / name, directory / name)
    return directory


def default_generation_config(hf_config: dict | None) -> dict:
    """Sampling defaults shipped beside the weights (a small model repeats itself when greedy)."""
    hf_config = hf_config or {}
    return {
        "bos_token_id": hf_config.get("bos_token_id"),
        "eos_token_id": hf_config.get("eos_token_id"),
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.9,
    }
