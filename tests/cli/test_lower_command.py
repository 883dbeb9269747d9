"""``jaxmoe lower``: every serving program of the test checkpoints lowers for CUDA and TPU on this
CPU-only machine, monolithic and disaggregated; a program that cannot lower is reported, exit 1."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

from jaxmoe.cli import main

MESHES = pathlib.Path(__file__).resolve().parents[2] / "meshes"
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"]
SMALL_PLAN = ["--max-num-seqs", "1", "--max-prefill-chunk", "16"]  # buckets 1x1, 1x16, 2x16, 4x16


def lower(capsys, *args, layered: bool = False) -> tuple[int, dict]:
    """``jaxmoe lower ARGS`` (without the layer-by-layer programs unless ``layered``: as serve's default)."""
    code = main(["lower", *([] if layered else ["--no-layer-preemption"]), *args, "--json", *SMALL_PLAN])
    out = capsys.readouterr().out
    return code, json.loads(out)


def names(report: dict, platform: str) -> set[str]:
    return {p["name"] for p in report["programs"] if p["platform"] == platform}


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_monolithic_every_family_lowers_for_cuda_and_tpu(capsys, checkpoint_dir, family):
    code, report = lower(capsys, "--model", str(checkpoint_dir(family)), "--platforms", "cuda,tpu")
    failed = [p for p in report["programs"] if not p["ok"]]
    assert code == 0 and report["ok"] and not failed, failed
    for platform in ("cuda", "tpu"):
        assert names(report, platform) == {
            "monolithic.step[1x1]",
            "monolithic.step[1x16]",
            "monolithic.step[2x16]",
            "monolithic.step[4x16]",
            "sampler[B=1]",
            "sampler[B=2]",
            "sampler[B=4]",
            "adjust_logits[B=1]",
            "adjust_logits[B=2]",
            "adjust_logits[B=4]",
        }
    assert set(report["notes"]) == {"cuda", "tpu"}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2"])
def test_layer_preemption_programs_lower(capsys, checkpoint_dir, family):
    """By default (as serve's layer preemption without a mesh file) every step runs the layer-by-layer
    programs (embed, each layer group's layers, head), so they lower for every shape instead of the
    fused step; the first layer and the layer count are traced, so ``--pause-every`` changes none."""
    code, report = lower(capsys, "--model", str(checkpoint_dir(family)), "--platforms", "tpu", layered=True)
    assert code == 0 and report["ok"], [p for p in report["programs"] if not p["ok"]]
    got = names(report, "tpu")
    assert not any(n.startswith("monolithic.step") for n in got)
    for shape in ("1x1", "1x16", "2x16", "4x16"):
        assert {f"monolithic.embed[{shape}]", f"monolithic.head[{shape}]"} <= got
        per_group = [n for n in got if n.startswith("monolithic.layers[") and n.endswith(f"[{shape}]")]
        assert per_group and per_group == [n for n in per_group if n.startswith("monolithic.layers[group ")]
    if family == "mixtral":  # its 2 layers in one group: one program, whatever the pause points
        code, report = lower(
            capsys,
            "--model",
            str(checkpoint_dir(family)),
            "--platforms",
            "tpu",
            "--pause-every",
            "2",
            "--layer-preemption",
            layered=True,
        )
        got = {n for n in names(report, "tpu") if n.startswith("monolithic.layers[") and n.endswith("[1x1]")}
        assert code == 0 and got == {"monolithic.layers[group 0][1x1]"}


def test_cpu_only_kernel_is_a_failed_program_and_exit_1(capsys, checkpoint_dir):
    """The XLA:CPU expert kernel, forced on CUDA: it cannot run there, so every step program fails
    (named, with the reason) while the sampler still lowers."""
    code, report = lower(
        capsys, "--model", str(checkpoint_dir("mixtral")), "--platforms", "cuda", "--expert-impl", "cpu_kernel"
    )
    assert code == 1 and report["ok"] is False
    steps = [p for p in report["programs"] if p["name"].startswith("monolithic.step")]
    assert steps and all(not p["ok"] for p in steps)
    assert all("target platform is gpu" in p["error"] for p in steps), steps[0]["error"]
    assert all(p["ok"] for p in report["programs"] if p["name"].startswith("sampler"))


@pytest.mark.slow
def test_disaggregated_with_tensor_parallel_attention(capsys, checkpoint_dir):
    """cpu-8-tp2: two nodes, attention heads split over two devices per instance; bf16 weights."""
    code, report = lower(
        capsys,
        "--model",
        str(checkpoint_dir("qwen2_moe")),
        "--mesh",
        str(MESHES / "cpu-8-tp2.yaml"),
        "--platforms",
        "tpu",
        "--dtype",
        "bfloat16",
    )
    assert code == 0 and report["ok"], [p for p in report["programs"] if not p["ok"]]
    got = names(report, "tpu")
    assert {"attention.embed[1x1]", "attention.head[4x16]"} <= got
    assert any(n.startswith("experts[1x16, layers") for n in got)
    assert any(n.startswith("attention.layer[2x16, layers") for n in got)
    assert any(n.startswith("transfer.a2e[1x1,") for n in got)  # two nodes: one process each, collectives


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "mesh", "platform"),
    [("deepseek_v2", "h100-2x8.yaml", "cuda"), ("qwen3_moe", "tpu-v5e-16.yaml", "tpu")],
)
def test_disaggregated_on_the_accelerator_meshes(capsys, checkpoint_dir, family, mesh, platform):
    """16-device meshes on an 8-device CPU host: abstract meshes, so no device is needed."""
    code, report = lower(
        capsys, "--model", str(checkpoint_dir(family)), "--mesh", str(MESHES / mesh), "--platforms", platform
    )
    assert code == 0 and report["ok"], [p for p in report["programs"] if not p["ok"]]
    got = names(report, platform)
    assert any(n.startswith("transfer.a2e[4x16,") for n in got) and any(n.startswith("transfer.e2a[1x1,") for n in got)
    assert any(n.startswith("experts[2x16,") for n in got)
    if family == "deepseek_v2":  # first layer dense, shared experts beside attention
        assert any(n.startswith("attention.shared[1x1,") for n in got)
        assert len([n for n in got if n.startswith("attention.layer[1x1,")]) == 2


