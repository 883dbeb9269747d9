"""The ``cpu_kernel`` implementation of the expert FFN: ``cpu/expert_ffn.cc`` as an XLA:CPU custom
call (``jax.ffi``), prebuilt at install time or built on first use with the machine's C++ compiler;
and ``layer_matmul``, its tile as a matmul by one layer's matrix of a stacked weight (the model's
attention projections; a 16-bit LM head, read in place instead of converted to fp32 by XLA).

Found or built, and registered, by ``pallas_kernels.cpu_build`` (prebuilt, else cached per source and
machine; ``JAXMOE_CPU_KERNEL=0`` turns it off); with no prebuilt library and no compiler (or a failed
build) ``available()`` is False and says why, and ``"auto"`` picks an XLA implementation instead.

The call reads the stacked weights in place at the layer (``ExpertWeights.layered``): no slice of
them is copied. The monolithic executor stores them as column ``Panels`` (``panels.py``) when it
runs this kernel: each panel is one contiguous stream under a register tile of up to 8 rows,
1.1-1.6x the speed on plain weights at decode sizes, and faster than XLA's matmuls at prefill sizes
too (``bench/expert_ffn_cpu.py``). bfloat16 panels are stored in pairs of rows where the CPU has
AVX512-BF16 (``has_bf16_dot``): the kernel then multiplies bfloat16 pairs of the activations with
its dot instruction instead of widening the weights; the hidden activation into the down projection
goes in as two bfloat16 parts (hi + lo), so it is not rounded to bfloat16 (a second dot per weight
pair read once).
On plain weights (the ``Stacked`` weights of the disaggregated expert program, say) it is a decode
kernel: where the batch gives an expert more than 8 rows on average (T * top_k > 8 * E: a prefill
chunk) XLA's matmuls are faster (``bench/expert_ffn_cpu.py``) and ``fallback`` (``bucketed_loop``)
runs; so do shapes and dtypes it does not take (D or F not a multiple of 16, weights other than
float32 / bfloat16 / int8). int8 weights (``jaxmoe.quantization``, plain or as panels, with per-column
scales) are read as int8 and scaled in the tile: a decode step reads half the bytes of bfloat16.

Batch invariance (deterministic mode, ``invariant=True``; the ``cpu_kernel_invariant`` expert-FFN
form): each row's sums run in an order fixed by the shapes of the weights and the thread count, never
by the batch: the kernel's work split is fixed (``cpu/expert_ffn.cc``), every batch size runs in the
kernel (no fallback), and ``layer_matmul`` takes every row count (``invariant_matmul``).
"""

from __future__ import annotations

import functools
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from ..cpu_build import CppKernels, KernelUnavailable, has_cpu_feature
from .panels import Panels

SOURCE = pathlib.Path(__file__).with_name("cpu") / "expert_ffn.cc"
TARGET = "jaxmoe_expert_ffn"
MATMUL_TARGET = "jaxmoe_layer_matmul"
INT8_TARGET = "jaxmoe_expert_ffn_int8"
VECTOR = 16  # D and F must be multiples of this (the kernel's vector width in floats)
K_BLOCK = 8  # layer_matmul: K must be a multiple of this (weight rows per block, the kernel's KB)
PLAIN_ROWS_PER_EXPERT = 8  # plain weights: the kernel runs up to this many rows per expert on average
# layer_matmul: the most rows it takes, by dtype. Measured in the 107 M model's decode step, each form
# against the other in one process (2026-11-26): in place is 20-25 % faster at 1 row in both dtypes,
# even at 2, 7-9 % slower at 4-16 rows in float32 (XLA's dot on the copied slice wins there) and 8 %
# faster at 16 rows in bfloat16.
MATMUL_MAX_ROWS = {"float32": 2, "bfloat16": 32}

LIBRARY = CppKernels(
    SOURCE,
    {TARGET: "JaxmoeExpertFfn", MATMUL_TARGET: "JaxmoeLayerMatmul", INT8_TARGET: "JaxmoeExpertFfnInt8"},
    fallback="the XLA expert FFN (bucketed_loop)",
)


def build() -> pathlib.Path:
    """The kernel's shared library, compiled now unless the cache holds it (``cpu_build``)."""
    return LIBRARY.build()


