"""Hugging Face safetensors -> jaxmoe parameters, one tensor at a time onto its target placement.

Every tensor is checked (present, expected shape, complete on disk) before any is loaded, so a bad
checkpoint fails fast with a message naming the tensor.  Tensors are memory-mapped, converted and
placed leaf by leaf: at most one leaf (one layer's stacked experts) is ever held on the host.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxmoe.progress import progress as progress_reporter

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


def check_checkpoint(ckpt: SafetensorsCheckpoint, cfg: ModelConfig) -> None:
    plan = param_plan(cfg)
    expected = {s: leaf.shape for leaf in plan for s in leaf.sources}
    names = ckpt.names()
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


def set_leaf(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree[key] if isinstance(key, int) else tree.setdefault(key, {})
    tree[path[-1]] = value


def empty_tree(cfg: ModelConfig) -> dict:
    return {"layers": [{"attn": {}} for _ in range(cfg.num_layers)]}


def load_params(
    directory: str | Path, cfg: ModelConfig, *, dtype=None, place: Place | None = None, progress: bool | None = None
) -> dict:
    """Load a checkpoint's parameters as a pytree of jax arrays.

    ``dtype`` converts every tensor (default: keep the checkpoint's dtype); ``place(path, array)``
    puts one converted host array where it belongs (default: the default device).  ``progress``
    reports on stderr (bytes read, checkpoint tensors done; a tqdm bar on a terminal, else lines:
    ``jaxmoe.progress``): True / False force it on / off, None (the default) reports when the
    checkpoint holds more than 1 GiB.
    """
    ckpt = SafetensorsCheckpoint(directory)
    check_checkpoint(ckpt, cfg)
    plan = param_plan(cfg)
    sizes = [sum(ckpt.nbytes(s) for s in leaf.sources) for leaf in plan]
    total, num_tensors, done = sum(sizes), sum(len(leaf.sources) for leaf in plan), 0
    if progress is None:
        progress = total > _PROGRESS_BYTES
    place = place or (lambda path, x: jnp.asarray(x))
    params = empty_tree(cfg)
    with progress_reporter(
        "loading weights", total, "B", None if progress else False, unit_scale=True, unit_divisor=1024
    ) as bar:
        for leaf, size in zip(plan, sizes):
            arrays = [ckpt.read(s) for s in leaf.sources]
            host = np.stack(arrays) if leaf.stack else arrays[0]
            if leaf.transpose:
                host = np.swapaxes(host, -1, -2)
            if dtype is not None:
                host = host.astype(jnp.dtype(dtype))
            set_leaf(params, leaf.path, place(leaf.path, np.ascontiguousarray(host)))
            done += len(leaf.sources)
            bar.set_postfix_str(f"{done}/{num_tensors} tensors", refresh=False)
            bar.update(size)
    return params
