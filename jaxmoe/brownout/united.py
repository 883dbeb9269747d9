"""United experts (BrownoutServe section III-B, eq. 4): one expert per group of k original experts,
distilled to reproduce the group's outputs, saved beside a checkpoint, and attached to its params.

``unite(model_dir, ways, out_dir)``: for every MoE layer, the layer's inputs (post-attention-norm
hidden states) are collected from real forward passes over text (the corpus's training part, windows
spread evenly over it); the m experts are split into ceil(m / k) groups (the last one short when k
does not divide m; ``index``: experts k*j .. k*j + k - 1, as the paper; ``similarity``: greedily by
the distance between the experts' outputs on those tokens; ``coactivation``: greedily by how often
the router picks two experts for the same token; both our extensions); each united expert starts as
the mean of its group's weights and is trained with optax (Adam) to minimise eq. 4, the squared
error between its output and each group expert's output, taken on the tokens the router gave that
expert (the token subsets of the paper's Fig. 3: what the united expert replaces at serving time),
weighted by the router's combine weight. The eq. 4 loss at the group-mean start and after training
is reported per united expert. Each finished layer is saved at once (``out_dir/.unite/``): a
stopped run resumes at the next layer.

``out_dir`` gets a copy of the checkpoint files plus ``united_experts.safetensors`` (tensor names
``model.layers.{i}.united_experts.{j}.{w_gate,w_up,w_down}``, jaxmoe's [in, out] layout) and
``brownout.json`` (ways, grouping, each layer's expert -> united expert map, distillation losses).
``attach(params, cfg, dir)`` adds them to a param tree for ``LLM(dir, brownout=...)``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from jaxmoe.brownout.config import BrownoutError
from jaxmoe.models.common import swiglu_mlp
from jaxmoe.models.router import route

UNITED_FILE = "united_experts.safetensors"
META_FILE = "brownout.json"
GROUPINGS = ("index", "similarity", "coactivation")
NAMES = ("w_gate", "w_up", "w_down")


def check_ways(num_experts: int, ways: int) -> None:
    if not isinstance(ways, int) or isinstance(ways, bool) or ways < 2 or ways > num_experts:
        raise BrownoutError(f"ways {ways!r} must be an integer from 2 to the {num_experts} experts of a layer")


def num_groups(num_experts: int, ways: int) -> int:
    """ceil(m / k): the united experts of a layer with m experts in groups of k (the last may be short)."""
    return -(-num_experts // ways)


def group_by_index(num_experts: int, ways: int) -> np.ndarray:
    return np.arange(num_experts) // ways


def group_by_similarity(outputs: np.ndarray, ways: int) -> np.ndarray:
    """Greedy: the lowest free expert and its ways - 1 nearest free experts (mean squared output
    distance on the same tokens) form a group. ``outputs`` [E, N, D]."""
    E = outputs.shape[0]
    flat = outputs.reshape(E, -1).astype(np.float64)
    sq = (flat**2).sum(1)
    dist = sq[:, None] + sq[None, :] - 2 * flat @ flat.T
    groups = np.full(E, -1)
    for g in range(num_groups(E, ways)):
        free = np.flatnonzero(groups < 0)
        seed = free[0]
        near = free[np.argsort(dist[seed, free], kind="stable")][:ways]
        groups[near] = g
    return groups


def group_by_coactivation(ids: np.ndarray, num_experts: int, ways: int) -> np.ndarray:
    """Greedy: the lowest free expert and the ways - 1 free experts the router most often picks
    together with it (ties: lower index) form a group. ``ids`` [N, top_k] routed expert ids."""
    picked = np.zeros((len(ids), num_experts))
    np.put_along_axis(picked, np.asarray(ids), 1.0, axis=1)
    together = picked.T @ picked  # [E, E] tokens routed to both
    groups = np.full(num_experts, -1)
    for g in range(num_groups(num_experts, ways)):
        free = np.flatnonzero(groups < 0)
        seed, others = free[0], free[1:]
        near = others[np.argsort(-together[seed, others], kind="stable")][: ways - 1]
        groups[[seed, *near]] = g
    return groups


def _expert(w: dict, e: int) -> dict:
    return {k: w[k][e] for k in NAMES}


def eq4_loss(united: dict, x, target, weight):
    """Eq. 4 over a group's (token, original expert) pairs: the weighted mean over the pairs of the
    squared error between the united expert's output on the token and the expert's (per hidden
    dimension). ``x`` [n, D] the pairs' tokens, ``target`` [n, D] the chosen experts' outputs,
    ``weight`` [n] the router's combine weights."""
    err = jnp.mean((swiglu_mlp(united, x) - target) ** 2, axis=-1)
    return jnp.sum(weight * err) / jnp.maximum(jnp.sum(weight), 1e-9)


