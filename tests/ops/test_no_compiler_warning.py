"""With no C++ compiler on PATH, no built kernel in the cache and no prebuilt one, ``LLM`` still generates (the ops'
XLA forms run) and each C++ CPU kernel it would have used prints exactly one warning line on stderr
saying which slower path runs instead and why."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import sys
from jaxmoe import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", num_blocks=16, block_size=8, max_num_seqs=2)
print(llm.generate([[3, 9, 27, 81]], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids)
"""


@pytest.mark.slow
def test_no_compiler_one_warning_line_per_kernel_naming_the_fallback(checkpoint_dir, tmp_path):
    model = checkpoint_dir("mixtral")
    (tmp_path / "bin").mkdir()  # PATH: nothing but an empty folder, so no c++, g++ or clang++
    env = {**os.environ, "PATH": str(tmp_path / "bin"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env["JAXMOE_PREBUILT_KERNELS"] = str(tmp_path / "no-prebuilt")  # none prebuilt by the install either
    env.pop("CXX", None)
    env.pop("JAXMOE_CPU_KERNEL", None)
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model)], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(eval(run.stdout.strip().splitlines()[-1])) == 3  # generated through the fallback
    warnings = [line for line in run.stderr.splitlines() if "warning" in line.lower()]
    kernels = [line.split("C++ CPU kernel ")[1].split()[0] for line in warnings]
    assert warnings and len(kernels) == len(set(kernels)), warnings  # one line per kernel, never repeated
    for line in warnings:
        assert line.startswith("jaxmoe: warning: the C++ CPU kernel ")
        assert "no C++ compiler (c++, g++ or clang++) on PATH; set CXX" in line and "instead (slower)" in line
    assert "building" not in run.stderr  # no build is attempted, so no build progress line either
