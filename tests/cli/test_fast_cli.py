"""``jaxmoe --help`` and ``jaxmoe client`` answer quickly: neither imports JAX (the package, the
subcommand modules and their packages import lazily)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

PROBE = """
import sys, time
t = time.perf_counter()
from jaxmoe.cli import main
try:
    rc = main({argv!r})
except SystemExit as e:
    rc = e.code
print("RESULT", rc, time.perf_counter() - t, "jax" in sys.modules)
"""


def _run(argv: list[str]) -> tuple[int, float, bool]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True, text=True, timeout=120)
    wall = time.perf_counter() - t0
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    _, rc, _, jax_loaded = line.split()
    return int(rc), wall, jax_loaded == "True"


@pytest.mark.parametrize(
    "argv, rc",
    [
        (["--help"], 0),
        (["serve", "--help"], 0),
        (["client", "--target", "127.0.0.1:1", "--prompt", "hi", "--timeout", "0.2"], 1),
    ],
)
def test_help_and_client_do_not_import_jax(argv, rc):
    got, wall, jax_loaded = _run(argv)
    assert got == rc
    assert not jax_loaded
    assert wall < 3.0, f"{argv}: {wall:.1f}s (under 1 s on an idle machine)"


def test_the_expert_impl_choices_match_the_kernels():
    from jaxmoe.options import EXPERT_IMPLS
    from jaxmoe.pallas_kernels.expert_ffn import IMPLS

    assert EXPERT_IMPLS == tuple(IMPLS)


@pytest.mark.slow
def test_the_package_still_exports_its_api():
    import jaxmoe

    assert jaxmoe.LLM.__name__ == "LLM" and jaxmoe.SamplingParams.__name__ == "SamplingParams"
    with pytest.raises(AttributeError):
        jaxmoe.nothing_here  # noqa: B018
