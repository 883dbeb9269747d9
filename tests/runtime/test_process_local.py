"""``runtime.process_local``: the attention and expert programs are ``ProcessLocal``; on a process
that holds none of their devices (``jax.distributed``) a call returns placeholders built from
``out_info``, so those must have the shapes, dtypes and shardings the programs really return. In one
process every program runs here: the placeholders are checked against each real call of a step
(with ``CrossProcessTransfer``, the executor used across processes)."""

from __future__ import annotations

import jax
import pytest

from jaxmoe import LLM, SamplingParams
from jaxmoe.runtime import process_local
from jaxmoe.runtime.cross_process import CrossProcessTransfer
from jaxmoe.runtime.process_local import ProcessLocal, runs_here


@pytest.mark.slow  # ~70 s at load 10: one disaggregated LLM built and run
def test_placeholders_match_what_every_program_returns(monkeypatch):
    llm = LLM(
        "tiny-random",
        dtype="float32",
        mesh="meshes/cpu-8-4a4e.yaml",
        num_blocks=32,
        block_size=8,
        max_num_seqs=2,
        executor_kwargs={"transfer": CrossProcessTransfer},
    )
    calls = []
    real_call = ProcessLocal.__call__

    def checked(self, *args, **kwargs):
        out = real_call(self, *args, **kwargs)
        calls.append((self, self.out_info(*args, **kwargs), out))
        return out

    monkeypatch.setattr(ProcessLocal, "__call__", checked)
    llm.generate([[5, 9, 17, 33, 2]], SamplingParams(max_tokens=3, ignore_eos=True))
    names = {getattr(p.jitted, "__name__", "") for p, _, _ in calls}
    assert {"embed_step", "layer_step", "head_step", "run"} <= names, names
    for program, info, out in calls:
        assert runs_here(program)  # one process: every program runs here
        for want, got in zip(jax.tree.leaves(info), jax.tree.leaves(out), strict=True):
            assert (want.shape, want.dtype) == (got.shape, got.dtype), program.jitted
            assert want.sharding.is_equivalent_to(got.sharding, got.ndim), (program.jitted, want.sharding, got.sharding)


def test_placeholder_needs_a_sharding():
    with pytest.raises(ValueError, match="out_shardings"):
        process_local.absent(jax.ShapeDtypeStruct((2, 3), jax.numpy.float32))
