"""Tiny random Hugging Face MoE checkpoints for oracle tests.

``make_checkpoint(family, out_dir, variant=...)`` writes a complete HF model directory, the way
``transformers`` 5.x ``save_pretrained`` writes it (per-expert tensor names on disk, ``config.json``,
``generation_config.json``), plus a tiny character-level BPE tokenizer (``tokenizer.json`` and
``tokenizer_config.json``) whose vocabulary is exactly the model's ``vocab_size``.

Every parameter is re-drawn from a seeded normal after construction (norm weights ~ 1 + 0.1 N(0, 1),
biases ~ 0.1 N(0, 1), matrices ~ N(0, 1/fan_in), routers ~ N(0, 4/fan_in), DeepSeek-V3
``e_score_correction_bias`` ~ 0.1 N(0, 1)), so routing has clear top-k margins and logits are
non-degenerate. ``hf_model(path)`` loads the reference model (fp32, eval, eager attention and experts).

Variants whose name starts with ``hub_config`` are rewritten on disk to the layout of the real Hub
checkpoints (top-level ``rope_theta`` / ``rope_scaling`` instead of v5's ``rope_parameters``; Qwen3-MoE
``num_experts`` instead of v5's ``num_local_experts``); weights are identical to the ``default`` variant.

Run ``python tests/tiny_checkpoints.py`` to build every variant, reload it and greedily generate.
"""

from __future__ import annotations

import functools
import json
import math
import pathlib

import torch

_COMMON = dict(
    vocab_size=256,
    max_position_embeddings=256,
    num_hidden_layers=3,
    num_attention_heads=4,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)
_MLA = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=24,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=12,
    first_k_dense_replace=1,
)
# DeepSeek-V2-Lite's yarn ({"factor": 40, "original_max_position_embeddings": 4096, ...}) scaled down so that
# positions < 64 already sit in the interpolated range of the 16-dim rope.
_YARN_V2 = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=64,
    beta_fast=32,
    beta_slow=1,
    mscale=0.707,
    mscale_all_dim=0.707,
)
# mscale != mscale_all_dim so the cos/sin "attention_factor" is != 1 too (real V3 uses 1.0 / 1.0).
_YARN_V3 = dict(_YARN_V2, mscale=1.0, mscale_all_dim=0.8)
_ROPE = lambda theta: dict(rope_type="default", rope_theta=theta)  # noqa: E731

_MIXTRAL = dict(
    num_hidden_layers=2,
    hidden_size=32,
    intermediate_size=48,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    rope_parameters=_ROPE(1e6),
)
_QWEN2 = dict(
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=40,
    num_key_value_heads=2,
    num_experts=8,
    num_experts_per_tok=4,
    qkv_bias=True,
    norm_topk_prob=False,
    decoder_sparse_step=1,
    mlp_only_layers=[0],
    rope_parameters=_ROPE(1e6),
)
_QWEN3 = dict(
    hidden_size=48,
    head_dim=16,
    intermediate_size=64,
    moe_intermediate_size=24,
    num_key_value_heads=2,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    rope_parameters=_ROPE(1e6),
    _chat=True,
)
_DSV2 = dict(
    _MLA,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_shared_experts=2,
    q_lora_rank=None,
    topk_method="greedy",
    routed_scaling_factor=1.0,
    rope_parameters=_YARN_V2,
    _bos=True,
)
_DSV3 = dict(
    _MLA,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_shared_experts=1,
    q_lora_rank=48,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    rope_interleave=True,
    rope_parameters=_ROPE(10000.0),
    _bos=True,
)

