"""The x86-64 variants the C++ CPU kernels are prebuilt in at install time, their library names, and
the run-time choice among them by the CPU's feature flags.

Standard library only: the install-time build hook (``setup.py``) loads this file by path, without
the package or jax. A prebuilt library is named ``<kernel>-<variant>-<key>.so``, the key a hash of
the source, the shared header, the flags, jax's FFI header and jax's version, so a library built
for another jax (another FFI ABI) or another source is never picked up.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import time

BASE_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno"]
# relative to the pallas_kernels folder: every kernel source, and the header they all include
SOURCES = ["expert_ffn/cpu/expert_ffn.cc", "paged_attention/cpu/paged_attention.cc"]
COMMON_HEADER = "cpu/common.h"
PREBUILT = "_prebuilt"  # the folder, in the pallas_kernels package, the install writes them into

# /proc/cpuinfo flag names each level needs (x86-64 psABI micro-architecture levels)
_V2 = {"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"}
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
# name -> (compiler flags, CPU flags it needs); best first. The expert FFN has an AVX512-BF16 path.
VARIANTS: dict[str, tuple[list[str], frozenset[str]]] = {
    "x86-64-v4-bf16": (["-march=x86-64-v4", "-mavx512bf16"], frozenset(_V4 | {"avx512_bf16"})),
    "x86-64-v4": (["-march=x86-64-v4"], frozenset(_V4)),
    "x86-64-v3": (["-march=x86-64-v3"], frozenset(_V3)),
}


def choose(cpu_flags: set[str] | frozenset[str]) -> list[str]:
    """The variants a CPU with these feature flags runs, best first (none on a CPU below x86-64-v3
    or not x86-64)."""
    return [name for name, (_, needs) in VARIANTS.items() if needs <= cpu_flags]


def key(source: bytes, common: bytes, flags: list[str], ffi_header: bytes, jax_version: str) -> str:
    """What a prebuilt library was built from: a changed input gives another name."""
    digest = hashlib.sha256()
    for part in (source, common, " ".join(flags).encode(), ffi_header, jax_version.encode()):
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()[:16]


def library_name(kernels: pathlib.Path, source: pathlib.Path, variant: str, include_dir: str, jax_version: str) -> str:
    """The file name of ``source``'s prebuilt library in ``variant`` (``kernels``: the pallas_kernels
    folder, for the shared header; ``include_dir``: jax's FFI headers)."""
    flags = BASE_FLAGS + VARIANTS[variant][0]
    ffi = (pathlib.Path(include_dir) / "xla/ffi/api/ffi.h").read_bytes()
    k = key(source.read_bytes(), (kernels / COMMON_HEADER).read_bytes(), flags, ffi, jax_version)
    return f"{source.stem}-{variant}-{k}.so"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def prebuild(
    kernels: pathlib.Path,
    out: pathlib.Path,
    include_dir: str,
    jax_version: str,
    variants: list[str] | None = None,
    jobs: int | None = None,
) -> tuple[list[pathlib.Path], str]:
    """Compiles every kernel source in every variant (all by default) into ``out``, in parallel
    (``jobs``, default the CPU count). Never raises for a missing compiler or a failed compile:
    returns the libraries built and one line saying what happened."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return (
            [],
            f"C++ CPU kernels not prebuilt: the machine is {platform.machine()}, not x86-64 (they build on first use)",
        )
    cxx = _compiler()
    if cxx is None:
        return (
            [],
            "C++ CPU kernels not prebuilt: no C++ compiler (c++, g++ or clang++) on PATH (they build on first use)",
        )
    variants = list(VARIANTS) if variants is None else variants
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        return (
            [],
            f"C++ CPU kernels not prebuilt: unknown variant(s) {', '.join(unknown)} (known: {', '.join(VARIANTS)})",
        )
    out.mkdir(parents=True, exist_ok=True)
    tasks = []
    for rel in SOURCES:
        source = kernels / rel
        for variant in variants:
            target = out / library_name(kernels, source, variant, include_dir, jax_version)
            cmd = [cxx, *BASE_FLAGS, *VARIANTS[variant][0], f"-I{include_dir}", f"-I{kernels / 'cpu'}", str(source)]
            tasks.append((target, cmd))

    def run(task):
        target, cmd = task
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        done = subprocess.run([*cmd, "-o", str(tmp)], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            return None, f"{target.name}: {(done.stderr.strip().splitlines() or ['failed'])[-1]}"
        os.replace(tmp, target)
        return target, None

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        results = list(pool.map(run, tasks))
    built = [path for path, _ in results if path is not None]
    failed = [why for _, why in results if why is not None]
    line = f"prebuilt {len(built)} of {len(tasks)} C++ CPU kernel libraries ({', '.join(variants)}) in {time.monotonic() - t0:.0f} s"
    if failed:
        line += f"; failed: {failed[0]}" + (f" and {len(failed) - 1} more" if len(failed) > 1 else "")
    return built, line
