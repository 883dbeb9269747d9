"""Block-wise FP8 checkpoints (the DeepSeek-V3 / Qwen3-FP8 format): reading them, and making them.

A checkpoint in this format says in its ``config.json``::

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                            "activation_scheme": "dynamic"}

and stores each quantized linear weight ``<name>`` [out, in] as float8_e4m3fn beside ``<name>_scale_inv``
[ceil(out / 128), ceil(in / 128)] (float32): the weight is ``fp8 * scale_inv``, each scale broadcast over
its 128 x 128 block. Embeddings, norms, routers and the LM head stay unquantized.

``Fp8Checkpoint`` reads such a checkpoint like a plain one: ``read`` dequantizes one weight at a time,
row block by row block, to the dtype of the checkpoint's unquantized weights (``config.json``'s
``torch_dtype`` / ``dtype``; bfloat16 in the releases), as DeepSeek's own fp8-to-bf16 conversion does;
the loader then converts to the serving dtype. ``checkpoint_quantization`` reads the
``quantization_config`` and refuses methods jaxmoe does not load (AWQ, GPTQ, bitsandbytes, ...).

``quantize_checkpoint(src, dst)`` writes a plain checkpoint in this format; ``dequantize_checkpoint(src,
dst)`` writes an FP8 checkpoint back as a plain one (for tools that read only plain weights, and tests).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import ml_dtypes
import numpy as np

from jaxmoe.checkpoint.safetensors_reader import CheckpointError, SafetensorsCheckpoint, write_safetensors

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
SCALE_SUFFIX = "_scale_inv"
SUPPORTED = "'fp8' (block-wise float8 e4m3 weights with weight_block_size, dynamic activations)"
_FLOAT_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
# Linear weights left unquantized by the releases (and by ``quantize_checkpoint``): routers, Qwen2-MoE's
# shared-expert gate; embeddings and the LM head are excluded by name below.
_KEEP = re.compile(r".*(\.mlp\.gate|\.block_sparse_moe\.gate|\.shared_expert_gate)\.weight$")


@dataclasses.dataclass(frozen=True)
class Fp8Quantization:
    """A checkpoint's block-wise FP8 ``quantization_config``."""

    block: tuple[int, int]  # (rows, columns) of the [out, in] weight per scale

    def to_hf(self) -> dict[str, Any]:
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "weight_block_size": list(self.block),
            "activation_scheme": "dynamic",
        }


def checkpoint_quantization(hf: dict[str, Any]) -> Fp8Quantization | None:
    """The block-wise FP8 quantization a config.json declares (None: unquantized); a one-line
    ``CheckpointError`` naming the method or field for anything jaxmoe does not load."""
    q = hf.get("quantization_config")
    if not q:
        return None
    if not isinstance(q, dict):
        raise CheckpointError(f"config.json: quantization_config must be an object, got {q!r}")
    method = q.get("quant_method")
    if method != "fp8":
        raise CheckpointError(
            f"config.json: quantization_config.quant_method {method!r} is not supported; jaxmoe loads {SUPPORTED} "
            "and unquantized checkpoints (quantize those on load with quantization='int8' or 'fp8')"
        )
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(f"config.json: quantization_config.fmt {fmt!r} is not supported (fp8 checkpoints: e4m3)")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise CheckpointError(
            f"config.json: quantization_config.activation_scheme {scheme!r} is not supported (fp8 checkpoints: dynamic)"
        )
    block = q.get("weight_block_size")
    if not (
        isinstance(block, (list, tuple))
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise CheckpointError(
            f"config.json: quantization_config.weight_block_size must be two positive integers, got {block!r} "
            "(per-tensor fp8 checkpoints are not supported)"
        )
    return Fp8Quantization((block[0], block[1]))


def unquantized_dtype(hf: dict[str, Any]) -> np.dtype:
    """The dtype of a checkpoint's unquantized weights (``torch_dtype`` / ``dtype``; default bfloat16)."""
    name = hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"
    return np.dtype(_FLOAT_DTYPES.get(str(name).removeprefix("torch."), ml_dtypes.bfloat16))


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))


