"""Hugging Face safetensors -> jaxmoe parameters, one tensor at a time onto its target placement.

Every tensor is checked (present, expected shape, complete on disk; an FP8 weight's scale) before any
is loaded, so a bad checkpoint fails fast with a message naming the tensor.  Tensors are memory-mapped,
converted and placed leaf by leaf: at most one leaf (one layer's stacked experts) is ever held on the
host, and the mapped pages are released after each, so the resident memory of a load stays near the
parameters' own bytes (``tests/checkpoint/test_load_memory.py``).  Block-wise FP8 checkpoints
(``fp8.py``) are dequantized as they are read.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxmoe.progress import progress as progress_reporter

from jaxmoe.checkpoint.fp8 import Fp8Checkpoint, checkpoint_quantization, unquantized_dtype
from jaxmoe.checkpoint.hf_names import param_plan
from jaxmoe.checkpoint.safetensors_reader import CheckpointError, SafetensorsCheckpoint
from jaxmoe.config import ModelConfig

Place = Callable[[tuple, np.ndarray], jax.Array]
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_PROGRESS_BYTES = 1 << 30


def _ignorable(name: str, cfg: ModelConfig) -> bool:
    if _IGNORED.match(name):
        return True
    m = re.match(r"model\.layers\.(\d+)\.", name)  # e.g. DeepSeek-V3 multi-token-prediction layers
    return bool(m) and int(m.group(1)) >= cfg.num_layers


def check_checkpoint(ckpt: SafetensorsCheckpoint | Fp8Checkpoint, cfg: ModelConfig) -> None:
    plan = param_plan(cfg)
    expected = {s: leaf.shape for leaf in plan for s in leaf.sources}
    names = ckpt.names()
    if not isinstance(ckpt, Fp8Checkpoint):
        fp8 = sorted(n for n in expected if n in names and ckpt.dtype_name(n).startswith("F8"))
        if fp8:
            raise CheckpointError(
                f"tensor {fp8[0]!r} is {ckpt.dtype_name(fp8[0])} but config.json has no fp8 quantization_config"
            )
    missing = sorted(set(expected) - names)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"missing tensor {missing[0]!r}{more}")
    extra = sorted(n for n in names - set(expected) if not _ignorable(n, cfg))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(f"unexpected tensor {extra[0]!r}{more} for a {cfg.family} model")
    for name, shape in expected.items():
        if ckpt.shape(name) != shape:
            raise CheckpointError(f"tensor {name!r} has shape {ckpt.shape(name)}, config implies {shape}")
        if isinstance(ckpt, Fp8Checkpoint):
            ckpt.check(name)


def open_checkpoint(directory: str | Path) -> SafetensorsCheckpoint | Fp8Checkpoint:
    """The checkpoint's tensors, dequantized on read if its config.json declares block-wise FP8
    (``fp8.checkpoint_quantization``, which refuses methods jaxmoe does not load)."""
    ckpt = SafetensorsCheckpoint(directory)
    config = Path(directory) / "config.json"
    hf = json.loads(config.read_text()) if config.exists() else {}
    quant = checkpoint_quantization(hf)
    return ckpt if quant is None else Fp8Checkpoint(ckpt, quant, unquantized_dtype(hf))


def set_leaf(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree[key] if isinstance(key, int) else tree.setdefault(key, {})
    tree[path[-1]] = value


def empty_tree(cfg: ModelConfig) -> dict:
    return {"layers": [{"attn": {}} for _ in range(cfg.num_layers)]}


def _leaf_array(ckpt, leaf, dtype) -> np.ndarray:
    """One leaf as a new host array: its tensors copied (transposed, converted, stacked) straight from
    the mapped file into the one array, so a leaf costs its own bytes once (plus its mapped pages)."""
    first = ckpt.read(leaf.sources[0])
    shape = first.shape[::-1] if leaf.transpose else first.shape
    out = np.empty(
        ((len(leaf.sources),) if leaf.stack else ()) + shape, first.dtype if dtype is None else jnp.dtype(dtype)
    )
    for i, name in enumerate(leaf.sources):
        a = first if i == 0 else ckpt.read(name)
        (out[i] if leaf.stack else out)[...] = a.T if leaf.transpose else a
    return out


def load_params(
    directory: str | Path, cfg: ModelConfig, *, dtype=None, place: Place | None = None, progress: bool | None = None
) -> dict:
    """Load a checkpoint's parameters as a pytree of jax arrays.

    ``dtype`` converts every tensor (default: keep the checkpoint's dtype; FP8 weights come out in the
    dtype of its unquantized ones); ``place(path, array)`` puts one converted host array where it
    belongs (default: the default device, synchronously).  ``progress`` reports on stderr (bytes
    read, checkpoint tensors done; a tqdm bar on a terminal, else lines: ``jaxmoe.progress``): True /
    False force it on / off, None (the default) reports when the checkpoint holds more than 1 GiB.
    """
    ckpt = open_checkpoint(directory)
    check_checkpoint(ckpt, cfg)
    plan = param_plan(cfg)
    sizes = [sum(ckpt.nbytes(s) for s in leaf.sources) for leaf in plan]
    total, num_tensors, done = sum(sizes), sum(len(leaf.sources) for leaf in plan), 0
    if progress is None:
        progress = total > _PROGRESS_BYTES
    place = place or (lambda path, x: jax.device_put(x).block_until_ready())  # no host copy left in flight
    params = empty_tree(cfg)
    with progress_reporter(
        "loading weights", total, "B", None if progress else False, unit_scale=True, unit_divisor=1024
    ) as bar:
        for leaf, size in zip(plan, sizes):
            host = _leaf_array(ckpt, leaf, dtype)
            set_leaf(params, leaf.path, place(leaf.path, host))
            del host
            ckpt.release()  # the file pages this leaf touched leave the process's resident memory
            done += len(leaf.sources)
            bar.set_postfix_str(f"{done}/{num_tensors} tensors", refresh=False)
            bar.update(size)
    return params
