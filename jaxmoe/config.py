"""Model configuration read from a Hugging Face ``config.json``.

Owns :class:`ModelConfig` (and its three small parts: attention, rope, MoE) and the
translation from each supported family's config keys.  Supported families: Mixtral,
Qwen2-MoE, Qwen3-MoE, DeepSeek-V2 and DeepSeek-V3.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

SUPPORTED_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")
_ARCHITECTURES = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one jaxmoe implements."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float
    dim: int  # number of rotated dims per head
    kind: str = "default"  # default | linear | yarn
    factor: float = 1.0
    original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    interleaved: bool = False  # rotate consecutive pairs (DeepSeek) instead of halves


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    kind: str  # "gqa" or "mla"
    num_heads: int
    num_kv_heads: int
    head_dim: int  # GQA head dim; for MLA the query/key head dim (nope + rope)
    qkv_bias: bool = False
    qk_norm: bool = False
    # MLA (DeepSeek) only
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    softmax_scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    scoring: str = "softmax"  # softmax | sigmoid
    topk_method: str = "greedy"  # greedy | group_limited_greedy | noaux_tc
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    score_bias: bool = False  # DeepSeek-V3 e_score_correction_bias (selection only)
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_gate: bool = False  # Qwen2-MoE: shared output scaled by sigmoid(gate(x))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    rms_norm_eps: float
    max_position: int
    tie_embeddings: bool
    attn: AttentionConfig
    rope: RopeConfig
    moe: MoEConfig
    dense_intermediate_size: int
    moe_layers: tuple[bool, ...]  # per layer: MoE (True) or dense MLP (False)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        d = json.loads(text)
        d["attn"] = AttentionConfig(**d["attn"])
        d["rope"] = RopeConfig(**d["rope"])
        d["moe"] = MoEConfig(**d["moe"])
        d["moe_layers"] = tuple(d["moe_layers"])
        d["eos_token_ids"] = tuple(d["eos_token_ids"])
        return cls(**d)


def detect_family(hf: dict[str, Any]) -> str:
    """Family name from ``model_type`` or ``architectures``; a clear error otherwise."""
    family = hf.get("model_type")
    if family in SUPPORTED_FAMILIES:
        return family
    for arch in hf.get("architectures") or []:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    raise UnsupportedModelError(
        f"unsupported model: model_type={family!r}, architectures={hf.get('architectures')!r}; "
        f"jaxmoe supports {', '.join(SUPPORTED_FAMILIES)} "
        f"({', '.join(_ARCHITECTURES)})"
    )


def load_config(path: str | Path) -> ModelConfig:
    """Read ``config.json`` from a checkpoint directory (or the file itself)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"no config.json at {path}")
    with open(path) as f:
        return from_hf_config(json.load(f))


def from_hf_config(hf: dict[str, Any]) -> ModelConfig:
    family = detect_family(hf)
    return _BUILDERS[family](hf)


# ----------------------------------------------------------------------------- helpers