def group_pairs(members, ids, weights, outs, x):
    """(tokens [n, D], targets [n, D], weights [n]) of the (token, expert) pairs where the router
    chose an expert of ``members`` for the token: what the group's experts computed on their own
    tokens (the token subsets of the paper's Fig. 3). No pair in the sample: every token against
    every member, weight 1."""
    rows, cols = np.nonzero(np.isin(ids, members))
    if len(rows) == 0:
        rows = np.tile(np.arange(x.shape[0]), len(members))
        chosen = np.repeat(members, x.shape[0])
        return x[rows], outs[chosen, rows], jnp.ones(len(rows), jnp.float32)
    return x[rows], outs[ids[rows, cols], rows], jnp.asarray(weights[rows, cols], jnp.float32)


def _padded(x, target, weight):
    """The pairs padded with zero-weight rows to a power of two (one compiled update for most groups)."""
    n = len(weight)
    pad = (1 << max(0, n - 1).bit_length()) - n
    return (
        jnp.pad(x, ((0, pad), (0, 0))),
        jnp.pad(target, ((0, pad), (0, 0))),
        jnp.pad(weight, (0, pad)),
    )


def distill_layer(moe: dict, cfg, xs: np.ndarray, ways: int, grouping: str, steps: int, lr: float, seed: int):
    """(united weights {name: [U, ...]}, groups [E], {"initial": [U], "final": [U]} eq. 4 losses at the
    group-mean start and after training) for one layer's inputs xs [N, D]; U = ceil(E / ways)."""
    E = moe["w_gate"].shape[0]
    x = jnp.asarray(xs, jnp.float32)
    w = {k: jnp.asarray(moe[k], jnp.float32) for k in NAMES}
    ids, weights = route({k: jnp.asarray(v, jnp.float32) for k, v in moe.items() if k not in NAMES}, cfg.moe, x)
    outs = jax.vmap(lambda e: swiglu_mlp(jax.tree.map(lambda a: a[e], w), x))(jnp.arange(E))  # [E, N, D]
    if grouping == "index":
        groups = group_by_index(E, ways)
    elif grouping == "similarity":
        groups = group_by_similarity(np.asarray(outs), ways)
    elif grouping == "coactivation":
        groups = group_by_coactivation(np.asarray(ids), E, ways)
    else:
        raise BrownoutError(f"grouping must be one of {GROUPINGS}, got {grouping!r}")
    opt = optax.adam(lr)
    united, losses = {k: [] for k in NAMES}, {"initial": [], "final": []}
    ids, weights = np.asarray(ids), np.asarray(weights)

    @jax.jit
    def update(p, state, xg, target, wg):
        loss, grad = jax.value_and_grad(eq4_loss)(p, xg, target, wg)
        upd, state = opt.update(grad, state, p)
        return optax.apply_updates(p, upd), state, loss

    for g in range(int(groups.max()) + 1):
        members = np.flatnonzero(groups == g)
        xg, target, wg = _padded(*group_pairs(members, ids, weights, outs, x))
        params = {k: w[k][members].mean(axis=0) for k in NAMES}  # the group's mean: the start
        losses["initial"].append(float(eq4_loss(params, xg, target, wg)))
        state = opt.init(params)
        for _ in range(steps):
            params, state, _ = update(params, state, xg, target, wg)
        losses["final"].append(float(eq4_loss(params, xg, target, wg)))
        for k in NAMES:
            united[k].append(np.asarray(params[k]))
    return {k: np.stack(v) for k, v in united.items()}, groups.astype(np.int32), losses


def collect_moe_inputs(cfg, params: dict, windows: np.ndarray) -> dict[int, np.ndarray]:
    """Per MoE layer: its input hidden states [N, D] over token windows [W, T] (the training forward,
    which equals the serving forward)."""
    from jaxmoe.train.model import moe_inputs

    fn = jax.jit(lambda p, t: moe_inputs(p, cfg, t))
    got: dict[int, list[np.ndarray]] = {}
    for window in windows:
        for layer, xs in fn(params, jnp.asarray(window[None])).items():
            got.setdefault(layer, []).append(np.asarray(xs, np.float32))
    return {layer: np.concatenate(v) for layer, v in got.items()}


