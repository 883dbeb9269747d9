"""Public API: the grouped SwiGLU (rows sorted by group) that the expert-FFN op
(``jaxmoe.pallas_kernels.expert_ffn``) runs between ``dispatch`` and ``combine``.

``impl`` picks the grouped computation:

* ``"pallas"``: Pallas kernels.  ``interpret=None`` means auto: the generic
  Pallas interpreter on CPU, compiled kernels elsewhere.  Compiled backends:
  TPU -> Mosaic TPU (``kernel.py``); NVIDIA Hopper (sm_90) -> Mosaic GPU
  (``kernel_gpu.py``, bf16/f16 only).  Anything else (CPU without interpret,
  ROCm, non-Hopper CUDA) raises rather than silently falling back.
* ``"ragged_dot"``: ``jax.lax.ragged_dot`` (XLA's own grouped matmul).
* ``"loop"``: per-group masked dense loop (slow reference).
* ``"einsum"``: padded ``[G, C, D]`` einsum (reads every expert's weights).

Weights: ``w_gate, w_up [G, D, F]``, ``w_down [G, F, D]`` (HF ``[F, D]``
Linear weights transposed), same dtype as ``x``.  fp32 accumulation; output in
``x.dtype``.  All shapes are static, so everything works under ``jax.jit``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..platform import lowering_ahead, target_platform
from . import kernel, reference

IMPLS = ("pallas", "ragged_dot", "loop", "einsum")


def _pallas_backend(interpret) -> str:
    """'interpret' | 'tpu' | 'gpu' for impl='pallas' on the target platform
    (``pallas_kernels.platform``; raises if unsupported). Lowered ahead for a GPU (no GPU here),
    the GPU is taken to be the Hopper the kernel is written for."""
    platform = target_platform()
    if interpret is None:
        interpret = platform == "cpu"
    if interpret:
        return "interpret"
    if platform == "tpu":
        return "tpu"
    if platform == "gpu":
        if lowering_ahead():
            return "gpu"
        dev = jax.devices()[0]
        cc = str(getattr(dev, "compute_capability", ""))  # "9.0" on H100/H200
        if cc.split(".")[0] == "9":
            return "gpu"
        raise NotImplementedError(
            f"impl='pallas' compiled path supports NVIDIA Hopper (sm_90) only; "
            f"got {dev.device_kind!r} (compute capability {cc!r}). "
            "Use impl='ragged_dot' or interpret=True."
        )
    raise NotImplementedError(
        f"impl='pallas' cannot compile for platform {platform!r}; use interpret=True or impl='ragged_dot'."
    )


def grouped_swiglu(
    x_sorted,
    group_sizes,
    w_gate,
    w_up,
    w_down,
    *,
    impl: str = "pallas",
    interpret: bool | None = None,
    kernel_options: dict | None = None,
):
    """``silu(x @ wg[g]) * (x @ wu[g]) @ wd[g]`` for rows grouped by ``g``.

    ``x_sorted [M, D]`` rows sorted by group, ``group_sizes [G]`` int; rows past
    ``sum(group_sizes)`` belong to no group and are returned as zeros.
    ``kernel_options`` go to the kernel wrapper (TPU/interpret:
    ``tiling_gate_up``/``tiling_down`` = (tm, tk, tn); GPU: ``block_m``,
    ``block_n``, ``block_k``, ``max_concurrent_steps``).
    """
    opts = dict(kernel_options or {})
    args = (x_sorted, group_sizes, w_gate, w_up, w_down)
    if impl == "pallas":
        backend = _pallas_backend(interpret)
        if backend == "gpu":
            from .kernel_gpu import grouped_swiglu_mgpu

            y = grouped_swiglu_mgpu(*args, **opts)
        else:
            y = kernel.grouped_swiglu_pallas(*args, interpret=backend == "interpret", **opts)
    elif impl == "ragged_dot":
        y = reference.swiglu_ragged_dot(*args)
    elif impl == "loop":
        y = reference.swiglu_loop(*args)
    elif impl == "einsum":
        y = reference.swiglu_padded_einsum(*args, **opts)
    else:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    rows = jnp.arange(x_sorted.shape[0], dtype=jnp.int32)[:, None]
    return jnp.where(rows < jnp.sum(group_sizes.astype(jnp.int32)), y, 0)
