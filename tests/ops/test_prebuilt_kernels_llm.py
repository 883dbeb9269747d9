"""The C++ CPU kernels prebuilt by the install (``setup.py``'s build hook): ``pip wheel .`` carries the
variant libraries, and with them, no compiler on PATH and an empty kernel cache, ``LLM`` runs the C++
kernels (reported as prebuilt, no warning, nothing built) and generates the XLA forms' tokens."""

from __future__ import annotations

import os
import pathlib
import platform
import subprocess
import sys
import zipfile

import jax
import pytest

from jaxmoe.pallas_kernels import cpu_build, cpu_variants
from jaxmoe.pallas_kernels.expert_ffn import cpu_kernel
from jaxmoe.pallas_kernels.paged_attention import cpu_kernel as attention_kernel

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 variants")


@pytest.fixture(scope="module")
def wheel_kernels(tmp_path_factory) -> pathlib.Path:
    """``pip wheel .`` with the x86-64-v3 variant (the one every x86-64 CI machine runs), unpacked:
    its ``_prebuilt`` folder."""
    out = tmp_path_factory.mktemp("wheel")
    env = {**os.environ, "JAXMOE_PREBUILD_VARIANTS": "x86-64-v3"}
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stderr[-3000:]
    (wheel,) = out.glob("jaxmoe-*.whl")
    with zipfile.ZipFile(wheel) as z:
        members = [n for n in z.namelist() if n.startswith("jaxmoe/pallas_kernels/_prebuilt/")]
        z.extractall(out / "unpacked", members)
    return out / "unpacked" / "jaxmoe" / "pallas_kernels" / "_prebuilt"


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the wheel's fixture compiles two kernels (minutes on a loaded 2-core machine)
def test_a_wheel_carries_the_prebuilt_variant_libraries(wheel_kernels):
    names = sorted(p.name for p in wheel_kernels.glob("*.so"))
    for source in (cpu_kernel.SOURCE, attention_kernel.SOURCE):
        expected = cpu_variants.library_name(
            cpu_build.COMMON.parent, source, "x86-64-v3", jax.ffi.include_dir(), jax.__version__
        )
        assert expected in names, names  # named for this source, variant and jax: what the runtime looks for
    assert len(names) == 2


SCRIPT = """
import sys
from jaxmoe import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", num_blocks=16, block_size=8, max_num_seqs=2)
print(llm.executor.op_impls())
print(llm.generate([[3, 9, 27, 81]], SamplingParams(max_tokens=5, ignore_eos=True))[0].outputs[0].token_ids)
"""


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the wheel's fixture compiles two kernels (minutes on a loaded 2-core machine)
def test_llm_runs_the_prebuilt_kernels_with_no_compiler_and_no_cache(wheel_kernels, checkpoint_dir, tmp_path):
    if not set(cpu_variants.VARIANTS["x86-64-v3"][1]) <= set(cpu_build._cpu_flags().split()):
        pytest.skip("this CPU is below x86-64-v3")
    model = checkpoint_dir("mixtral")
    (tmp_path / "bin").mkdir()  # PATH: nothing but an empty folder, so no c++, g++ or clang++
    env = {**os.environ, "PATH": str(tmp_path / "bin"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env["JAXMOE_PREBUILT_KERNELS"] = str(wheel_kernels)
    env.pop("CXX", None)
    env.pop("JAXMOE_CPU_KERNEL", None)

    def generate(**extra):
        run = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(model)],
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        impls, tokens = (eval(line) for line in run.stdout.strip().splitlines()[-2:])
        return impls, tokens, run.stderr

    impls, tokens, stderr = generate()
    assert "warning" not in stderr.lower() and "building" not in stderr, stderr[-2000:]
    assert impls["expert_ffn"].startswith("cpu_kernel") and impls["paged_attention"] == "cpu_kernel", impls
    assert impls["cpu_kernel_library"] == "expert_ffn: prebuilt x86-64-v3, paged_attention: prebuilt x86-64-v3"
    assert not (tmp_path / "cache").exists()  # nothing was built
    xla_impls, xla_tokens, _ = generate(JAXMOE_CPU_KERNEL="0")
    assert xla_impls["expert_ffn"].startswith("bucketed_loop") and "cpu_kernel_library" not in xla_impls
    assert tokens == xla_tokens and len(tokens) == 5


@pytest.mark.slow
def test_a_wheel_builds_without_a_compiler_saying_so_in_one_line(tmp_path):
    (tmp_path / "bin").mkdir()  # PATH: nothing but an empty folder, so no c++, g++ or clang++
    env = {**os.environ, "PATH": str(tmp_path / "bin")}
    env.pop("CXX", None)
    env.pop("JAXMOE_PREBUILD_VARIANTS", None)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-v",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(tmp_path),
        str(ROOT),
    ]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [
        line.strip() for line in (run.stdout + run.stderr).splitlines() if "jaxmoe: " in line and "prebuilt" in line
    ]
    assert lines == [
        "jaxmoe: C++ CPU kernels not prebuilt: no C++ compiler (c++, g++ or clang++) on PATH (they build on first use)"
    ]
    (wheel,) = tmp_path.glob("jaxmoe-*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert "jaxmoe/pallas_kernels/cpu_build.py" in z.namelist()
        assert not [n for n in z.namelist() if n.endswith(".so")]