def unite(
    model_dir,
    ways: int,
    out_dir,
    *,
    grouping: str = "index",
    tokens: int = 8192,
    steps: int = 300,
    lr: float = 3e-3,
    seed: int = 0,
    corpus: str = "stdlib",
    progress: bool = True,
) -> dict:
    """Build, distil and save united experts for every MoE layer of the checkpoint in ``model_dir``."""
    from jaxmoe.checkpoint.model import load_model
    from jaxmoe.train import data
    from jaxmoe.train.corpus import CorpusError, documents, load_corpus

    from jaxmoe.demo import DEMO_DIR

    name = str(model_dir)
    model_dir, out_dir = (DEMO_DIR if name == "demo" else Path(model_dir)), Path(out_dir)
    if grouping not in GROUPINGS:
        raise BrownoutError(f"grouping must be one of {GROUPINGS}, got {grouping!r}")
    cfg, params, tokenizer = load_model(name if name == "demo" else model_dir, "float32")
    check_ways(cfg.moe.num_experts, ways)
    if out_dir.resolve() == model_dir.resolve():
        raise BrownoutError("--out must be a new directory, not the model's")
    work = out_dir / ".unite"
    work.mkdir(parents=True, exist_ok=True)
    try:  # the training part only: held-out text stays unseen (it scores the result)
        texts = [d.text for d in load_corpus(corpus).train]
    except CorpusError:  # too few files to split: all of it
        texts = [d.text for d in documents(corpus)]
    stream = data.encode_documents(tokenizer, texts[:: max(1, len(texts) // 64)])
    windows = data.eval_windows(stream, 256)
    windows = windows[np.linspace(0, len(windows) - 1, max(1, min(len(windows), tokens // 256))).astype(int)]
    moe_layers = [i for i, is_moe in enumerate(cfg.moe_layers) if is_moe]
    inputs = None
    report = {}
    for i in tqdm(moe_layers, desc="uniting experts", unit="layer", disable=not progress):
        done = work / f"layer_{i}.npz"
        if not done.exists():
            if inputs is None:
                inputs = collect_moe_inputs(cfg, params, windows)
            united, groups, losses = distill_layer(
                params["layers"][i]["moe"], cfg, inputs[i], ways, grouping, steps, lr, seed
            )
            np.savez(
                done,
                groups=groups,
                losses=np.asarray(losses["final"]),
                initial_losses=np.asarray(losses["initial"]),
                **united,
            )
        saved = np.load(done)
        report[i] = {
            "groups": saved["groups"].tolist(),
            "losses": saved["losses"].tolist(),
            "initial_losses": saved["initial_losses"].tolist(),
        }
    _write(model_dir, out_dir, work, moe_layers, ways, grouping, report, params)
    return report


def _write(model_dir: Path, out_dir: Path, work: Path, moe_layers, ways, grouping, report, params) -> None:
    from safetensors.numpy import save_file

    for f in model_dir.iterdir():
        if f.is_file() and f.name not in (UNITED_FILE, META_FILE):
            shutil.copyfile(f, out_dir / f.name)
    dtype = np.asarray(params["embed"]).dtype
    tensors = {}
    for i in moe_layers:
        saved = np.load(work / f"layer_{i}.npz")
        for k in NAMES:
            for j, w in enumerate(saved[k]):
                tensors[f"model.layers.{i}.united_experts.{j}.{k}"] = np.ascontiguousarray(w.astype(np.float32))
    save_file(tensors, str(out_dir / UNITED_FILE))
    meta = {
        "ways": ways,
        "grouping": grouping,
        "dtype_of_base": str(dtype),
        "layers": {str(i): r for i, r in report.items()},
    }
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    shutil.rmtree(work)


def like(original, w: np.ndarray):
    """United weights ``w`` stored as ``original`` (the routed experts' weight) is: its dtype, or quantized
    by the same method when the model was quantized on load (``jaxmoe.quantization``)."""
    from jaxmoe.quantization import Quantized, quantize_fp8, quantize_int8

    if isinstance(original, Quantized):
        return (quantize_int8 if original.method == "int8" else quantize_fp8)(jnp.asarray(w, jnp.float32))
    return jnp.asarray(w, original.dtype)


def attach(params: dict, cfg, directory) -> dict:
    """``params`` with each MoE layer's united experts (``moe["united"]``) and expert -> united
    expert map (``moe["united_groups"]``) from ``directory``."""
    from safetensors.numpy import load_file

    directory = Path(directory)
    if not (directory / UNITED_FILE).exists() or not (directory / META_FILE).exists():
        raise BrownoutError(
            f"{directory} has no united experts ({UNITED_FILE}, {META_FILE}): "
            "create them with `jaxmoe unite --model DIR --ways K --out DIR2`"
        )
    meta = json.loads((directory / META_FILE).read_text())
    tensors = load_file(str(directory / UNITED_FILE))
    layers = list(params["layers"])
    for i, is_moe in enumerate(cfg.moe_layers):
        if not is_moe:
            continue
        entry = meta["layers"].get(str(i))
        if entry is None:
            raise BrownoutError(f"{directory / META_FILE}: no united experts for MoE layer {i}")
        U = max(entry["groups"]) + 1
        united = {
            k: like(
                layers[i]["moe"][k], np.stack([tensors[f"model.layers.{i}.united_experts.{j}.{k}"] for j in range(U)])
            )
            for k in NAMES
        }
        moe = dict(layers[i]["moe"], united=united, united_groups=jnp.asarray(entry["groups"], jnp.int32))
        layers[i] = dict(layers[i], moe=moe)
    return dict(params, layers=layers)
