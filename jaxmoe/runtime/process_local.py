"""Programs that only the processes holding their devices compile and run (multi-controller
``jax.distributed``: one process per host, each addressing only its own devices).

A ``jax.jit`` whose devices all belong to other processes is a no-op where it is called (it returns
an array with no addressable shards) but jax still traces, lowers and compiles it there. On a
disaggregated layout whose attention side is on some processes and expert side on others, every
process would compile every program, half of them for nothing. ``ProcessLocal`` wraps such a jitted
program over one mesh: on a process that addresses none of the mesh's devices a call returns
``absent`` arrays of the output's shapes, dtypes and shardings (``eval_shape``: traced once, never
lowered nor compiled); elsewhere it is the jitted program. The executor's ``lower_step`` skips it
the same way (``runs_here``), so a live rescale's build units and the steps agree on what each
process compiles. The programs that span processes (``cross_process`` transfers, ``slot_moves``)
are collectives every process runs; they are not wrapped.
"""

from __future__ import annotations

import jax
import numpy as np


class ProcessLocal:
    """``jitted`` (a ``jax.jit`` over ``mesh``) that only the processes holding a device of ``mesh``
    run. ``out_shardings``: the outputs' shardings (a tuple, one per output, or one sharding for
    every output) when ``jitted`` was made without them (e.g. a ``shard_map``'s); the placeholders
    need them. Other attributes (``lower``, ``trace``, ``eval_shape``) are ``jitted``'s."""

    def __init__(self, jitted, mesh, out_shardings=None):
        self.jitted, self.mesh, self.out_shardings = jitted, mesh, out_shardings
        self._here: bool | None = None  # decided on the first call (an AbstractMesh is never called)

    @property
    def runs_here(self) -> bool:
        """Whether this process holds a device of the program's mesh (in one process: always)."""
        if self._here is None:
            me = jax.process_index()
            self._here = any(d.process_index == me for d in np.ravel(self.mesh.devices))
        return self._here

    def __call__(self, *args, **kwargs):
        if self.runs_here:
            return self.jitted(*args, **kwargs)
        return jax.tree.map(absent, self.out_info(*args, **kwargs))

    def out_info(self, *args, **kwargs):
        """The outputs' ``jax.ShapeDtypeStruct``s with their shardings, from tracing only."""
        info = self.jitted.eval_shape(*args, **kwargs)
        if self.out_shardings is None:
            return info
        leaves, tree = jax.tree.flatten(info)
        shardings = self.out_shardings
        if isinstance(shardings, jax.sharding.Sharding):
            shardings = (shardings,) * len(leaves)
        if len(leaves) != len(shardings):
            raise ValueError(f"out_shardings: {len(self.out_shardings)} given for a program with {len(leaves)} outputs")
        structs = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh) for s, sh in zip(leaves, shardings)]
        return jax.tree.unflatten(tree, structs)

    def __getattr__(self, name):
        return getattr(self.jitted, name)


def absent(struct: jax.ShapeDtypeStruct) -> jax.Array:
    """An array of ``struct``'s shape, dtype and sharding whose devices all belong to other processes:
    it has no shard here (what a jitted program over those devices returns on this process)."""
    if struct.sharding is None:
        raise ValueError(f"out_shardings: an output {struct.shape} {struct.dtype} has no sharding to place it by")
    if struct.sharding.addressable_devices:
        raise ValueError(f"absent: {struct.sharding} has devices on this process")
    return jax.make_array_from_single_device_arrays(struct.shape, struct.sharding, [], dtype=struct.dtype)


def runs_here(program) -> bool:
    """Whether ``program`` runs on this process (a plain jitted program always does)."""
    return not isinstance(program, ProcessLocal) or program.runs_here
