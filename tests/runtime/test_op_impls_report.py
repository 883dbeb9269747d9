"""Each executor names the implementation of every op it runs (and why not a faster one), in one
INFO line at build and from ``executor.op_impls()``."""

from __future__ import annotations

import pytest

import logging
import pathlib

import jax.numpy as jnp

from jaxmoe.demo import demo_config, demo_params
from jaxmoe.pallas_kernels.expert_ffn import cpu_kernel
from jaxmoe.runtime.monolithic import MonolithicExecutor

MESHES = pathlib.Path(__file__).resolve().parents[2] / "meshes"


def test_monolithic_reports_and_logs_its_op_implementations(caplog):
    cfg = demo_config()
    params = demo_params(cfg, dtype=jnp.float32)
    with caplog.at_level(logging.INFO, logger="jaxmoe.runtime"):
        ex = MonolithicExecutor(cfg, params, num_slots=64, block_size=16)
    impls = ex.op_impls()
    assert set(impls) - {"cpu_kernel_library"} == {"expert_ffn", "paged_attention", "layer_matmul"}
    if cpu_kernel.available():
        assert impls["expert_ffn"].startswith("cpu_kernel")
        assert impls["cpu_kernel_library"].startswith("expert_ffn: ")  # which library: prebuilt or built
        assert impls["paged_attention"] == "cpu_kernel" and impls["layer_matmul"] == "cpu_kernel"
    else:
        assert impls["expert_ffn"].startswith("bucketed_loop (cpu_kernel unavailable: ")
    lines = [r.getMessage() for r in caplog.records if "op implementations" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("monolithic executor op implementations: expert_ffn=")


def test_unavailable_kernel_and_explicit_forms_carry_the_reason(monkeypatch):
    monkeypatch.setenv("JAXMOE_CPU_KERNEL", "0")
    cfg = demo_config()
    params = demo_params(cfg, dtype=jnp.float32)
    impls = MonolithicExecutor(cfg, params, num_slots=64, block_size=16).op_impls()
    assert impls["expert_ffn"] == "bucketed_loop (cpu_kernel unavailable: turned off by JAXMOE_CPU_KERNEL=0)"
    assert impls["paged_attention"] == (
        "xla (the KV cache is read in place only beside expert_impl cpu_kernel on the monolithic executor)"
    )
    impls = MonolithicExecutor(cfg, params, num_slots=64, block_size=16, expert_impl="ragged_dot").op_impls()
    assert impls["expert_ffn"] == "ragged_dot" and impls["grouped_matmul"] == "xla ragged_dot"


@pytest.mark.slow
def test_disaggregated_reports_aebs_and_the_expert_form():
    from jaxmoe.runtime.disaggregated import DisaggregatedExecutor

    cfg = demo_config()
    params = demo_params(cfg, dtype=jnp.float32)
    ex = DisaggregatedExecutor(cfg, params, 64, 16, str(MESHES / "cpu-8.yaml"))
    impls = ex.op_impls()
    assert impls["aebs"] == "aebs: reference (jnp)"  # auto on CPU: the jnp form, faster than the interpreted kernel
    assert impls["paged_attention"].startswith("xla")
    ex = DisaggregatedExecutor(cfg, params, 64, 16, str(MESHES / "cpu-8.yaml"), aebs_impl="kernel")
    assert ex.op_impls()["aebs"] == "aebs: kernel (interpret)"
