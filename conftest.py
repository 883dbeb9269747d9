"""Test-wide set-up: 8 host CPU devices for multi-device meshes; GPU tests skipped without a GPU."""

import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache per test run (not the user's ~/.cache): programs that several
# tests compile identically are loaded instead of compiled again.
os.environ.setdefault("JAXMOE_COMPILATION_CACHE", tempfile.mkdtemp(prefix="jaxmoe-xla-"))
os.environ.setdefault("JAXMOE_PROFILE_CACHE", tempfile.mkdtemp(prefix="jaxmoe-profiles-"))  # FinDEP profiles

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    import jax

    if any(d.platform == "gpu" for d in jax.devices()):
        return
    skip = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
