"""A GPU-shaped profile from the parameters FinDEP (arXiv:2512.21487) reports in its Fig. 7 (8x A6000).

Fig. 7(a): GEMM alpha = 0.17, beta = 8.59e-11 per m*k*n; attention alpha = 0.15, beta = 1.54e-11 per
unit of attention work. Fig. 7(b): (alpha, beta) of A2E for three (eg, ag) splits of 8 GPUs. We
read the units as milliseconds and bytes (the figure does not print them); the stage models are
derived with ``profile.derive_stages``. Used to simulate GPU-sized meshes without a GPU.
"""

from __future__ import annotations

from jaxmoe.findep.linear import LinearModel
from jaxmoe.findep.profile import BaseModels, Dims, Profile, derive_stages

MS = 1e-3
FIG7_GEMM = LinearModel(alpha=0.17 * MS, betas=(8.59e-11 * MS,))
FIG7_ATTENTION = LinearModel(alpha=0.15 * MS, betas=(1.54e-11 * MS,))
FIG7_COMM = {  # (eg, ag) -> (alpha ms, beta ms per byte)
    (7, 1): (0.10, 9.61e-7),
    (6, 2): (0.01, 1.28e-6),
    (4, 4): (0.37, 2.55e-6),
}


def fig7_comm(ag: int, eg: int) -> LinearModel:
    """The Fig. 7(b) fit whose attention share ag / (ag + eg) is closest to this layout's."""
    share = ag / (ag + eg)
    _, (alpha, beta) = min(FIG7_COMM.items(), key=lambda kv: abs(kv[0][1] / sum(kv[0]) - share))
    return LinearModel(alpha=alpha * MS, betas=(beta * MS,))


def paper_profile(dims: Dims, mesh: str, model: str, dtype: str = "bfloat16") -> Profile:
    base = BaseModels(
        gemm=FIG7_GEMM, attention=FIG7_ATTENTION, comm=fig7_comm(dims.attention_instances, dims.expert_instances)
    )
    return Profile(
        mesh=mesh,
        model=model,
        dtype=dtype,
        device="8x A6000 (FinDEP Fig. 7)",
        source="FinDEP (arXiv:2512.21487) Fig. 7 parameters, read as ms and bytes",
        dims=dims,
        stages=derive_stages(base, dims),
        base=base,
    )
