"""With no C++ compiler and no prebuilt library, the CPU kernels say so in one warning line naming the slower path that runs
instead and why (once per process), and serving still works on the XLA forms."""

from __future__ import annotations

import pytest

import os
import subprocess
import sys

PROBE = """
from jaxmoe.pallas_kernels.expert_ffn import cpu_kernel
from jaxmoe.pallas_kernels.expert_ffn.api import resolve
print("AVAILABLE", cpu_kernel.available(), cpu_kernel.available())
print("IMPL", resolve("auto", {"cpu": "cpu_kernel", "other": "dense"}))
"""


@pytest.mark.slow
def test_no_compiler_is_one_warning_line_naming_the_fallback(tmp_path):
    env = {
        **os.environ,
        "PATH": str(tmp_path),  # no c++, g++ or clang++
        "CXX": "",
        "XDG_CACHE_HOME": str(tmp_path / "cache"),  # no library built before
        "JAXMOE_PREBUILT_KERNELS": str(tmp_path / "no-prebuilt"),  # and none prebuilt by the install
        "JAX_PLATFORMS": "cpu",
    }
    env.pop("JAXMOE_CPU_KERNEL", None)
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "AVAILABLE False False" in proc.stdout and "IMPL bucketed_loop" in proc.stdout
    warnings = [line for line in proc.stderr.splitlines() if "jaxmoe: warning" in line]
    assert warnings == [
        "jaxmoe: warning: the C++ CPU kernel expert_ffn is unavailable (no C++ compiler (c++, g++ or clang++) "
        "on PATH; set CXX); running the XLA expert FFN (bucketed_loop) instead (slower)"
    ]
