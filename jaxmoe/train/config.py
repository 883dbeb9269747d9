"""What a training run is: :class:`TrainConfig` (model shape, optimisation, data), its presets, its
checks, and the ``ModelConfig`` it trains.

The model is a Mixtral: GQA attention with RoPE, RMSNorm, and per layer ``num_experts`` SwiGLU
experts of width ``expert_size`` of which ``top_k`` run per token.  ``dense=True`` trains the
baseline with the same *active* parameters: one SwiGLU MLP of width ``top_k * expert_size`` per layer.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxmoe.config import ModelConfig, from_hf_config


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    # model
    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 5
    num_heads: int = 8
    num_kv_heads: int = 4
    num_experts: int = 8
    top_k: int = 2
    expert_size: int = 256
    dense: bool = False
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    max_position: int = 2048
    # optimisation
    steps: int = 1800
    batch_size: int = 16
    seq_len: int = 256
    learning_rate: float = 2e-3
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    aux_loss_coef: float = 0.01  # router load balancing (Switch Transformer / Mixtral)
    capacity_factor: float = 1.25  # expert capacity per step: factor x an even share; 0 = no limit (slower)
    # data and bookkeeping
    corpus: str = "stdlib"
    heldout_fraction: float = 0.05
    seed: int = 0
    checkpoint_every: int = 250
    eval_tokens: int = 32768  # held-out tokens scored at the end (0: all of them)

    def check(self) -> None:
        """A clear ``ValueError`` naming the field for every inconsistent setting."""
        positive = [
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "num_experts",
            "top_k",
            "expert_size",
            "steps",
            "batch_size",
            "seq_len",
            "checkpoint_every",
            "max_position",
        ]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} is larger than num_experts={self.num_experts}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"head dim {self.hidden_size // self.num_heads} must be even (RoPE rotates pairs)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.seq_len > self.max_position:
            raise ValueError(f"seq_len={self.seq_len} exceeds max_position={self.max_position}")
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must lie in (0, 1), got {self.heldout_fraction}")
        for name in ("learning_rate", "aux_loss_coef", "capacity_factor", "weight_decay", "grad_clip", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "TrainConfig":
        data = json.loads(text)
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown training setting(s): {', '.join(sorted(unknown))}")
        return cls(**data)


PRESETS = {
    "demo": TrainConfig(),  # the shipped model (docs/demo_model.md has the command)
    "tiny": TrainConfig(
        vocab_size=320,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        expert_size=32,
        steps=30,
        batch_size=8,
        seq_len=32,
        learning_rate=3e-3,
        warmup_steps=5,
        checkpoint_every=10,
        eval_tokens=2048,
    ),
}


def hf_config(tc: TrainConfig, special_ids: dict[str, int] | None = None) -> dict:
    """The Hugging Face Mixtral ``config.json`` of the trained model (MoE only)."""
    special_ids = special_ids or {}
    eot, end = special_ids.get("<|endoftext|>"), special_ids.get("<|end|>")
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": tc.vocab_size,
        "hidden_size": tc.hidden_size,
        "intermediate_size": tc.expert_size,
        "num_hidden_layers": tc.num_layers,
        "num_attention_heads": tc.num_heads,
        "num_key_value_heads": tc.num_kv_heads,
        "head_dim": tc.hidden_size // tc.num_heads,
        "num_local_experts": tc.num_experts,
        "num_experts_per_tok": tc.top_k,
        "max_position_embeddings": tc.max_position,
        "rms_norm_eps": 1e-5,
        "rope_theta": tc.rope_theta,
        "hidden_act": "silu",
        "sliding_window": None,
        "attention_dropout": 0.0,
        "router_aux_loss_coef": tc.aux_loss_coef,
        "output_router_logits": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": tc.tie_embeddings,
        "bos_token_id": eot,
        "eos_token_id": [i for i in (eot, end) if i is not None] or None,
        "use_cache": True,
    }


def model_config(tc: TrainConfig, special_ids: dict[str, int] | None = None) -> ModelConfig:
    cfg = from_hf_config(hf_config(tc, special_ids))
    if tc.dense:
        cfg = dataclasses.replace(
            cfg, moe_layers=(False,) * tc.num_layers, dense_intermediate_size=tc.top_k * tc.expert_size
        )
    return cfg


def load_train_config(path: str | Path) -> TrainConfig:
    return TrainConfig.from_json(Path(path).read_text())