# family -> variant -> config kwargs ("_"-prefixed keys are options of this factory, not config fields).
_SPECS: dict[str, dict[str, dict]] = {
    "mixtral": {"default": dict(_MIXTRAL, _bos=True)},
    "qwen2_moe": {
        "default": _QWEN2,  # layer 0 dense (mlp_only_layers), 1-2 MoE
        "norm_topk": dict(_QWEN2, norm_topk_prob=True),
        "sparse_step2": dict(_QWEN2, num_hidden_layers=4, mlp_only_layers=[], decoder_sparse_step=2),  # MoE: 1, 3
    },
    "qwen3_moe": {
        "default": _QWEN3,  # config.json says "num_local_experts" (v5)
        "no_norm_topk": dict(_QWEN3, norm_topk_prob=False),
        "mlp_only": dict(_QWEN3, mlp_only_layers=[1]),
        "hub_config": dict(_QWEN3, _hub=True),  # "num_experts" + top-level "rope_theta"
    },
    "deepseek_v2": {
        "default": _DSV2,  # V2-Lite-like: no q_lora, greedy, yarn
        "no_yarn": dict(_DSV2, rope_parameters=_ROPE(10000.0)),
        "q_lora_group": dict(
            _DSV2,
            q_lora_rank=48,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=4.0,
        ),
        "hub_config": dict(_DSV2, _hub=True),  # "rope_theta" + "rope_scaling": {"type": "yarn"}
    },
    "deepseek_v3": {
        "default": _DSV3,
        "no_norm_topk": dict(_DSV3, norm_topk_prob=False),
        "no_interleave": dict(_DSV3, rope_interleave=False, q_lora_rank=None),
        "yarn": dict(_DSV3, rope_parameters=_YARN_V3),
    },
}
VARIANTS: dict[str, list[str]] = {family: list(v) for family, v in _SPECS.items()}

_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = """The quick brown fox jumps over the lazy dog. A mixture of experts routes every token to a few
experts chosen by a router; the shared expert sees all tokens. Serving large language models needs paged
attention, continuous batching, and careful sharding of the weights across devices. Hello, world! 0123456789
What is the capital of France? Paris is the capital of France. def main(): return [x * 2 for x in range(10)]
"""


@functools.lru_cache(maxsize=None)
def _tokenizer(vocab_size: int, bos: bool):
    """Char-level BPE trained on a fixed corpus; ids 0-5 are the specials, vocab padded to ``vocab_size``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_next")
    tok.decoder = decoders.Fuse()
    alphabet = [chr(i) for i in range(32, 127)] + ["\n"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIALS,
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        min_frequency=1,
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer)
    extra = vocab_size - tok.get_vocab_size()
    assert extra >= 0, tok.get_vocab_size()
    tok.add_special_tokens([f"<extra_{i}>" for i in range(extra)])
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
        )
    assert tok.get_vocab_size() == vocab_size and tok.token_to_id("<s>") == 1
    return tok.to_str()


def _randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            z = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):  # all RMSNorms, incl. q/k norms and MLA latent norms
                p.copy_(1.0 + 0.1 * z)
            elif name.endswith(".bias"):
                p.copy_(0.1 * z)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(z)
            else:  # [out, in] linears and [E, out, in] fused experts
                scale = 2.0 if name.endswith("mlp.gate.weight") else 1.0  # routers: wider logit spread
                p.copy_(z * scale / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def _to_hub_layout(config_path: pathlib.Path) -> None:
    """Rewrite a v5 config.json like the real Hub configs: rope_theta/rope_scaling, Qwen3 num_experts."""
    cfg = json.loads(config_path.read_text())
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    rope_type = rope.pop("rope_type")
    cfg["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **rope}
    if cfg["model_type"] == "qwen3_moe":
        cfg["num_experts"] = cfg.pop("num_local_experts")
    config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def make_checkpoint(
    family: str, out_dir, *, variant: str = "default", dtype="float32", seed: int = 0, sharded: bool = False
) -> pathlib.Path:
    """Write a tiny random ``family``/``variant`` checkpoint (+ tokenizer) into ``out_dir`` and return it."""
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    spec = dict(_COMMON, **_SPECS[family][variant])
    hub, chat, bos = spec.pop("_hub", False), spec.pop("_chat", False), spec.pop("_bos", False)
    spec["rope_parameters"] = dict(spec["rope_parameters"])  # configs mutate it
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(seed)
    config = AutoConfig.for_model(family, **spec)
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    _randomize(model, seed)
    for name, buf in model.named_buffers():  # as transformers' _keep_in_fp32_modules_strict (DeepSeek-V3)
        if name.endswith("e_score_correction_bias"):
            buf.data = buf.data.float()
    model.eval()
    max_shard = "50GB"
    if sharded:  # aim for ~4 shards
        max_shard = sum(t.numel() * t.element_size() for t in model.state_dict().values()) // 4
    model.save_pretrained(out, max_shard_size=max_shard)
    if hub:
        _to_hub_layout(out / "config.json")

    from tokenizers import Tokenizer

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer(spec["vocab_size"], bos)),
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=_CHAT_TEMPLATE if chat else None,
    )
    tok.save_pretrained(out)
    return out


def hf_model(path):
    """The transformers reference model for a checkpoint: fp32, eval mode, eager attention and experts."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    return model.eval()


