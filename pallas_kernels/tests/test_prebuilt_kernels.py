"""The C++ CPU kernels prebuilt at install time (``setup.py``'s build hook, ``cpu_variants``): a wheel
carries them in x86-64 variants; at run time the best variant the CPU runs, built for this jax, is
loaded with no compiler and no cache; one built for another jax or a CPU lacking its features is not."""

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
V3 = " ".join(sorted(cpu_variants.VARIANTS["x86-64-v3"][1]))
V4 = " ".join(sorted(cpu_variants.VARIANTS["x86-64-v4"][1]))
x86 = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 variants")


def _fake_prebuilt(folder: pathlib.Path, variant: str, jax_version: str = jax.__version__) -> pathlib.Path:
    """An (unloadable) file where the install would put ``variant``'s expert FFN library."""
    folder.mkdir(exist_ok=True)
    name = cpu_variants.library_name(
        cpu_build.COMMON.parent, cpu_kernel.SOURCE, variant, jax.ffi.include_dir(), jax_version
    )
    (folder / name).write_bytes(b"")
    return folder / name


def test_the_best_variant_the_cpu_runs_is_chosen_and_others_are_not(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXMOE_PREBUILT_KERNELS", str(tmp_path / "prebuilt"))
    library = cpu_build.CppKernels(cpu_kernel.SOURCE, {})
    v3, v4 = _fake_prebuilt(tmp_path / "prebuilt", "x86-64-v3"), _fake_prebuilt(tmp_path / "prebuilt", "x86-64-v4")
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: f"flags : {V4}")
    assert library.prebuilt() == (v4, "x86-64-v4")
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: f"flags : {V4} avx512_bf16")  # no bf16 library built
    assert library.prebuilt() == (v4, "x86-64-v4")
    bf16 = _fake_prebuilt(tmp_path / "prebuilt", "x86-64-v4-bf16")
    assert library.prebuilt() == (bf16, "x86-64-v4-bf16")
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: f"flags : {V3}")  # AVX2 only: no AVX-512 library
    assert library.prebuilt() == (v3, "x86-64-v3")
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: "flags : fpu sse sse2")  # below x86-64-v3: none
    assert library.prebuilt() is None
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: "Features : fp asimd")  # aarch64: none
    assert library.prebuilt() is None


def test_a_library_built_for_another_jax_or_source_is_not_used(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXMOE_PREBUILT_KERNELS", str(tmp_path / "prebuilt"))
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: f"flags : {V3}")
    _fake_prebuilt(tmp_path / "prebuilt", "x86-64-v3", jax_version="0.0.1")
    assert cpu_build.CppKernels(cpu_kernel.SOURCE, {}).prebuilt() is None
    _fake_prebuilt(tmp_path / "prebuilt", "x86-64-v3")
    assert cpu_build.CppKernels(cpu_kernel.SOURCE, {}).prebuilt() is not None
    changed = tmp_path / cpu_kernel.SOURCE.name
    changed.write_text(cpu_kernel.SOURCE.read_text() + "\n// changed\n")
    assert cpu_build.CppKernels(changed, {}).prebuilt() is None
    monkeypatch.setattr(jax, "__version__", "0.0.2")  # the jax of this process changed since the install
    assert cpu_build.CppKernels(cpu_kernel.SOURCE, {}).prebuilt() is None


def test_the_build_hook_never_fails_for_want_of_a_compiler(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_variants.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(cpu_variants.platform, "machine", lambda: "x86_64")
    built, line = cpu_variants.prebuild(cpu_build.COMMON.parent, tmp_path, jax.ffi.include_dir(), jax.__version__)
    assert built == [] and line.startswith("not prebuilt: no C++ compiler") and not list(tmp_path.iterdir())
    monkeypatch.setattr(cpu_variants.platform, "machine", lambda: "aarch64")
    assert cpu_variants.prebuild(cpu_build.COMMON.parent, tmp_path, "", "")[1].startswith("not prebuilt: the machine")


@pytest.fixture(scope="module")
def wheel_kernels(tmp_path_factory) -> pathlib.Path:
    """``pip wheel .`` with the x86-64-v3 variant (the one every x86-64 CI machine runs), unpacked:
    its ``_prebuilt`` folder."""
    out = tmp_path_factory.mktemp("wheel")
    env = {**os.environ, "JAXMOE_PREBUILD_VARIANTS": "x86-64-v3"}
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    (wheel,) = out.glob("jaxmoe-*.whl")
    with zipfile.ZipFile(wheel) as z:
        members = [n for n in z.namelist() if n.startswith("jaxmoe/pallas_kernels/_prebuilt/")]
        z.extractall(out / "unpacked", members)
    return out / "unpacked" / "jaxmoe" / "pallas_kernels" / "_prebuilt"


@x86
@pytest.mark.slow
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


@x86
@pytest.mark.slow
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
