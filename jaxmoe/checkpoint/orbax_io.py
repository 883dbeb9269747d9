"""Save and restore converted parameters with Orbax (restore keeps the target sharding).

A converted checkpoint directory holds ``params/`` (Orbax) and ``jaxmoe_config.json``; restoring it
skips the name mapping and transposes of a Hugging Face load.

Arrays are saved uncompressed (OCDBT, zarr v2, no zstd): Orbax's default zstd saves ~7% of the disk
space on (random fp32) weights but makes a restore ~2x slower on CPU -- slower than re-converting the
safetensors -- because decompression, not I/O, is the bottleneck (``bench/load_speed.py``,
BENCHMARKS.md).  Restore reads either form (the codec is recorded per array).
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp

from jaxmoe.config import ModelConfig

CONFIG_FILE = "jaxmoe_config.json"


def save_converted(directory: str | Path, params: dict, cfg: ModelConfig) -> None:
    directory = Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False)) as ckptr:
        ckptr.save(directory / "params", args=ocp.args.PyTreeSave(params), force=True)
    (directory / CONFIG_FILE).write_text(cfg.to_json())


def is_converted(directory: str | Path) -> bool:
    return (Path(directory) / CONFIG_FILE).exists()


def restore_converted(directory: str | Path, target: dict | None = None) -> tuple[dict, ModelConfig]:
    """Restore (params, cfg).  ``target`` is a pytree of arrays or ``jax.ShapeDtypeStruct`` with
    shardings to restore onto; by default everything lands on the default device."""
    directory = Path(directory).absolute()
    cfg = ModelConfig.from_json((directory / CONFIG_FILE).read_text())
    with ocp.StandardCheckpointer() as ckptr:
        if target is None:
            meta = ckptr.metadata(directory / "params")
            tree = getattr(meta, "item_metadata", meta)
            tree = getattr(tree, "tree", tree)
            sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding), tree)
        params = ckptr.restore(directory / "params", target)
    return params, cfg
