"""Shared fixtures: tiny Hugging Face checkpoints (built once per session) and their reference models."""

from __future__ import annotations

import gc
import pathlib
import sys

import jax
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from tiny_checkpoints import make_checkpoint  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """XLA:CPU maps memory for every program it compiles, and one pytest process compiles thousands:
    past the kernel's ``vm.max_map_count`` (65530 by default) the next compile aborts the process.
    The programs of a finished test module are dropped (a later module that needs one compiles it
    again, or loads it from the persistent compilation cache)."""
    yield
    gc.collect()
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="module", autouse=True)
def _fused_steps_where_qllm_is_not_the_subject(request):
    """QLLM's layer preemption is on by default on the monolithic executor (``QLLMConfig.preempts``):
    a served best-effort step then runs layer by layer, and warm-up compiles every shape a second
    time, layer by layer, by running it. Test modules whose subject is something else keep the
    fused steps (the default off, as ``layer_preemption=False``) so they do not pay for it; those
    under tests/qllm and modules that set ``LAYER_PREEMPTION_DEFAULT = True`` get the real default.
    Asking for it (``layer_preemption=True`` / ``--layer-preemption``, ``expert_queues``) is never
    changed."""
    from jaxmoe.assembly import QLLMConfig

    module = request.module
    if "qllm" in pathlib.Path(str(request.path)).parts or getattr(module, "LAYER_PREEMPTION_DEFAULT", False):
        yield
        return
    real = QLLMConfig.preempts

    def preempts(self, config):
        return False if self.layer_preemption is None and not self.expert_queues else real(self, config)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(QLLMConfig, "preempts", preempts)
        yield


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """checkpoint_dir(family, variant="default", **kw) -> path, cached for the session."""
    root = tmp_path_factory.mktemp("checkpoints")
    made: dict[tuple, pathlib.Path] = {}

    def get(family: str, variant: str = "default", **kw) -> pathlib.Path:
        key = (family, variant, tuple(sorted(kw.items())))
        if key not in made:
            name = "-".join([family, variant] + [f"{k}{v}" for k, v in sorted(kw.items())])
            made[key] = make_checkpoint(family, root / name, variant=variant, **kw)
        return made[key]

    return get
