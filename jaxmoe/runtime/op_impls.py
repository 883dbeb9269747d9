"""Which implementation each op of a step runs on this executor, and why not a faster one.

Both executors build the report once, when they are built (``op_impls(...)``), log it as one INFO
line and return it from ``executor.op_impls()``; the server shows it in ModelInfo and as the
``jaxmoe_op_impl{op, impl}`` info metric. Ops:

* ``expert_ffn``: the expert-FFN form (``pallas_kernels.expert_ffn``);
* ``grouped_matmul``: where the expert FFN is a grouped matmul over expert-sorted rows, which one
  (XLA's ``ragged_dot``, a padded einsum, or the Pallas kernel and its backend);
* ``aebs``: the replica scheduler's policy and form (disaggregated executor only);
* ``paged_attention``: the C++ XLA:CPU kernel reading the KV cache in place (decode steps, and every
  step in deterministic mode; prefill chunks run the XLA form), or the XLA form;
* ``layer_matmul``: attention projections read in place by the CPU kernel (decode-sized rows),
  or XLA's slice and matmul;
* ``cpu_kernel_library``: where a CPU kernel runs, which library each loaded: a prebuilt x86-64
  variant, the cached build or one built now (``pallas_kernels.cpu_build``).

A form that is not the fastest for the platform carries the reason in parentheses (the CPU
kernels' ``unavailable_reason()``, or the setting that decided).
"""

from __future__ import annotations

import logging

from jaxmoe.pallas_kernels.expert_ffn import cpu_kernel as expert_kernel
from jaxmoe.pallas_kernels.paged_attention import cpu_kernel as attention_kernel
from jaxmoe.pallas_kernels.platform import target_platform

logger = logging.getLogger("jaxmoe.runtime")

LIBRARIES = {"expert_ffn": expert_kernel, "paged_attention": attention_kernel}  # each C++ kernel, by op
_GROUPED = {"ragged_dot": "xla ragged_dot", "padded_einsum": "padded einsum", "grouped": "dispatch + batched matmul"}


def expert_ffn(requested: str, impl: str, defaults: dict[str, str]) -> str:
    """The expert-FFN entry: ``impl``, and why when "auto" wanted the CPU kernel and did not get it."""
    wanted = defaults.get(target_platform(), defaults["other"]) if requested == "auto" else requested
    if wanted == "cpu_kernel" and impl != "cpu_kernel":
        return f"{impl} (cpu_kernel unavailable: {expert_kernel.unavailable_reason()})"
    if impl == "cpu_kernel":
        return "cpu_kernel (bucketed_loop for batches larger than it takes)"
    return impl


def grouped_matmul(impl: str) -> str | None:
    """The grouped matmul an expert-FFN form runs (None: it runs none)."""
    if impl in _GROUPED:
        return _GROUPED[impl]
    if impl == "pallas":
        from jaxmoe.pallas_kernels.grouped_matmul.api import _pallas_backend

        try:
            backend = _pallas_backend(None)
        except NotImplementedError as e:
            return f"pallas (unavailable: {e})"
        return {"gpu": "pallas (Mosaic GPU)", "tpu": "pallas (Mosaic TPU)"}.get(backend, "pallas (interpreted)")
    return None


def in_place(reads_in_place: bool, kernel, what: str) -> str:
    """``cpu_kernel`` when the executor lets the CPU kernel read ``what`` in place and it can run
    here, else ``xla`` with the reason."""
    if not reads_in_place:
        return f"xla ({what} is read in place only beside expert_impl cpu_kernel on the monolithic executor)"
    reason = kernel.unavailable_reason()
    return "cpu_kernel" if reason is None else f"xla (cpu_kernel unavailable: {reason})"


def build(
    *,
    requested_expert_impl: str,
    expert_impl: str,
    defaults: dict[str, str],
    reads_in_place: bool,
    mla: bool,
    aebs: str | None = None,
) -> dict[str, str]:
    """The report of one executor (``aebs``: its AEBS entry, disaggregated only)."""
    impls = {"expert_ffn": expert_ffn(requested_expert_impl, expert_impl, defaults)}
    grouped = grouped_matmul(expert_impl)
    if grouped is not None:
        impls["grouped_matmul"] = grouped
    if aebs is not None:
        impls["aebs"] = aebs
    impls["paged_attention"] = (
        "xla (MLA: the compressed-KV form has no kernel)"
        if mla
        else in_place(reads_in_place, attention_kernel, "the KV cache")
    )
    impls["layer_matmul"] = in_place(reads_in_place, expert_kernel, "a layer's projection")
    libraries = [(op, kernel.LIBRARY.origin()) for op, kernel in LIBRARIES.items()]
    if any(origin for _, origin in libraries):
        impls["cpu_kernel_library"] = ", ".join(f"{op}: {origin}" for op, origin in libraries if origin)
    return impls


def aebs(policy: str, impl: str) -> str:
    """The AEBS entry: policy and form (the kernel's backend on the target platform)."""
    if policy == "random":
        return "random (jnp)"
    if impl == "reference":
        return f"{policy}: reference ({'jnp' if policy == 'aebs' else 'numpy host callback'})"
    from jaxmoe.pallas_kernels.aebs.api import _backend

    return f"{policy}: kernel ({_backend(None).replace('_', ' ')})"


def log(executor: str, impls: dict[str, str]) -> None:
    """One INFO line naming every op's implementation."""
    logger.info("%s executor op implementations: %s", executor, "; ".join(f"{k}={v}" for k, v in impls.items()))
