"""Package layout (metadata lives in pyproject.toml), and the install-time build of the C++ CPU
kernels.

The top-level folders ``server/`` and ``pallas_kernels/`` (the design card's layout) install under the
``jaxmoe`` namespace as ``jaxmoe.server`` and ``jaxmoe.pallas_kernels``, so no generic top-level name
(``server``) lands in site-packages.

``build_py`` (run by ``pip install .``, ``pip install -e .`` and ``pip wheel .``) also compiles the
C++ CPU kernels in their x86-64 variants (``pallas_kernels/cpu_variants.py``) into
``jaxmoe/pallas_kernels/_prebuilt`` (in the source tree for an editable install), with jax's FFI
headers from the build environment. It never fails the install: no compiler, a failed compile, no
jax or a machine that is not x86-64 prints one line and the install goes on without them (the
kernels then build on first use). ``JAXMOE_PREBUILD_VARIANTS`` picks the variants (comma-separated)
or, set to ``none``, skips the prebuild.
"""

import importlib.util
import os
import pathlib
import shutil
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

NESTED = {"jaxmoe.server": "server", "jaxmoe.pallas_kernels": "pallas_kernels"}
HERE = pathlib.Path(__file__).resolve().parent
KERNELS = HERE / "pallas_kernels"

packages = find_packages(include=["jaxmoe", "jaxmoe.*"])
for name, folder in NESTED.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]


def prebuild_kernels(out: pathlib.Path) -> str:
    """Compiles the kernel variants into ``out`` (emptied first: no stale library from an earlier
    build is kept); returns the one line to print (never raises)."""
    try:
        shutil.rmtree(out, ignore_errors=True)
        wanted = os.environ.get("JAXMOE_PREBUILD_VARIANTS", "").strip()
        if wanted.lower() == "none":
            return "C++ CPU kernels not prebuilt: JAXMOE_PREBUILD_VARIANTS=none (they build on first use)"
        spec = importlib.util.spec_from_file_location("_jaxmoe_cpu_variants", KERNELS / "cpu_variants.py")
        variants = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(variants)
        try:
            import jax
        except ImportError as e:
            return f"C++ CPU kernels not prebuilt: jax is not importable in the build environment ({e}); they build on first use"
        chosen = [v.strip() for v in wanted.split(",") if v.strip()] or None
        _, line = variants.prebuild(KERNELS, out, jax.ffi.include_dir(), jax.__version__, variants=chosen)
        return line
    except Exception as e:  # the kernels must never fail the install
        return f"C++ CPU kernels not prebuilt: {type(e).__name__}: {e} (they build on first use)"


class BuildPyWithKernels(build_py):
    """``build_py``, then the prebuilt C++ CPU kernels into the package's ``_prebuilt`` folder."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            out = KERNELS / "_prebuilt"
        else:
            out = pathlib.Path(self.build_lib) / "jaxmoe" / "pallas_kernels" / "_prebuilt"
        print(f"jaxmoe: {prebuild_kernels(out)}", file=sys.stderr, flush=True)


setup(packages=packages, package_dir=NESTED, cmdclass={"build_py": BuildPyWithKernels})