def test_bad_platform_is_a_clear_error(capsys, checkpoint_dir):
    code = main(["lower", "--model", str(checkpoint_dir("mixtral")), "--platforms", "vulkan"])
    assert code == 2
    assert "--platforms: unknown platform 'vulkan'" in capsys.readouterr().err


@pytest.mark.slow
def test_compile_ahead_where_jax_can(capsys, checkpoint_dir):
    """``--compile``: TPU programs compile against libtpu's topology description when libtpu is
    installed (``jaxmoe[tpu]``), else they are lowered only, with the reason; CUDA programs are
    lowered only (this jaxlib has no GPU compiler to target without a GPU)."""
    code, report = lower(capsys, "--model", str(checkpoint_dir("mixtral")), "--platforms", "cuda,tpu", "--compile")
    assert code == 0 and report["ok"], [p for p in report["programs"] if not p["ok"]]
    cuda = [p for p in report["programs"] if p["platform"] == "cuda"]
    tpu = [p for p in report["programs"] if p["platform"] == "tpu"]
    assert cuda and not any(p["compiled"] for p in cuda)
    assert "lowered only" in report["notes"]["cuda"] and "GPU" in report["notes"]["cuda"]
    if importlib.util.find_spec("libtpu") is None:
        assert not any(p["compiled"] for p in tpu)
        assert "lowered only: no TPU topology description here" in report["notes"]["tpu"]
    else:
        assert tpu and all(p["compiled"] for p in tpu)
        assert report["notes"]["tpu"] == f"{len(tpu)} programs lowered and compiled ahead"
