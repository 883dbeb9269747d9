"""The shared build of the C++ XLA:CPU kernels (``pallas_kernels.cpu_build``): failures say why and
leave nothing half-built; libraries are cached by source, shared header and machine."""

import pathlib

import pytest

from jaxmoe.pallas_kernels import cpu_build
from jaxmoe.pallas_kernels.expert_ffn import cpu_kernel
from jaxmoe.pallas_kernels.paged_attention import cpu_kernel as attention_kernel

SOURCES = [cpu_kernel.SOURCE, attention_kernel.SOURCE]


def test_build_failures_say_why(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_build.shutil, "which", lambda name: None)
    with pytest.raises(cpu_build.KernelUnavailable, match="no C\\+\\+ compiler"):
        cpu_kernel.build()
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    broken = tmp_path / "broken.cc"
    broken.write_text("this is not C++\n")
    with pytest.raises(cpu_build.KernelUnavailable, match="building broken.cc failed"):
        cpu_build.CppKernels(broken, {}).build()
    assert not list(pathlib.Path(tmp_path, "jaxmoe", "kernels").glob("*.so"))  # nothing half-built is left
    assert "building broken.cc failed" in cpu_build.CppKernels(broken, {"x": "X"}).unavailable_reason()


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES, ids=lambda s: s.stem)
def test_the_library_is_cached_by_source_and_machine(monkeypatch, tmp_path, source):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    library = cpu_build.CppKernels(source, {})
    first = library.build()
    assert first.exists() and first.parent == tmp_path / "jaxmoe" / "kernels" and first.stem.startswith(source.stem)
    mtime = first.stat().st_mtime_ns
    assert library.build() == first and first.stat().st_mtime_ns == mtime  # not rebuilt
    with monkeypatch.context() as m:  # another machine (other CPU flags): another library
        m.setattr(cpu_build, "_cpu_flags", lambda: "flags : sse2")
        assert library.library_path() != first
    changed = tmp_path / source.name
    changed.write_text(source.read_text() + "\n// changed\n")
    assert cpu_build.CppKernels(changed, {}).library_path() != first
    header = tmp_path / "cpu"
    header.mkdir()
    (header / "common.h").write_text((cpu_build.COMMON / "common.h").read_text() + "\n// changed\n")
    monkeypatch.setattr(cpu_build, "COMMON", header)  # the shared header is part of the key
    assert library.library_path() != first


def test_turned_off_for_every_kernel(monkeypatch):
    monkeypatch.setenv("JAXMOE_CPU_KERNEL", "0")
    assert "JAXMOE_CPU_KERNEL=0" in cpu_kernel.unavailable_reason()
    assert "JAXMOE_CPU_KERNEL=0" in attention_kernel.unavailable_reason()