def has_bf16_dot() -> bool:
    """Whether this CPU has AVX512-BF16's dot instruction, which the kernel runs on bfloat16 panels
    stored in pairs (``panels.to_panels(..., pairs=True)``; elsewhere pairs are widened, slower)."""
    return has_cpu_feature("avx512_bf16")


def available() -> bool:
    """Whether the kernel can run in this process (built and registered on first call)."""
    return unavailable_reason() is None


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here (None: it can; built, loaded and registered on the first call)."""
    return LIBRARY.unavailable_reason()


def _int8(weights) -> bool:
    """int8 weights with per-column scales (``jaxmoe.quantization.Quantized``, method "int8")."""
    return getattr(weights, "method", None) == "int8"


def _reads(weights, x) -> bool:
    """Whether the kernel reads weights of this dtype for activations of x's dtype: float32, or
    bfloat16 (as itself or as its uint16 bits, ``models.common.pack16``), or int8 with per-column scales."""
    if _int8(weights):
        return True
    if hasattr(weights, "scale"):  # other quantized forms (fp8 blocks): dequantized by the fallback
        return False
    return weights.dtype in (jnp.float32, jnp.bfloat16) or (weights.dtype == jnp.uint16 and x.dtype == jnp.bfloat16)


def plain_rows(num_experts: int, top_k: int) -> int:
    """The most tokens the kernel takes on plain weights: ``PLAIN_ROWS_PER_EXPERT`` rows per expert
    on average."""
    return PLAIN_ROWS_PER_EXPERT * num_experts // top_k


def supports(x, ids, experts, any_rows: bool = False) -> bool:
    """Whether the kernel takes these shapes and weight dtypes, and, for plain weights, the batch is
    decode-sized (else ``fallback`` runs; ``any_rows``: every batch size). On ``Panels`` it takes every
    batch: at 64-256 tokens it was 1.7-2.2x ``bucketed_loop`` on the plain weights (BENCHMARKS.md)."""
    gate, _, _ = experts.layered()[0]
    D, F = gate.shape[-2], gate.shape[-1]
    return (
        x.ndim == 2
        and (
            any_rows
            or isinstance(getattr(gate, "q", gate), Panels)
            or x.shape[0] <= plain_rows(experts.num_experts, ids.shape[1])
        )
        and D % VECTOR == 0
        and F % VECTOR == 0
        and _reads(gate, x)
    )


def cpu_kernel(x, ids, weights, experts, fallback, invariant: bool = False):
    """The expert FFN through the custom call (``supports``), else ``fallback(x, ids, weights,
    experts)``; raises ``KernelUnavailable`` when the kernel cannot run here. ``invariant``: batch-
    invariant (a fixed work split, every batch size in the kernel; a ``ValueError`` where it cannot
    take the shapes or dtypes, as there is no fallback)."""
    reason = unavailable_reason()
    if reason is not None:
        raise KernelUnavailable(f"expert_impl 'cpu_kernel' is unavailable: {reason}")
    if not supports(x, ids, experts, any_rows=invariant):
        if invariant:
            raise ValueError("expert_impl 'cpu_kernel_invariant': the kernel does not take these shapes or dtypes")
        return fallback(x, ids, weights, experts)
    (gate, up, down), layer = experts.layered()
    if _int8(gate):  # int8 (plain or panels) + column scales, dequantized in the tile (``cpu/expert_ffn.cc``)
        if any(_layout(w.q) != _layout(gate.q) for w in (up, down)):
            raise ValueError("cpu_kernel: int8 gate, up and down must all be plain or all panels of one width")
        call = jax.ffi.ffi_call(INT8_TARGET, jax.ShapeDtypeStruct(x.shape, jnp.float32))
        y = call(
            x.astype(jnp.float32),
            ids.astype(jnp.int32),
            weights.astype(jnp.float32),
            *(getattr(w.q, "data", w.q) for w in (gate, up, down)),
            *(w.scale for w in (gate, up, down)),
            jnp.asarray(layer, jnp.int32),
            panel=np.int64(_layout(gate.q)[0]),
            invariant=np.int64(invariant),
        )
        return y.astype(x.dtype)
    layout = _layout(gate)
    if any(_layout(w) != layout for w in (up, down)):
        raise ValueError("cpu_kernel: gate, up and down must all be plain or all panels of one layout")
    width, pairs = layout
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape, jnp.float32))
    y = call(
        x.astype(jnp.float32),
        ids.astype(jnp.int32),
        weights.astype(jnp.float32),
        *(w.data if width else w for w in (gate, up, down)),
        jnp.asarray(layer, jnp.int32),
        panel=np.int64(width),
        pairs=np.int64(pairs),
        invariant=np.int64(invariant),
    )
    return y.astype(x.dtype)


def _layout(w) -> tuple[int, bool]:
    return (w.width, w.pairs) if isinstance(w, Panels) else (0, False)


def matmul_supports(x, stack, any_rows: bool = False) -> bool:
    """Whether ``layer_matmul`` takes x [..., K] @ stack [L, K, N] here (else slice and ``@``);
    ``any_rows``: at every row count, and N padded to whole vectors (``invariant_matmul``)."""
    K, N = stack.shape[-2], stack.shape[-1]
    return (
        unavailable_reason() is None
        and stack.ndim == 3
        and x.shape[-1] == K
        and (any_rows or math.prod(x.shape[:-1]) <= MATMUL_MAX_ROWS.get(jnp.dtype(x.dtype).name, 0))
        and K % K_BLOCK == 0
        and (any_rows or N % VECTOR == 0)
        and _reads(stack, x)
    )


# deterministic mode's programs are compiled without XLA:CPU's YNNPACK reduction fusions: it takes a
# reduction and the elementwise ops after it (a softmax's max and exp) into one YNNPACK call above some
# array size only, and that call's exp differs in the last bit from the one XLA emits below it, so a
# row's result would change with the number of rows (dots stay allowed: they run as this module's kernels)
INVARIANT_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}


def program_jit(invariant: bool):
    """``jax.jit`` for a program of the step: in deterministic mode (``invariant``) with
    ``INVARIANT_COMPILER_OPTIONS``, else plain."""
    return functools.partial(jax.jit, compiler_options=INVARIANT_COMPILER_OPTIONS if invariant else None)


def invariant_sum(a):
    """The sum over a [..., K]'s last axis (float32), each row in one order whatever the other rows: a
    product with a column of ones by ``layer_matmul`` (K padded with exact zeros). XLA's reductions
    change their order with the number of rows (a row's log-softmax over 320 logits differs between
    1 and 16 rows), so deterministic mode sums this way (norms, softmax, logsumexp)."""
    reason = unavailable_reason()  # built and registered here if nothing else has used the kernel yet
    if reason is not None:
        raise KernelUnavailable(f"deterministic mode's invariant sum is unavailable: {reason}")
    K = a.shape[-1]
    pad = -K % K_BLOCK
    a = a.astype(jnp.float32)
    if pad:
        a = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)])
    return layer_matmul(a, jnp.ones((1, K + pad, VECTOR), jnp.float32), 0)[..., 0]


def invariant_matmul(x, stack, layer):
    """``layer_matmul`` at any row count, N padded to a multiple of 16 (and cut back): each row of
    x [..., K] @ stack[layer] is summed in one order whatever the other rows (deterministic mode,
    where XLA:CPU's dot picks its algorithm, and so its summation order, by the row count)."""
    N = stack.shape[-1]
    pad = -N % VECTOR
    if pad:  # small matrices only (the router's [D, E], a gate's [D, 1]): the padded copy is cheap
        stack = jnp.pad(stack, ((0, 0), (0, 0), (0, pad)))
    y = layer_matmul(x, stack, layer)
    return y[..., :N] if pad else y


def layer_matmul(x, stack, layer):
    """x [..., K] @ stack[layer] for a stacked [L, K, N] matrix read in place (``matmul_supports``),
    fp32 accumulation, in x.dtype."""
    K, N = stack.shape[-2], stack.shape[-1]
    call = jax.ffi.ffi_call(MATMUL_TARGET, jax.ShapeDtypeStruct((x.size // K, N), jnp.float32))
    y = call(x.reshape(-1, K).astype(jnp.float32), stack, jnp.asarray(layer, jnp.int32))
    return y.astype(x.dtype).reshape(*x.shape[:-1], N)
