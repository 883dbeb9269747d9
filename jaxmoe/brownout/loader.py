"""BrownoutServe's Experts Loader: the united experts of a running engine replaced by those of another
``jaxmoe unite`` directory of the same model (another k, grouping or distillation), without a restart.

``load_united_experts(engine, directory)`` runs between steps (the caller's step boundary: ``LLM``
is synchronous, the server runs it on the engine thread through ``AsyncEngine.call``): the served
parameters lose their united experts (unloaded), get the directory's (loaded), and the executor
serves them from the next step on (``set_params``: its programs are traced again for the new number
of logical experts, the KV cache stays, so requests in flight go on). The thresholds stay as they
are; threshold 1 is still the original model. The prefix cache does not reuse KV computed with the
old united experts (``params_version`` is part of its key).
"""

from __future__ import annotations

import json
from pathlib import Path

from jaxmoe.brownout.config import BrownoutError
from jaxmoe.brownout.routing import is_brownout
from jaxmoe.brownout.united import META_FILE, NAMES, attach
from jaxmoe.quantization import Quantized


def first_experts(w, E: int):
    """The first ``E`` experts of a stacked expert weight (a ``Quantized`` one value and scale alike)."""
    if isinstance(w, Quantized):
        return Quantized(w.q[:E], w.scale[:E], w.block)
    return w[:E]


def originals(params: dict, cfg) -> dict:
    """``params`` (a per-layer tree, possibly in brownout's logical form) with only the E original
    experts of each MoE layer: united experts and the expert -> united expert map removed."""
    E = cfg.moe.num_experts
    layers = []
    for layer in params["layers"]:
        if "moe" in layer:
            moe = {k: v for k, v in layer["moe"].items() if k not in ("united", "united_groups")}
            moe.update({k: first_experts(moe[k], E) for k in NAMES})
            layer = dict(layer, moe=moe)
        layers.append(layer)
    return dict(params, layers=layers)


def load_united_experts(engine, directory) -> dict:
    """Serve the united experts of ``directory`` (made by ``jaxmoe unite`` from the model ``engine``
    serves) from the next step on; returns {"ways", "grouping", "united_experts": U per MoE layer,
    "logical_experts": E + U}.
    A ``BrownoutError`` naming what does not fit (nothing changes then)."""
    from jaxmoe.config import load_config

    executor, directory = engine.executor, Path(directory)
    if not is_brownout(executor):
        raise BrownoutError("load united experts: this engine runs without brownout (LLM(dir, brownout=...))")
    if not hasattr(executor, "set_params"):
        raise BrownoutError(
            f"load united experts: the {type(executor).__name__} cannot swap its parameters at run time "
            "(the monolithic executor can)"
        )
    if not (directory / META_FILE).is_file():
        raise BrownoutError(
            f"{directory} has no united experts ({META_FILE}): "
            "create them with `jaxmoe unite --model DIR --ways K --out DIR2`"
        )
    try:
        cfg = load_config(directory)
    except Exception as e:  # noqa: BLE001 - any unreadable config is the same answer
        raise BrownoutError(f"{directory}: no readable model config ({e})") from None
    if cfg != engine.cfg:
        raise BrownoutError(f"{directory}: united experts of another model (its config differs from the served one)")
    params = attach(originals(executor.params, cfg), cfg, directory)
    try:
        executor.set_params(params)
    except ValueError as e:
        raise BrownoutError(f"load united experts from {directory}: {e}") from None
    meta = json.loads((directory / META_FILE).read_text())
    return {
        "ways": meta["ways"],
        "grouping": meta.get("grouping"),
        "united_experts": max(max(r["groups"]) + 1 for r in meta["layers"].values()),
        "logical_experts": executor.num_logical_experts,
    }