def _eos_ids(hf: dict[str, Any]) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _rope_params(hf: dict[str, Any]) -> dict[str, Any]:
    """Rope settings, whether written as ``rope_theta``/``rope_scaling`` or ``rope_parameters``."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    for k, v in scaling.items():
        params.setdefault(k, v)
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    return params


def _rope(hf: dict[str, Any], dim: int, interleaved: bool = False) -> RopeConfig:
    p = _rope_params(hf)
    kind = p.get("rope_type", p.get("type", "default")) or "default"
    if kind not in ("default", "linear", "yarn"):
        raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported (default, linear, yarn)")
    max_pos = int(hf.get("max_position_embeddings", 0))
    original = int(p.get("original_max_position_embeddings") or max_pos)
    factor = p.get("factor")
    if factor is None:
        factor = max_pos / original if kind == "yarn" and original else 1.0
    return RopeConfig(
        theta=float(p["rope_theta"]),
        dim=dim,
        kind=kind,
        factor=float(factor),
        original_max_position=original,
        beta_fast=float(p.get("beta_fast", 32.0) or 32.0),
        beta_slow=float(p.get("beta_slow", 1.0) or 1.0),
        mscale=float(p.get("mscale", 1.0) or 1.0),
        mscale_all_dim=float(p.get("mscale_all_dim", 0.0) or 0.0),
        attention_factor=p.get("attention_factor"),
        interleaved=interleaved,
    )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _common(hf: dict[str, Any], family: str) -> dict[str, Any]:
    return dict(
        family=family,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position=int(hf.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_ids(hf),
    )


def _gqa(hf: dict[str, Any], qkv_bias: bool, qk_norm: bool) -> AttentionConfig:
    heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // heads)
    return AttentionConfig(
        kind="gqa",
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        softmax_scale=head_dim**-0.5,
    )


def _mixtral(hf: dict[str, Any]) -> ModelConfig:
    attn = _gqa(hf, qkv_bias=False, qk_norm=False)
    n = int(hf["num_hidden_layers"])
    return ModelConfig(
        **_common(hf, "mixtral"),
        attn=attn,
        rope=_rope(hf, attn.head_dim),
        moe=MoEConfig(
            num_experts=int(hf["num_local_experts"]),
            top_k=int(hf["num_experts_per_tok"]),
            intermediate_size=int(hf["intermediate_size"]),
            norm_topk_prob=True,
        ),
        dense_intermediate_size=int(hf["intermediate_size"]),
        moe_layers=(True,) * n,
    )


def _qwen_moe_layers(hf: dict[str, Any], num_experts: int) -> tuple[bool, ...]:
    n = int(hf["num_hidden_layers"])
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    dense = set(hf.get("mlp_only_layers") or [])
    return tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(n))


def _qwen_num_experts(hf: dict[str, Any]) -> int:
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if hf.get(key):
            return int(hf[key])
    raise UnsupportedModelError("config.json has no expert count (num_experts / num_local_experts)")


def _qwen_moe(hf: dict[str, Any], family: str) -> ModelConfig:
    """Qwen2-MoE (q/k/v bias, sigmoid-gated shared expert) and Qwen3-MoE (q/k RMSNorm, no shared)."""
    qwen2 = family == "qwen2_moe"
    attn = _gqa(
        hf,
        qkv_bias=bool(hf.get("qkv_bias", True)) if qwen2 else bool(hf.get("attention_bias", False)),
        qk_norm=not qwen2,
    )
    num_experts = _qwen_num_experts(hf)
    shared = int(hf.get("shared_expert_intermediate_size", 0) or 0) if qwen2 else 0
    return ModelConfig(
        **_common(hf, family),
        attn=attn,
        rope=_rope(hf, attn.head_dim),
        moe=MoEConfig(
            num_experts=num_experts,
            top_k=int(hf["num_experts_per_tok"]),
            intermediate_size=int(hf["moe_intermediate_size"]),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            shared_intermediate_size=shared,
            shared_gate=shared > 0,
        ),
        dense_intermediate_size=int(hf["intermediate_size"]),
        moe_layers=_qwen_moe_layers(hf, num_experts),
    )


def _deepseek(hf: dict[str, Any], family: str) -> ModelConfig:
    nope, rope_dim = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
    rope = _rope(hf, rope_dim, interleaved=bool(hf.get("rope_interleave", True)))
    scale = (nope + rope_dim) ** -0.5
    if rope.kind != "default" and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    heads = int(hf["num_attention_heads"])
    attn = AttentionConfig(
        kind="mla",
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=nope + rope_dim,
        q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=int(hf["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=int(hf["v_head_dim"]),
        qkv_bias=bool(hf.get("attention_bias", False)),
        softmax_scale=scale,
    )
    n = int(hf["num_hidden_layers"])
    n_experts = int(hf.get("n_routed_experts") or 0)
    first_dense = int(hf.get("first_k_dense_replace", 0) or 0)
    freq = int(hf.get("moe_layer_freq", 1) or 1)
    v3 = family == "deepseek_v3"
    topk_method = hf.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    if topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise UnsupportedModelError(f"topk_method {topk_method!r} is not supported")
    moe_inter = int(hf["moe_intermediate_size"])
    return ModelConfig(
        **_common(hf, family),
        attn=attn,
        rope=rope,
        moe=MoEConfig(
            num_experts=n_experts,
            top_k=int(hf["num_experts_per_tok"]),
            intermediate_size=moe_inter,
            scoring=hf.get("scoring_func") or ("sigmoid" if v3 else "softmax"),
            topk_method=topk_method,
            n_group=int(hf.get("n_group") or 1),
            topk_group=int(hf.get("topk_group") or 1),
            norm_topk_prob=v3 and bool(hf.get("norm_topk_prob", True)),  # V2 never normalises
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0) or 1.0),
            score_bias=topk_method == "noaux_tc",
            shared_intermediate_size=moe_inter * int(hf.get("n_shared_experts") or 0),
        ),
        dense_intermediate_size=int(hf["intermediate_size"]),
        moe_layers=tuple(n_experts > 0 and i >= first_dense and i % freq == 0 for i in range(n)),
    )


_BUILDERS = {
    "mixtral": _mixtral,
    "qwen2_moe": lambda hf: _qwen_moe(hf, "qwen2_moe"),
    "qwen3_moe": lambda hf: _qwen_moe(hf, "qwen3_moe"),
    "deepseek_v2": lambda hf: _deepseek(hf, "deepseek_v2"),
    "deepseek_v3": lambda hf: _deepseek(hf, "deepseek_v3"),
}
