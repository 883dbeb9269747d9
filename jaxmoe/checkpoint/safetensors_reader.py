"""Lazy, zero-copy reading of (sharded) safetensors checkpoints, and streaming writing of one file.

The ``safetensors`` package's numpy backend cannot return bf16 tensors and reports a truncated
file without naming the tensor, so this reader parses the (simple, documented) header itself and
memory-maps the data: a tensor is read from disk only when asked for, and errors name it.
``write_safetensors`` writes a file tensor by tensor (bf16 and fp8 included), never holding more
than one tensor.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Callable, Iterable

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}


_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed, truncated or does not fit the model's config."""


class _File:
    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than its header)")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise CheckpointError(f"{path}: truncated safetensors header")
            try:
                header = json.loads(f.read(n))
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{path}: malformed safetensors header: {e}") from None
        header.pop("__metadata__", None)
        self.header = header
        self.data_start = 8 + n
        self.size = size
        self._mmap = None

    def read(self, name: str) -> np.ndarray:
        info = self.header[name]
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if self.data_start + end > self.size:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} is truncated (needs bytes up to {self.data_start + end}, "
                f"file has {self.size})"
            )
        if end - start != int(np.prod(shape)) * np.dtype(dtype).itemsize:
            raise CheckpointError(f"{self.path}: tensor {name!r}: byte size does not match shape {shape}")
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mmap[self.data_start + start : self.data_start + end].view(dtype).reshape(shape)


SIDECARS = ("united_experts.safetensors",)  # beside the model, not part of it (jaxmoe.brownout.united)


class SafetensorsCheckpoint:
    """All tensors of a checkpoint directory: ``model.safetensors`` or an index of shards (files in
    ``SIDECARS`` are not the model's)."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        index = directory / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: malformed index ({e})") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors") if p.name not in SIDECARS)
            if not files:
                raise CheckpointError(f"{directory}: no *.safetensors files")
        self._files: dict[str, _File] = {}
        self._where: dict[str, _File] = {}
        for name in files:
            path = directory / name
            if not path.exists():
                raise CheckpointError(f"{directory}: shard {name} listed in the index is missing")
            f = self._files[name] = _File(path)
            for tensor in f.header:
                self._where[tensor] = f
        if index.exists():
            for tensor, name in weight_map.items():
                if tensor not in self._where:
                    raise CheckpointError(f"{index}: tensor {tensor!r} listed in the index is not in {name}")

    def names(self) -> set[str]:
        return set(self._where)

    def files(self) -> dict[str, list[str]]:
        """Each file's (shard's) name and its tensors' names, in file order."""
        return {name: list(f.header) for name, f in self._files.items()}

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name].header[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        """The tensor's dtype as stored (read from the header, no data)."""
        code = self._where[name].header[name]["dtype"]
        if code not in _DTYPES:
            raise CheckpointError(f"tensor {name!r} has unsupported dtype {code}")
        return np.dtype(_DTYPES[code])

    def nbytes(self, name: str) -> int:
        start, end = self._where[name].header[name]["data_offsets"]
        return end - start

    def dtype_name(self, name: str) -> str:
        """The tensor's safetensors dtype name ("BF16", "F8_E4M3", ...)."""
        return self._where[name].header[name]["dtype"]

    def release(self) -> None:
        """Unmap the files (their pages stop counting in the process's resident memory once no array
        read from them is alive); the next ``read`` maps its file again."""
        for f in self._files.values():
            f._mmap = None

    def read(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise CheckpointError(f"missing tensor {name!r}")
        return self._where[name].read(name)


def write_safetensors(
    path: str | Path,
    tensors: Iterable[tuple[str, tuple[int, ...], np.dtype]],
    produce: Callable[[str], np.ndarray],
    metadata: dict[str, str] | None = None,
) -> int:
    """Write one safetensors file holding ``tensors`` (name, shape, dtype) in that order, asking
    ``produce(name)`` for each one's values only when writing it; returns the file's size in bytes."""
    specs = [(name, tuple(int(d) for d in shape), np.dtype(dtype)) for name, shape, dtype in tensors]
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, shape, dtype in specs:
        if dtype not in _NAMES:
            raise ValueError(f"tensor {name!r}: dtype {dtype} has no safetensors name")
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, dtype in specs:
            a = np.ascontiguousarray(produce(name))
            if a.shape != shape or a.dtype != dtype:
                raise ValueError(f"tensor {name!r}: produced {a.dtype}{list(a.shape)}, declared {dtype}{list(shape)}")
            f.write(a.reshape(-1).view(np.uint8).data)
    return 8 + len(raw) + offset
