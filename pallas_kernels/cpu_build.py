"""Finds or builds the ops' C++ XLA:CPU custom calls (``jax.ffi``), caches the libraries and
registers their handlers: what every op's ``cpu_kernel`` shares.

Load order: ``JAXMOE_CPU_KERNEL=0`` turns every kernel off; else the prebuilt library of the best
x86-64 variant this CPU runs (``cpu_variants``: compiled at install time into the package's
``_prebuilt`` folder, or the folder ``JAXMOE_PREBUILT_KERNELS`` names), if one was built from this
source for this jax version; else the cached build; else a build now; else the XLA form, with one
warning line. ``CppKernels.origin()`` says which library runs.

Build: ``c++ -O3 -march=native`` (a kernel is tuned to the CPU it runs on) into
``$XDG_CACHE_HOME/jaxmoe/kernels`` (default ``~/.cache``), named by a hash of the source, the shared
header (``cpu/common.h``), the flags, the compiler's version, jax's FFI headers and the CPU's feature
flags, so a changed source or another machine builds anew; written to a temporary file and renamed, so
processes building at once do not see half a library. ``JAXMOE_CPU_KERNEL=0`` turns every kernel
off; with no compiler (or a failed build) ``CppKernels.unavailable_reason()`` says why, and the ops
fall back to their XLA forms. A build prints a line when it starts and when it ends (it takes tens of
seconds, once per machine); a kernel that cannot be built or loaded prints one warning line saying
which slower path runs instead and why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import jax

from . import cpu_variants
from .platform import target_platform

COMMON = pathlib.Path(__file__).with_name("cpu")  # common.h, included by every source
FLAGS = [*cpu_variants.BASE_FLAGS[:1], "-march=native", *cpu_variants.BASE_FLAGS[1:]]


class KernelUnavailable(RuntimeError):
    """A CPU kernel cannot be built or loaded here (the message says why)."""


def cache_dir() -> pathlib.Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(root) / "jaxmoe" / "kernels"


def prebuilt_dir() -> pathlib.Path:
    """Where the install put the prebuilt libraries (``JAXMOE_PREBUILT_KERNELS`` overrides)."""
    return pathlib.Path(os.environ.get("JAXMOE_PREBUILT_KERNELS") or pathlib.Path(__file__).with_name("_prebuilt"))


def _cpu_flags() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def has_cpu_feature(name: str) -> bool:
    """Whether the CPU reports feature ``name`` (``/proc/cpuinfo``'s flags, e.g. ``avx512_bf16``):
    what ``-march=native`` will use."""
    return name in _cpu_flags().split()


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    raise KernelUnavailable("no C++ compiler (c++, g++ or clang++) on PATH; set CXX")


class CppKernels:
    """One C++ source's library: ``targets`` maps each FFI target name to its handler symbol."""

    def __init__(self, source: pathlib.Path, targets: dict[str, str], fallback: str = "its XLA form"):
        """``fallback``: what runs instead when this library is unavailable (named in the warning)."""
        self.source, self.targets, self.fallback = source, targets, fallback
        self._loaded: str | None | bool = False  # False: not tried yet; then None (loaded) or why not
        self._origin: str | None = None  # which library was loaded (``origin()``)
        self._built_now = False

    def prebuilt(self) -> tuple[pathlib.Path, str] | None:
        """The prebuilt library and its variant this process can load: the best variant the CPU's
        flags allow whose library was built from this source and header for this jax version."""
        folder = prebuilt_dir()
        if not folder.is_dir():
            return None
        for variant in cpu_variants.choose(frozenset(_cpu_flags().split())):
            name = cpu_variants.library_name(
                COMMON.parent, self.source, variant, jax.ffi.include_dir(), jax.__version__
            )
            if (folder / name).is_file():
                return folder / name, variant
        return None

    def origin(self) -> str | None:
        """Which library runs in this process: "prebuilt <variant>", "cached build (-march=native)" or
        "built now (-march=native)"; None while none is loaded."""
        return self._origin if self._loaded is None else None

    def library_path(self) -> pathlib.Path:
        """Where the built library for this source, compiler and CPU lives (built or not)."""
        cxx = _compiler()
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
        key = hashlib.sha256()
        for part in (self.source.read_bytes(), (COMMON / "common.h").read_bytes(), " ".join(FLAGS).encode()):
            key.update(part)
        key.update(version.encode())
        key.update(_cpu_flags().encode())
        key.update((pathlib.Path(jax.ffi.include_dir()) / "xla/ffi/api/ffi.h").read_bytes())
        return cache_dir() / f"{self.source.stem}-{key.hexdigest()[:16]}.so"

    def build(self) -> pathlib.Path:
        """The shared library, compiled now unless the cache holds it."""
        out = self.library_path()
        if out.exists():
            return out
        self._built_now = True
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        cmd = [_compiler(), *FLAGS, f"-I{jax.ffi.include_dir()}", f"-I{COMMON}", str(self.source), "-o", tmp]
        print(
            f"jaxmoe: building the C++ CPU kernel {self.source.name} (once per machine) ...",
            file=sys.stderr,
            flush=True,
        )
        t0 = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        print(
            f"jaxmoe: C++ CPU kernel {self.source.name} {'built' if done.returncode == 0 else 'failed'} "
            f"in {time.monotonic() - t0:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        if done.returncode != 0:
            os.unlink(tmp)
            raise KernelUnavailable(f"building {self.source.name} failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}")
        os.replace(tmp, out)
        return out

    def unavailable_reason(self) -> str | None:
        """None when the kernels can run in this process (built, loaded and registered once), else
        why not."""
        if os.environ.get("JAXMOE_CPU_KERNEL", "1") == "0":
            return "turned off by JAXMOE_CPU_KERNEL=0"
        target = target_platform()
        if target != "cpu":
            return f"it is an XLA:CPU kernel and the target platform is {target}"
        if self._loaded is False:
            self._loaded = self._load()
        return self._loaded

    def _load(self) -> str | None:
        found = self.prebuilt()
        if found is not None:
            try:
                self._register(ctypes.cdll.LoadLibrary(str(found[0])))
                self._origin = f"prebuilt {found[1]}"
                return None
            except OSError:  # an unloadable prebuilt library: build one instead, as if it were absent
                pass
        try:
            self._register(ctypes.cdll.LoadLibrary(str(self.build())))
            self._origin = f"{'built now' if self._built_now else 'cached build'} (-march=native)"
        except (KernelUnavailable, OSError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            print(
                f"jaxmoe: warning: the C++ CPU kernel {self.source.stem} is unavailable ({first}); "
                f"running {self.fallback} instead (slower)",
                file=sys.stderr,
                flush=True,
            )
            return str(e)
        return None

    def _register(self, library: ctypes.CDLL) -> None:
        for target, symbol in self.targets.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
