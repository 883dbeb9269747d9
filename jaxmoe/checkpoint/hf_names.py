"""Which Hugging Face tensors make each of jaxmoe's parameters, with their expected shapes.

``param_plan(cfg)`` lists every leaf of the parameter pytree as a :class:`Leaf`: its path, the
checkpoint tensors it is built from (one, or one per expert to be stacked), their expected shapes,
and whether they are transposed (HF Linear weights are [out, in]; jaxmoe multiplies x @ W [in, out]).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

from jaxmoe.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Leaf:
    path: tuple  # e.g. ("layers", 3, "moe", "w_gate")
    sources: tuple[str, ...]  # one tensor, or one per expert (stacked on a new leading axis)
    shape: tuple[int, ...]  # expected shape of each source tensor
    transpose: bool = False
    stack: bool = False  # sources are per-expert tensors stacked on a new leading axis


def _linear(path, name, out_dim, in_dim, bias=False) -> Iterator[Leaf]:
    yield Leaf(path, (name + ".weight",), (out_dim, in_dim), transpose=True)
    if bias:
        yield Leaf(path[:-1] + (path[-1] + "_bias",), (name + ".bias",), (out_dim,))


def _norm(path, name, dim) -> Leaf:
    return Leaf(path, (name + ".weight",), (dim,))


def _swiglu(path, prefix, d, f, names=("gate_proj", "up_proj", "down_proj")) -> Iterator[Leaf]:
    gate, up, down = names
    yield from _linear(path + ("w_gate",), f"{prefix}.{gate}", f, d)
    yield from _linear(path + ("w_up",), f"{prefix}.{up}", f, d)
    yield from _linear(path + ("w_down",), f"{prefix}.{down}", d, f)


def _attention(cfg: ModelConfig, i: int) -> Iterator[Leaf]:
    a, d, pre = cfg.attn, cfg.hidden_size, f"model.layers.{i}"
    path = ("layers", i, "attn")
    yield _norm(path + ("input_norm",), f"{pre}.input_layernorm", d)
    yield _norm(path + ("post_norm",), f"{pre}.post_attention_layernorm", d)
    s = f"{pre}.self_attn"
    if a.kind == "gqa":
        yield from _linear(path + ("q",), f"{s}.q_proj", a.num_heads * a.head_dim, d, a.qkv_bias)
        yield from _linear(path + ("k",), f"{s}.k_proj", a.num_kv_heads * a.head_dim, d, a.qkv_bias)
        yield from _linear(path + ("v",), f"{s}.v_proj", a.num_kv_heads * a.head_dim, d, a.qkv_bias)
        yield from _linear(path + ("o",), f"{s}.o_proj", d, a.num_heads * a.head_dim)
        if a.qk_norm:
            yield _norm(path + ("q_norm",), f"{s}.q_norm", a.head_dim)
            yield _norm(path + ("k_norm",), f"{s}.k_norm", a.head_dim)
        return
    q_dim = a.num_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim)
    if a.q_lora_rank:
        yield from _linear(path + ("q_a",), f"{s}.q_a_proj", a.q_lora_rank, d, a.qkv_bias)
        yield _norm(path + ("q_a_norm",), f"{s}.q_a_layernorm", a.q_lora_rank)
        yield from _linear(path + ("q_b",), f"{s}.q_b_proj", q_dim, a.q_lora_rank)
    else:
        yield from _linear(path + ("q",), f"{s}.q_proj", q_dim, d)
    yield from _linear(path + ("kv_a",), f"{s}.kv_a_proj_with_mqa", a.kv_lora_rank + a.qk_rope_head_dim, d, a.qkv_bias)
    yield _norm(path + ("kv_a_norm",), f"{s}.kv_a_layernorm", a.kv_lora_rank)
    yield from _linear(
        path + ("kv_b",), f"{s}.kv_b_proj", a.num_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank
    )
    yield from _linear(path + ("o",), f"{s}.o_proj", d, a.num_heads * a.v_head_dim, a.qkv_bias)


def _moe(cfg: ModelConfig, i: int) -> Iterator[Leaf]:
    m, d = cfg.moe, cfg.hidden_size
    path = ("layers", i, "moe")
    if cfg.family == "mixtral":
        mlp, names = f"model.layers.{i}.block_sparse_moe", ("w1", "w3", "w2")
    else:
        mlp, names = f"model.layers.{i}.mlp", ("gate_proj", "up_proj", "down_proj")
    yield Leaf(path + ("router",), (f"{mlp}.gate.weight",), (m.num_experts, d), transpose=True)
    if m.score_bias:
        yield Leaf(path + ("score_bias",), (f"{mlp}.gate.e_score_correction_bias",), (m.num_experts,))
    f = m.intermediate_size
    for key, name, shape in zip(("w_gate", "w_up", "w_down"), names, ((f, d), (f, d), (d, f))):
        sources = tuple(f"{mlp}.experts.{e}.{name}.weight" for e in range(m.num_experts))
        yield Leaf(path + (key,), sources, shape, transpose=True, stack=True)
    if m.shared_intermediate_size:
        shared_path = ("layers", i, "shared")
        prefix = f"{mlp}.shared_expert" if cfg.family == "qwen2_moe" else f"{mlp}.shared_experts"
        yield from _swiglu(shared_path, prefix, d, m.shared_intermediate_size)
        if m.shared_gate:
            yield Leaf(shared_path + ("shared_gate",), (f"{mlp}.shared_expert_gate.weight",), (1, d), True)


def param_plan(cfg: ModelConfig) -> list[Leaf]:
    d, v = cfg.hidden_size, cfg.vocab_size
    leaves = [
        Leaf(("embed",), ("model.embed_tokens.weight",), (v, d)),
        _norm(("final_norm",), "model.norm", d),
    ]
    if not cfg.tie_embeddings:
        leaves.append(Leaf(("lm_head",), ("lm_head.weight",), (v, d), transpose=True))
    for i in range(cfg.num_layers):
        leaves.extend(_attention(cfg, i))
        if cfg.moe_layers[i]:
            leaves.extend(_moe(cfg, i))
        else:
            leaves.extend(_swiglu(("layers", i, "mlp"), f"model.layers.{i}.mlp", d, cfg.dense_intermediate_size))
    return leaves
