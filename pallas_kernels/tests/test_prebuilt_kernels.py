"""The C++ CPU kernels prebuilt at install time (``setup.py``'s build hook, ``cpu_variants``): a wheel
carries them in x86-64 variants; at run time the best variant the CPU runs, built for this jax, is
loaded with no compiler and no cache (tests/ops/test_prebuilt_kernels_llm.py); one built for another jax
or a CPU lacking its features is not (here)."""

from __future__ import annotations

import pathlib

import jax

from jaxmoe.pallas_kernels import cpu_build, cpu_variants
from jaxmoe.pallas_kernels.expert_ffn import cpu_kernel

V3 = " ".join(sorted(cpu_variants.VARIANTS["x86-64-v3"][1]))
V4 = " ".join(sorted(cpu_variants.VARIANTS["x86-64-v4"][1]))


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
    assert (
        built == []
        and line.startswith("C++ CPU kernels not prebuilt: no C++ compiler")
        and not list(tmp_path.iterdir())
    )
    monkeypatch.setattr(cpu_variants.platform, "machine", lambda: "aarch64")
    assert cpu_variants.prebuild(cpu_build.COMMON.parent, tmp_path, "", "")[1].startswith(
        "C++ CPU kernels not prebuilt: the machine"
    )


def test_a_failed_compile_is_one_line_not_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails every build
    monkeypatch.setattr(cpu_variants.platform, "machine", lambda: "x86_64")
    kernels = cpu_build.COMMON.parent
    built, line = cpu_variants.prebuild(kernels, tmp_path, jax.ffi.include_dir(), jax.__version__, ["x86-64-v3"])
    assert built == [] and line.startswith("prebuilt 0 of 2 C++ CPU kernel libraries (x86-64-v3)") and "failed" in line
    assert not list(tmp_path.iterdir())  # nothing half-built is left
    assert "unknown variant(s) x86-64-v9" in cpu_variants.prebuild(kernels, tmp_path, "", "", ["x86-64-v9"])[1]