def _router_margin(router, logits: torch.Tensor) -> float:
    """Smallest gap (over tokens) at the group and expert top-k boundaries of one router call.

    Gaps are in the space the comparison is made in, made scale-free: log-probabilities for softmax
    routers (equal to logit gaps), biased sigmoid scores for DeepSeek-V3.
    """
    k, margins = router.top_k, []
    if hasattr(router, "e_score_correction_bias"):  # DeepSeek-V3
        s = logits.sigmoid() + router.e_score_correction_bias
        groups = s.view(s.shape[0], router.num_group, -1).topk(2, dim=-1)[0].sum(-1)
    elif getattr(router, "topk_method", "greedy") == "group_limited_greedy":
        s = logits.log_softmax(-1)
        groups = s.view(s.shape[0], router.num_group, -1).max(-1).values
    else:
        s, groups = logits.log_softmax(-1), None
    if groups is not None:
        g, gi = groups.sort(-1, descending=True)
        margins.append(g[:, router.topk_group - 1] - g[:, router.topk_group])
        keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, gi[:, : router.topk_group], True)
        s = s.masked_fill(~keep.repeat_interleave(s.shape[1] // router.num_group, dim=1), float("-inf"))
    v = s.sort(-1, descending=True).values
    margins.append(v[:, k - 1] - v[:, k])
    return min(m.min().item() for m in margins)


if __name__ == "__main__":
    import tempfile
    import time

    from transformers import AutoTokenizer

    ids = torch.randint(6, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as tmp:
        t_all, ref_logits = 0.0, {}
        for family, variants in VARIANTS.items():
            for variant in variants:
                t0 = time.perf_counter()
                path = make_checkpoint(family, f"{tmp}/{family}-{variant}", variant=variant)
                t_make = time.perf_counter() - t0
                t_all += t_make
                model = hf_model(path)
                out = model.generate(
                    ids,
                    max_new_tokens=32,
                    min_new_tokens=32,
                    do_sample=False,
                    output_scores=True,
                    return_dict_in_generate=True,
                )
                gaps = [s.topk(2).values.diff().abs().min().item() for s in out.scores]
                margins = []
                routers = [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]
                hooks = [
                    r.register_forward_hook(lambda m, a, o: margins.append(_router_margin(m, o[0]))) for r in routers
                ]
                with torch.no_grad():
                    logits = model(out.sequences).logits
                for h in hooks:
                    h.remove()
                ref_logits[(family, variant)] = logits
                same = ""
                if variant.startswith("hub_config"):
                    same = f" same-as-default={torch.equal(logits, ref_logits[(family, 'default')])}"
                tok = AutoTokenizer.from_pretrained(path)
                text = tok.decode(out.sequences[0, 24:])
                print(
                    f"{family:12s} {variant:13s} make {t_make:5.2f}s  new={out.sequences.shape[1] - 24} "
                    f"min_logit_gap={min(gaps):.3g} min_route_margin={min(margins):.3g}{same} {text[:30]!r}"
                )
        print(f"total creation time {t_all:.2f}s")
