"""Embeddings, the monolithic layer loop and the LM head.

A layer's parameters are split the way the runtime splits the work:
``{"attn": ..., "mlp": ...}`` for a dense layer and ``{"attn": ..., "moe": ..., "shared": ...}``
for an MoE layer ("shared" only when the family has shared experts).  ``attn``, ``mlp`` and
``shared`` run on the attention side, ``moe`` (router + routed experts) on the expert side.

The monolithic forward runs the layers as ``lax.scan`` over *groups*: maximal runs of consecutive
layers with the same structure (DeepSeek: the dense first layers, then the MoE layers), their
parameters and KV caches stacked on a leading layer axis (``stack_layers``). A compiled step then
holds one layer body per group, not one per layer: compile time and the JIT's memory mappings do
not grow with depth.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.config import ModelConfig
from jaxmoe.models.attention import AttentionBatch, attention_layer, init_layer_cache
from jaxmoe.models.common import INVARIANT, pack16, rms_norm, swiglu_mlp, unpack16
from jaxmoe.models.experts import TOP_K, moe_layer, shared_experts
from jaxmoe.models.layer_matrix import LayerMatrix
from jaxmoe.models.routing import ExpertRouting
from jaxmoe.pallas_kernels.expert_ffn import cpu_kernel
from jaxmoe.pallas_kernels.expert_ffn.panels import at, is_panels, to_panels, width_for
from jaxmoe.quantization import Quantized, is_quantized


def layer_groups(layers: list[dict]) -> list[tuple[int, int]]:
    """(start, stop) of each maximal run of layers with the same parameter structure and shapes."""

    def signature(layer):
        return jax.tree.structure(layer), tuple((a.shape, a.dtype) for a in jax.tree.leaves(layer))

    groups, start = [], 0
    for i in range(1, len(layers) + 1):
        if i == len(layers) or signature(layers[i]) != signature(layers[start]):
            groups.append((start, i))
            start = i
    return groups


def stack_layers(params: dict) -> dict:
    """``params`` with ``layers`` replaced by ``groups``: per group, the layers' parameters stacked
    (16-bit floats as their bits, ``common.pack16``; the model's float dtype is ``params["embed"]``'s)."""
    layers = params["layers"]
    groups = [_stack_group(layers[a:b]) for a, b in layer_groups(layers)]
    return {**{k: v for k, v in params.items() if k != "layers"}, "groups": groups}


@jax.jit
def _stack_group(layers: list[dict]) -> dict:
    """One program per group (not one per parameter shape: fewer compiles at start-up)."""
    return jax.tree.map(lambda *xs: pack16(jnp.stack(xs)), *layers)


def unstack_layers(stacked: dict) -> dict:
    """The inverse of ``stack_layers`` (and of ``store_as_panels``): per-layer parameters."""
    dtype = stacked["embed"].dtype
    layers = []
    for group in stacked["groups"]:
        n = jax.tree.leaves(group)[0].shape[0]
        layers += [jax.tree.map(lambda a, i=i: unpack16(at(a, i), dtype), group, is_leaf=is_panels) for i in range(n)]
    return {**{k: v for k, v in stacked.items() if k != "groups"}, "layers": layers}


def store_as_panels(stacked: dict) -> dict:
    """``stacked`` with the routed expert weights (every logical expert's) stored as column ``Panels``,
    the layout the CPU expert kernel reads fastest (``pallas_kernels/expert_ffn/panels.py``); weights
    whose D and F no panel width divides stay plain; 16-bit ones are stored in pairs of rows where
    the CPU has a bf16 dot (``cpu_kernel.has_bf16_dot``). The plain arrays are given up (donated). (The
    attention projections as panels, read in place at every row count, measured 6 % faster at 1 row,
    8 % slower at 16 and no different at prefill in the 107 M model: they stay plain.)"""
    pairs = cpu_kernel.has_bf16_dot()
    return {**stacked, "groups": [_group_as_panels(group, pairs) for group in stacked["groups"]]}


@functools.partial(jax.jit, donate_argnums=0, static_argnums=1)
def _group_as_panels(group: dict, bf16_pairs: bool) -> dict:
    return jax.tree_util.tree_map_with_path(
        lambda path, a: _leaf_as_panels(path, a, bf16_pairs), group, is_leaf=is_quantized
    )


def _leaf_as_panels(path, a, bf16_pairs: bool):
    keys = [getattr(k, "key", None) for k in path]
    width = width_for(*a.shape[-2:])  # gate [D, F] and down [F, D]: one width for both
    if not (keys[0] == "moe" and keys[-1] in ROUTED and width):
        return a
    if is_quantized(a):  # int8 (``jaxmoe.quantization``): its values as panels, its scales as they are
        return Quantized(to_panels(a.q, width), a.scale) if a.method == "int8" else a
    return to_panels(a, width, bf16_pairs and a.dtype.itemsize == 2)  # pairs: bfloat16 (or its bits)


def stack_layer_by_layer(params: dict, as_panels: bool, release: tuple[list, ...] = ()) -> dict:
    """``store_as_panels(stack_layers(params))`` (``as_panels``) or ``stack_layers(params)``, built one
    parameter at a time: each parameter's stacked array is filled layer by layer and each layer's array
    let go once placed. On one CPU device the stacked array is host memory that becomes resident only
    as each slice is written (``_stack_on_host``), so start-up holds the model once plus a layer's
    slice; elsewhere it is a device buffer allocated up front and updated in place (donated), so one
    stacked parameter more. ``release``: lists holding the per-layer parameters the caller gives
    up (``params["layers"]``, the lists it was made from); their entries are set to None first, so the
    per-layer arrays live only here. Quantized parameters take the whole-group path (``stack_layers``)."""
    layers = list(params["layers"])
    if any(is_quantized(a) for a in jax.tree.leaves(layers, is_leaf=is_quantized)):
        stacked = stack_layers(params)
        return store_as_panels(stacked) if as_panels else stacked
    pairs = as_panels and cpu_kernel.has_bf16_dot()
    spans = layer_groups(layers)
    treedefs = {a: jax.tree_util.tree_structure(layers[a]) for a, _ in spans}
    paths = {a: [p for p, _ in jax.tree_util.tree_flatten_with_path(layers[a])[0]] for a, _ in spans}
    leaves = [jax.tree.leaves(layer) for layer in layers]  # from here on the only references
    for owner in (*release, layers):
        for i in range(len(owner)):
            owner[i] = None
    groups = []
    for a, b in spans:
        stacked = []
        for j, path in enumerate(paths[a]):
            one = jax.eval_shape(lambda x, path=path: _stored_leaf(path, x, as_panels, pairs), leaves[a][j])
            if _on_one_cpu(leaves[a][j]):
                stacked.append(_stack_on_host(leaves, a, b, j, one, tuple(path), as_panels, pairs))
                continue
            buf = jax.tree.map(lambda s, n=b - a: jnp.zeros((n,) + s.shape, s.dtype), one)
            for i in range(a, b):
                buf = _place_leaf(buf, leaves[i][j], jnp.int32(i - a), tuple(path), as_panels, pairs)
                leaves[i][j] = None
            stacked.append(buf)
        groups.append(jax.tree_util.tree_unflatten(treedefs[a], stacked))
    return {**{k: v for k, v in params.items() if k != "layers"}, "groups": groups}


def _on_one_cpu(a) -> bool:
    devices = getattr(getattr(a, "sharding", None), "device_set", ())
    return len(devices) == 1 and next(iter(devices)).platform == "cpu"


def _stack_on_host(leaves: list[list], a: int, b: int, j: int, one, path: tuple, as_panels: bool, pairs: bool):
    """Parameter ``j`` of layers [a, b) stacked, on a CPU device: written layer by layer into fresh
    (untouched, so not yet resident) 64-byte-aligned host memory, each layer's array let go once
    copied, and the filled memory handed to jax without a copy. Resident memory grows by one layer's
    slice at a time, not by the whole stacked parameter as a zero-filled device buffer would."""
    n = b - a
    hosts = jax.tree.map(lambda s: _aligned_empty((n,) + s.shape, s.dtype), one)
    for i in range(a, b):
        stored = _stored_one(leaves[i][j], path, as_panels, pairs)
        leaves[i][j] = None
        jax.tree.map(lambda h, x, k=i - a: np.copyto(h[k], np.asarray(x)), hosts, stored)
        del stored
    return jax.tree.map(jax.device_put, hosts)  # aligned host memory: the CPU device takes it as it is


def _aligned_empty(shape: tuple, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start : start + nbytes].view(dtype).reshape(shape)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _stored_one(a, path, as_panels: bool, pairs: bool):
    return _stored_leaf(path, a, as_panels, pairs)


def _stored_leaf(path, a, as_panels: bool, pairs: bool):
    """One layer's parameter as the stacked arrays hold it: 16-bit floats packed, routed experts as
    panels."""
    a = pack16(a)
    return _leaf_as_panels(path, a, pairs) if as_panels else a


@functools.partial(jax.jit, donate_argnums=0, static_argnums=(3, 4, 5))
def _place_leaf(buf, a, i, path, as_panels: bool, pairs: bool):
    stored = _stored_leaf(path, a, as_panels, pairs)
    return jax.tree.map(lambda b, x: jax.lax.dynamic_update_index_in_dim(b, x, i, 0), buf, stored)


def init_stacked_cache(cfg: ModelConfig, stacked: dict, num_slots: int, dtype) -> list[dict]:
    """Per group, a KV cache stacked over its layers: [L_group, num_slots, ...] (16-bit floats packed
    as in ``stack_layers``; attention reads it back as the activations' dtype)."""
    sizes = [jax.tree.leaves(g)[0].shape[0] for g in stacked["groups"]]

    def zeros():  # one program for the whole cache (not one per array shape)
        one = init_layer_cache(cfg, num_slots, dtype)
        return [jax.tree.map(lambda a, n=n: pack16(jnp.zeros((n,) + a.shape, a.dtype)), one) for n in sizes]

    return jax.jit(zeros)()


def embed(params: dict, tokens: jnp.ndarray) -> jnp.ndarray:
    return params["embed"][tokens]


def attention_side_ffn(layer: dict, xn: jnp.ndarray) -> jnp.ndarray | None:
    """The part of the FFN that stays with attention: a dense MLP or the shared experts."""
    if "mlp" in layer:
        return swiglu_mlp(layer["mlp"], xn)
    if "shared" in layer:
        return shared_experts(layer["shared"], xn)
    return None


def lm_head(
    params: dict, cfg: ModelConfig, x: jnp.ndarray, invariant: bool = False, in_place: bool = False
) -> jnp.ndarray:
    """Logits (fp32, also for 16-bit weights) of the final-normed x; ``invariant``: by the CPU kernel, a row's logits whatever
    the other rows (``in_place_mode``); ``in_place`` (beside the CPU expert kernel): a 16-bit untied head
    at decode sizes is read in place by the CPU kernel's matmul, widened in registers, summed in fp32
    (XLA:CPU converts the whole matrix to fp32 before its dot, every step: a quarter of a batch-1 step
    of the 3 B model, bench/results/2026-11-28-bf16-kernel.md)."""
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps, invariant)
    w = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    if invariant:
        return cpu_kernel.invariant_matmul(x, w[None], 0).astype(jnp.float32)
    if (
        in_place
        and not cfg.tie_embeddings  # the transposed embedding would be copied
        and w.dtype.itemsize == 2
        and cpu_kernel.matmul_supports(x, w[None])
    ):
        return cpu_kernel.layer_matmul(x.astype(jnp.float32), w[None], 0)
    # the logits summed and kept in fp32: rounded to bf16 they would move a logprob by up to 2^-8 of a logit
    return jnp.matmul(x, w, preferred_element_type=jnp.float32)


ROUTED = ("w_gate", "w_up", "w_down")  # routed expert weights: sliced per layer at their use (experts.py)
IN_PLACE = ("q", "k", "v", "o")  # layer_view(in_place=True): attention projections read in place


def in_place_mode(expert_impl: str) -> bool | str:
    """What ``layer_view`` / ``attention_side`` take as ``in_place`` beside an expert-FFN form: True
    beside ``cpu_kernel`` (the GQA projections at decode sizes and the KV cache read in place by the CPU
    kernels), ``INVARIANT`` beside ``cpu_kernel_invariant`` (deterministic mode: every dense matrix of a
    layer and the LM head by the CPU kernel at every row count, attention by the CPU kernel: each
    token's results are summed in an order that does not depend on the batch or the chunking), else
    False."""
    return {"cpu_kernel": True, "cpu_kernel_invariant": INVARIANT}.get(expert_impl, False)


def invariant_unsupported(cfg: ModelConfig) -> str | None:
    """Why the ``INVARIANT`` mode cannot run this model here (None: it can): it needs GQA attention
    that the CPU attention kernel takes, dense matrices whose K the matmul kernel takes, and both
    kernels available."""
    from jaxmoe.pallas_kernels.paged_attention import cpu_kernel as attention_kernel

    a = cfg.attn
    if a.kind != "gqa":
        return f"{a.kind} attention runs in XLA"
    if a.head_dim % attention_kernel.VECTOR or a.head_dim > attention_kernel.MAX_HEAD_DIM:
        return f"head_dim {a.head_dim} is not one the attention kernel takes"
    ks = [cfg.hidden_size, a.num_heads * a.head_dim, cfg.moe.intermediate_size, cfg.moe.shared_intermediate_size]
    ks.append(cfg.dense_intermediate_size)
    if any(k % cpu_kernel.K_BLOCK for k in ks if k):
        return f"a matrix's rows ({ks}) are not a multiple of {cpu_kernel.K_BLOCK}"
    if cfg.hidden_size % cpu_kernel.VECTOR or cfg.moe.intermediate_size % cpu_kernel.VECTOR:
        return "the expert kernel needs hidden and intermediate sizes that are multiples of 16"
    return cpu_kernel.unavailable_reason() or attention_kernel.unavailable_reason()


def layer_view(group: dict, index, dtype, in_place: bool | str = False) -> dict:
    """Layer ``index`` of a stacked group, except the routed expert weights, which stay stacked (and
    packed: the expert code slices and unpacks them). ``in_place``: the GQA projections become
    ``LayerMatrix`` views, read in place by the CPU kernel where it takes the shapes; ``INVARIANT``:
    every matrix of the layer (projections, router, dense MLP, shared experts) becomes an invariant
    ``LayerMatrix`` (``in_place_mode``)."""

    def take(path, a):
        keys = [getattr(k, "key", None) for k in path]
        if len(keys) >= 2 and keys[0] == "moe" and keys[-1] in ROUTED:
            return a
        if is_quantized(a):  # an int8 / fp8 projection (``jaxmoe.quantization``): this layer's, dequantized
            return a.at(index).dequantize(dtype)
        if in_place == INVARIANT and a.ndim == 3:
            return LayerMatrix(a, index, dtype, invariant=True)
        if in_place and keys[0] == "attn" and keys[-1] in IN_PLACE and a.ndim == 3:
            return LayerMatrix(a, index, dtype)
        return unpack16(jax.lax.dynamic_index_in_dim(a, index, keepdims=False), dtype)

    return jax.tree_util.tree_map_with_path(take, group, is_leaf=lambda a: is_panels(a) or is_quantized(a))


def attention_side(
    layer: dict,
    cfg: ModelConfig,
    x,
    batch: AttentionBatch,
    cache: dict,
    block_size: int,
    index=None,
    in_place: bool = False,
):
    """The attention side of a layer: (residual stream with attention and the attention-side FFN
    added, the normed input of the routed experts, the new cache); ``in_place`` as
    ``attention_layer``'s."""
    h, xn, cache = attention_layer(layer["attn"], cfg, x, batch, cache, block_size, index, in_place=in_place)
    out = attention_side_ffn(layer, xn)
    return (h if out is None else h + out), xn, cache


def layer_step(
    layer: dict,
    cfg: ModelConfig,
    x,
    batch: AttentionBatch,
    cache: dict,
    block_size: int,
    index=None,
    routing: ExpertRouting = TOP_K,
    routing_state=None,
    expert_impl: str = "auto",
    in_place: bool = False,
):
    """One whole layer (attention side, then the routed experts); ``index`` as ``attention_layer``'s
    (and, for the routed expert weights of a ``layer_view``, ``moe_layer``'s); ``routing`` /
    ``routing_state``: the expert routing and its traced state (``moe_layer``; padding tokens, slot
    -1, activate no expert); ``expert_impl``: the expert-FFN implementation (``moe_layer``);
    ``in_place`` as ``attention_layer``'s."""
    x, xn, cache = attention_side(layer, cfg, x, batch, cache, block_size, index, in_place)
    if "moe" in layer:
        valid = (batch.slots >= 0).reshape(-1)
        x = x + moe_layer(layer["moe"], cfg, xn, index, routing, valid, routing_state, expert_impl)
    return x, cache


def forward(
    params: dict,
    cfg: ModelConfig,
    tokens,
    batch: AttentionBatch,
    cache: list,
    block_size: int,
    logits_index=None,
    routing: ExpertRouting = TOP_K,
    routing_state=None,
    expert_impl: str = "auto",
):
    """Monolithic forward over tokens [B, T] with stacked parameters and caches (``stack_layers``,
    ``init_stacked_cache``): one ``lax.scan`` per layer group.

    Returns (logits, cache): logits [B, V] at ``logits_index`` [B] (the last real token of each
    row), or [B, T, V] when ``logits_index`` is None. The MoE layers' parameters are in
    ``routing``'s logical form; ``routing_state`` its traced per-step value (``layer_step``).
    """
    x = embed(params, tokens)
    # with the CPU expert kernel, attention reads its projections and the stacked KV cache in place too
    in_place = in_place_mode(expert_impl)
    new_cache = []
    for group, group_cache in zip(params["groups"], cache):

        def body(carry, index, group=group):
            x, group_cache = carry
            layer = layer_view(group, index, params["embed"].dtype, in_place=in_place)
            return layer_step(
                layer, cfg, x, batch, group_cache, block_size, index, routing, routing_state, expert_impl, in_place
            ), None

        n = jax.tree.leaves(group)[0].shape[0]
        (x, group_cache), _ = jax.lax.scan(body, (x, group_cache), jnp.arange(n))
        new_cache.append(group_cache)
    if logits_index is not None:
        x = jnp.take_along_axis(x, logits_index[:, None, None], axis=1)[:, 0]
    return lm_head(params, cfg, x, invariant=in_place == INVARIANT, in_place=in_place is True), new_cache