def quantize(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(float8_e4m3fn weight, float32 scale_inv per block) of a 2-D weight: each block's largest
    magnitude maps to the largest e4m3 value."""
    w = np.asarray(w, np.float32)
    (out, inp), (bo, bi) = w.shape, block
    nbo, nbi = scale_shape(w.shape, block)
    padded = np.zeros((nbo * bo, nbi * bi), np.float32)
    padded[:out, :inp] = w
    blocks = padded.reshape(nbo, bo, nbi, bi)
    amax = np.abs(blocks).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    q = (blocks / scale[:, None, :, None]).reshape(nbo * bo, nbi * bi)[:out, :inp]
    return np.clip(q, -FP8_MAX, FP8_MAX).astype(FP8), scale


def dequantize(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], dtype) -> np.ndarray:
    """``w * scale_inv`` (each scale over its block) in float32, rounded to ``dtype``; one row block
    at a time, so the float32 temporaries stay one block row in size."""
    (out, inp), (bo, bi) = w.shape, block
    result = np.empty((out, inp), dtype)
    scale_inv = np.asarray(scale_inv, np.float32)
    for i in range(scale_inv.shape[0]):
        rows = slice(i * bo, min((i + 1) * bo, out))
        result[rows] = w[rows].astype(np.float32) * np.repeat(scale_inv[i], bi)[:inp]
    return result


class Fp8Checkpoint:
    """A ``SafetensorsCheckpoint`` in the block-wise FP8 format, read as a plain one: its fp8 weights
    come out dequantized to ``dtype`` and their scale tensors are not among its ``names``."""

    def __init__(self, ckpt: SafetensorsCheckpoint, quant: Fp8Quantization, dtype):
        self.ckpt, self.quant, self.dtype_out = ckpt, quant, np.dtype(dtype)
        names = ckpt.names()
        self._scaled = {n for n in names if ckpt.dtype_name(n) == "F8_E4M3"}
        self._names = names - {n + SCALE_SUFFIX for n in self._scaled}

    def names(self) -> set[str]:
        return set(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.ckpt.shape(name)

    def nbytes(self, name: str) -> int:
        return self.ckpt.nbytes(name) + (self.ckpt.nbytes(name + SCALE_SUFFIX) if name in self._scaled else 0)

    def check(self, name: str) -> None:
        """Refuse a malformed scale of tensor ``name`` (missing, wrong shape or dtype, not finite and
        positive), naming the scale tensor."""
        if name not in self._scaled:
            return
        scale = name + SCALE_SUFFIX
        shape = self.ckpt.shape(name)
        if scale not in self.ckpt.names():
            raise CheckpointError(f"tensor {name!r} is float8_e4m3fn but its scale tensor {scale!r} is missing")
        if len(shape) != 2:
            raise CheckpointError(f"tensor {name!r} is float8_e4m3fn but not a 2-D weight (shape {shape})")
        expect = scale_shape(shape, self.quant.block)
        if self.ckpt.shape(scale) != expect:
            raise CheckpointError(
                f"scale tensor {scale!r} has shape {self.ckpt.shape(scale)}, expected {expect} "
                f"({list(shape)} in {list(self.quant.block)} blocks)"
            )
        if self.ckpt.dtype_name(scale) not in ("F32", "BF16", "F16"):
            raise CheckpointError(f"scale tensor {scale!r} has dtype {self.ckpt.dtype_name(scale)}, expected F32")
        values = self.ckpt.read(scale)
        if not np.all(np.isfinite(values)):
            raise CheckpointError(f"scale tensor {scale!r} holds non-finite values")
        if not np.all(values.astype(np.float32) > 0):
            raise CheckpointError(f"scale tensor {scale!r} holds values <= 0")

    def release(self) -> None:
        self.ckpt.release()

    def read(self, name: str) -> np.ndarray:
        if name not in self._scaled:
            return self.ckpt.read(name)
        scale = self.ckpt.read(name + SCALE_SUFFIX)
        return dequantize(self.ckpt.read(name), scale, self.quant.block, self.dtype_out)


def _quantizable(name: str, shape: tuple[int, ...]) -> bool:
    return (
        len(shape) == 2
        and name.endswith(".weight")
        and not name.endswith(("embed_tokens.weight", "lm_head.weight"))
        and not _KEEP.match(name)
    )


def _rewrite(
    src: Path, dst: Path, config: dict, tensors: Callable[[list[str]], list[tuple[str, tuple, np.dtype]]], produce
) -> None:
    """Write ``dst`` as ``src`` with each shard's tensors replaced (``tensors(names)`` -> specs,
    ``produce(name)`` -> values), the index rewritten, ``config`` as config.json, other files copied."""
    ckpt = SafetensorsCheckpoint(src)
    dst.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for shard, names in ckpt.files().items():
        specs = tensors(names)
        write_safetensors(dst / shard, specs, produce)
        weight_map.update({name: shard for name, _, _ in specs})
    index = src / "model.safetensors.index.json"
    if index.exists():
        meta = json.loads(index.read_text()).get("metadata", {})
        (dst / index.name).write_text(json.dumps({"metadata": meta, "weight_map": weight_map}, indent=2))
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", index.name):
            shutil.copy2(f, dst / f.name)


def quantize_checkpoint(src: str | Path, dst: str | Path, block: tuple[int, int] = (128, 128)) -> Path:
    """Write the plain checkpoint ``src`` to ``dst`` in the block-wise FP8 format: every linear weight
    but the routers, shared-expert gates, embeddings and LM head as float8_e4m3fn + ``_scale_inv``."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        raise CheckpointError(f"{src}: already quantized ({config['quantization_config'].get('quant_method')!r})")
    ckpt = SafetensorsCheckpoint(src)
    quant = Fp8Quantization(tuple(block))
    config["quantization_config"] = quant.to_hf()
    current: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # the one weight being written, with its scale

    def tensors(names):
        specs = []
        for name in sorted(names):
            shape = ckpt.shape(name)
            if _quantizable(name, shape):
                specs += [(name, shape, FP8), (name + SCALE_SUFFIX, scale_shape(shape, quant.block), np.float32)]
            else:
                specs.append((name, shape, ckpt.read(name).dtype))
        return specs

    def produce(name):
        if name.endswith(SCALE_SUFFIX):
            return current.pop(name)
        shape = ckpt.shape(name)
        if not _quantizable(name, shape):
            return ckpt.read(name)
        q, scale = quantize(ckpt.read(name), quant.block)
        current[name + SCALE_SUFFIX] = scale
        return q

    _rewrite(src, dst, config, tensors, produce)
    return dst


def dequantize_checkpoint(src: str | Path, dst: str | Path, dtype=None) -> Path:
    """Write the FP8 checkpoint ``src`` to ``dst`` as a plain one, weights dequantized to ``dtype``
    (default: the checkpoint's unquantized dtype), exactly as ``Fp8Checkpoint`` reads them."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    quant = checkpoint_quantization(config)
    if quant is None:
        raise CheckpointError(f"{src}: config.json has no fp8 quantization_config")
    dtype = np.dtype(dtype) if dtype is not None else unquantized_dtype(config)
    reader = Fp8Checkpoint(SafetensorsCheckpoint(src), quant, dtype)
    del config["quantization_config"]

    def tensors(names):
        names = sorted(n for n in names if n in reader.names())
        for n in names:
            reader.check(n)
        return [
            (n, reader.shape(n), dtype if reader.ckpt.dtype_name(n) == "F8_E4M3" else reader.read(n).dtype)
            for n in names
        ]

    _rewrite(src, dst, config, tensors, reader.read)
    return dst
