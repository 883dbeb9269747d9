"""``jaxmoe serve``'s multi-host flags (``--coordinator``, ``--num-processes``, ``--process-id``,
``--distributed``) and the environment jax.distributed reads: a bad combination is refused before
anything starts with one line naming the flag; which cluster is joined otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxmoe.cli import build_parser, main
from jaxmoe.mesh import MeshConfigError, check_cluster, load_mesh
from jaxmoe.server.multihost import distributed_args

pytestmark = pytest.mark.timeout(120)
MESHES = Path(__file__).resolve().parents[2] / "meshes"


def _args(*flags):
    return build_parser().parse_args(["serve", "--model", "tiny-random", *flags])


@pytest.mark.parametrize(
    "flags, line",
    [
        (["--num-processes", "2"], "--process-id: give --num-processes and --process-id together"),
        (["--process-id", "1"], "--num-processes: give --num-processes and --process-id together"),
        (["--num-processes", "2", "--process-id", "0"], "--coordinator: give HOST:PORT of process 0"),
        (
            ["--coordinator", "10.0.0.1", "--num-processes", "2", "--process-id", "0"],
            "--coordinator: must be HOST:PORT (e.g. 10.0.0.1:1234), got '10.0.0.1'",
        ),
        (
            ["--coordinator", "h:1234", "--num-processes", "2", "--process-id", "2"],
            "--process-id: must be an integer in 0..1 (--num-processes 2), got 2",
        ),
        (["--coordinator", "h:1234", "--num-processes", "0", "--process-id", "0"], "--num-processes: must be"),
    ],
)
def test_bad_multihost_flags_are_refused_with_one_line(flags, line, capsys, monkeypatch):
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    assert main(["serve", "--model", "tiny-random", "--http-port", "0", "--grpc-port", "0", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"jaxmoe: {line}"), err


def test_which_cluster_is_joined():
    flags = ["--coordinator", "10.0.0.1:1234", "--num-processes", "2", "--process-id", "1"]
    assert distributed_args(_args(*flags), {}) == dict(
        coordinator_address="10.0.0.1:1234", num_processes=2, process_id=1
    )
    assert distributed_args(_args(), {}) is None  # one process
    assert distributed_args(_args(), {"SLURM_NTASKS": "1"}) is None
    # jax.distributed.initialize() reads the rest itself
    assert distributed_args(_args(), {"SLURM_NTASKS": "2"}) == {}
    assert distributed_args(_args(), {"OMPI_COMM_WORLD_SIZE": "4"}) == {}
    assert distributed_args(_args(), {"JAX_COORDINATOR_ADDRESS": "h:1"}) == {}
    assert distributed_args(_args("--distributed"), {}) == {}  # e.g. a Cloud TPU slice
    flags = ["--num-processes", "2", "--process-id", "0"]  # the address from the environment
    assert distributed_args(_args(*flags), {"JAX_COORDINATOR_ADDRESS": "h:1"}) == dict(num_processes=2, process_id=0)


@pytest.mark.slow
def test_mesh_file_must_match_the_cluster():
    spec = load_mesh(MESHES / "cpu-2x4.yaml")
    check_cluster(spec, 2, 4, "cpu")
    with pytest.raises(MeshConfigError, match=r"cpu-2x4.yaml: nodes: the file describes 2 nodes .* reports 3"):
        check_cluster(spec, 3, 4, "cpu")
    with pytest.raises(MeshConfigError, match=r"devices_per_node: the file says 4 but this process has 8"):
        check_cluster(spec, 2, 8, "cpu")
    with pytest.raises(MeshConfigError, match=r"platform: the file says cpu but the jax devices are gpu"):
        check_cluster(spec, 2, 4, "cuda")
    h100 = load_mesh(MESHES / "h100-2x8.yaml")
    check_cluster(h100, 2, 8, "cuda")
