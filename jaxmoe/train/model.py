"""The training forward pass and loss, on jaxmoe's own parameter tree and building blocks.

Parameters have exactly the layout a checkpoint load produces (``checkpoint.hf_names.param_plan``),
so the trained tree is served as is.  The layer reuses the serving code's functions: ``rms_norm``,
``swiglu_mlp``, RoPE (``rope_cos_sin`` / ``apply_rope``), the router (``route``) and the LM head.  What
differs is only what training needs:

* attention over whole sequences (``jax.nn.dot_product_attention``, causal) instead of a paged KV cache;
* routed experts through a fixed-capacity dispatch buffer (Switch Transformer): each expert takes at
  most ``capacity_factor x`` its even share of a step's assignments, the rest are dropped for that
  step (counted in ``dropped``).  ``capacity_factor=0`` drops nothing, and then the forward equals
  the serving forward (``tests/train/test_train.py`` checks the logits).

The router's load-balancing loss is Switch Transformer's: ``E * sum_e f_e * P_e`` with ``f_e`` the
fraction of top-k assignments that go to expert e and ``P_e`` its mean router probability (1.0 when
the load is even).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from jaxmoe.checkpoint.hf_names import param_plan
from jaxmoe.checkpoint.loader import empty_tree, set_leaf
from jaxmoe.config import ModelConfig
from jaxmoe.models.common import rms_norm, swiglu_mlp
from jaxmoe.models.experts import moe_layer
from jaxmoe.models.rope import apply_rope, rope_cos_sin
from jaxmoe.models.router import route
from jaxmoe.models.routing import ExpertRouting
from jaxmoe.models.transformer import lm_head

INIT_STD = 0.02
_OUTPUT_PROJECTIONS = ("o", "w_down")  # scaled down by sqrt(2 * layers) at init (GPT-2)


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
    """Normal(0, 0.02) matrices (output projections scaled by 1/sqrt(2L)), unit norms, zero router."""
    params = empty_tree(cfg)
    plan = param_plan(cfg)
    for leaf, leaf_key in zip(plan, jax.random.split(key, len(plan))):
        shape = leaf.shape[::-1] if leaf.transpose else leaf.shape
        if leaf.stack:
            shape = (len(leaf.sources),) + shape
        name = leaf.path[-1]
        if len(shape) == 1:
            value = jnp.ones(shape, jnp.float32)
        else:
            std = INIT_STD / math.sqrt(2 * cfg.num_layers) if name in _OUTPUT_PROJECTIONS else INIT_STD
            value = std * jax.random.normal(leaf_key, shape, jnp.float32)
        set_leaf(params, leaf.path, value)
    return params


def causal_attention(p: dict, cfg: ModelConfig, x: jnp.ndarray, positions: jnp.ndarray) -> jnp.ndarray:
    """GQA self-attention over whole sequences x [B, T, D] (no KV cache)."""
    a = cfg.attn
    B, T, _ = x.shape
    q = (x @ p["q"]).reshape(B, T, a.num_heads, a.head_dim)
    k = (x @ p["k"]).reshape(B, T, a.num_kv_heads, a.head_dim)
    v = (x @ p["v"]).reshape(B, T, a.num_kv_heads, a.head_dim)
    cos, sin = rope_cos_sin(cfg.rope, cfg.max_position, positions)
    q = apply_rope(q, cos, sin, cfg.rope.interleaved)
    k = apply_rope(k, cos, sin, cfg.rope.interleaved)
    out = jax.nn.dot_product_attention(q, k, v, scale=a.softmax_scale, is_causal=True)
    return out.reshape(B, T, a.num_heads * a.head_dim) @ p["o"]


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Rows of each expert's dispatch buffer: ``capacity_factor`` x the even share, at most all tokens."""
    if capacity_factor <= 0:
        return num_tokens
    return min(num_tokens, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def moe_ffn(p: dict, cfg: ModelConfig, x: jnp.ndarray, capacity_factor: float) -> tuple[jnp.ndarray, dict]:
    """Routed experts for x [T, D]: (output [T, D], stats) with stats ``aux`` (load-balancing loss),
    ``counts`` [E] (assignments per expert) and ``dropped`` (assignments over capacity)."""
    moe = cfg.moe
    T, D = x.shape
    E, K = moe.num_experts, moe.top_k
    ids, weights = route(p, moe, x)  # [T, K] each
    expert = ids.reshape(-1)  # assignment a = (token a // K, choice a % K)
    one_hot = jax.nn.one_hot(expert, E, dtype=jnp.int32)
    rank = jnp.take_along_axis(jnp.cumsum(one_hot, axis=0), expert[:, None], axis=1)[:, 0] - 1
    C = expert_capacity(T, K, E, capacity_factor)
    kept = rank < C
    slot = jnp.where(kept, expert * C + rank, E * C)  # E * C: out of range, dropped
    token = jnp.repeat(jnp.arange(T, dtype=jnp.int32), K)
    source = jnp.full((E * C,), T, jnp.int32).at[slot].set(token, mode="drop")
    xg = jnp.take(x, source, axis=0, mode="fill", fill_value=0).reshape(E, C, D)
    h = jax.nn.silu(jnp.einsum("ecd,edf->ecf", xg, p["w_gate"])) * jnp.einsum("ecd,edf->ecf", xg, p["w_up"])
    y = jnp.einsum("ecf,efd->ecd", h, p["w_down"]).reshape(E * C, D)
    yk = jnp.take(y, slot, axis=0, mode="fill", fill_value=0).reshape(T, K, D)
    out = jnp.einsum("tkd,tk->td", yk.astype(jnp.float32), weights).astype(x.dtype)

    counts = one_hot.sum(axis=0)
    probs = jax.nn.softmax((x @ p["router"]).astype(jnp.float32), axis=-1)
    aux = E * jnp.sum(counts / (T * K) * probs.mean(axis=0))
    return out, {"aux": aux, "counts": counts, "dropped": jnp.sum(~kept)}


def forward(
    params: dict,
    cfg: ModelConfig,
    tokens: jnp.ndarray,
    capacity_factor: float = 0.0,
    routing: ExpertRouting | None = None,
    routing_state=None,
):
    """Logits [B, T, V] (fp32) for tokens [B, T], and per-MoE-layer router stats (stacked).
    ``routing`` (evaluation only, e.g. brownout; the layers hold what it needs): the MoE layers run the
    serving code's ``moe_layer`` with that expert routing and its state (no router stats then)."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    x = params["embed"][tokens]
    stats = []
    for layer in params["layers"]:
        attn = layer["attn"]
        h = x + causal_attention(attn, cfg, rms_norm(x, attn["input_norm"], cfg.rms_norm_eps), positions)
        xn = rms_norm(h, attn["post_norm"], cfg.rms_norm_eps)
        if "mlp" in layer:
            x = h + swiglu_mlp(layer["mlp"], xn)
        elif routing is not None:
            moe = routing.logical_params(layer["moe"])
            x = h + moe_layer(moe, cfg, xn, None, routing, None, routing_state)
        else:
            y, layer_stats = moe_ffn(layer["moe"], cfg, xn.reshape(B * T, -1), capacity_factor)
            x = h + y.reshape(B, T, -1)
            stats.append(layer_stats)
    stacked = jax.tree.map(lambda *s: jnp.stack(s), *stats) if stats else {}
    return lm_head(params, cfg, x), stacked


def loss_fn(params: dict, cfg: ModelConfig, batch: jnp.ndarray, aux_loss_coef: float, capacity_factor: float):
    """Next-token cross-entropy on batch [B, T + 1] plus ``aux_loss_coef`` x the mean load-balancing loss.
    Returns (loss, metrics)."""
    logits, stats = forward(params, cfg, batch[:, :-1], capacity_factor)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
    metrics = {"ce": ce}
    loss = ce
    if stats:
        aux = stats["aux"].mean()
        loss = loss + aux_loss_coef * aux
        metrics.update(aux=aux, counts=stats["counts"], dropped=stats["dropped"].sum())
    return loss, metrics


def moe_inputs(params: dict, cfg: ModelConfig, tokens: jnp.ndarray) -> dict[int, jnp.ndarray]:
    """Per MoE layer, its input hidden states (post-attention norm) [B * T, D] for tokens [B, T]
    (no capacity limit: the serving forward's). United-expert distillation trains on these."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    x = params["embed"][tokens]
    out = {}
    for i, layer in enumerate(params["layers"]):
        attn = layer["attn"]
        h = x + causal_attention(attn, cfg, rms_norm(x, attn["input_norm"], cfg.rms_norm_eps), positions)
        xn = rms_norm(h, attn["post_norm"], cfg.rms_norm_eps)
        if "mlp" in layer:
            x = h + swiglu_mlp(layer["mlp"], xn)
        else:
            out[i] = xn.reshape(B * T, -1)
            y, _ = moe_ffn(layer["moe"], cfg, xn.reshape(B * T, -1), 0.0)
            x = h + y.reshape(B, T, -1)
    return out
