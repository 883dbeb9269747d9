"""``train(config, out_dir)``: corpus -> tokenizer -> optimisation -> exported model, resumable.

The output directory holds everything a run needs to resume and everything it produced::

    train_config.json     the settings (a resumed run must use the same ones, ``steps`` may grow)
    tokenizer.json        the BPE tokenizer (+ tokenizer_config.json), trained once
    tokens/               the encoded train and held-out streams (a cache)
    checkpoints/          Orbax checkpoints of parameters + optimiser state, every ``checkpoint_every`` steps
    model/                the exported model (``export.export_model``)
    report.json           steps, tokens, wall time, final loss, held-out perplexity, per-expert token share

Every check (settings, output directory writable, corpus has text) runs before any training step.
Given the seed the run is deterministic: initial parameters from ``jax.random.key(seed)``, batches
from ``data.batch_at``; a run stopped and resumed ends with the same parameters as one that was not.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm import tqdm

from jaxmoe.train import data
from jaxmoe.train.config import TrainConfig, hf_config, model_config
from jaxmoe.train.corpus import load_corpus
from jaxmoe.train.export import default_generation_config, export_model
from jaxmoe.train.model import init_params, loss_fn
from jaxmoe.train.tokenizer_training import save_tokenizer, special_token_ids, train_tokenizer


def check_writable(out_dir: Path) -> None:
    """Create ``out_dir`` and write a probe file in it, or raise a ``ValueError`` naming it."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".write_probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"output directory {str(out_dir)!r} is not writable: {e.strerror or e}") from None


def _check_same_run(out_dir: Path, tc: TrainConfig) -> None:
    saved = out_dir / "train_config.json"
    if not saved.exists():
        return
    old = TrainConfig.from_json(saved.read_text())
    changed = [
        f.name for f in dataclasses.fields(tc) if f.name != "steps" and getattr(old, f.name) != getattr(tc, f.name)
    ]
    if changed:
        raise ValueError(
            f"{out_dir} holds a run with different settings ({', '.join(changed)}); "
            "resume with the same settings or pick another output directory"
        )


def prepare(tc: TrainConfig, out_dir: Path, log=print):
    """Checks, then the tokenizer and token streams (reused when already in ``out_dir``)."""
    from tokenizers import Tokenizer

    tc.check()
    check_writable(out_dir)
    _check_same_run(out_dir, tc)
    tokens_dir = out_dir / "tokens"
    if (out_dir / "tokenizer.json").exists() and (tokens_dir / "heldout.npy").exists():
        tokenizer = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
        return tokenizer, np.load(tokens_dir / "train.npy"), np.load(tokens_dir / "heldout.npy")
    corpus = load_corpus(tc.corpus, tc.heldout_fraction)
    log(f"corpus {tc.corpus}: {corpus.describe()}")
    tokenizer = train_tokenizer((d.text for d in corpus.train), tc.vocab_size)
    train_stream = data.encode_documents(tokenizer, [d.text for d in corpus.train])
    heldout_stream = data.encode_documents(tokenizer, [d.text for d in corpus.heldout])
    if len(train_stream) < tc.seq_len + 1:
        raise ValueError(
            f"corpus {tc.corpus!r} gives {len(train_stream)} training tokens, fewer than seq_len + 1 = {tc.seq_len + 1}"
        )
    tokens_dir.mkdir(exist_ok=True)
    np.save(tokens_dir / "train.npy", train_stream)
    np.save(tokens_dir / "heldout.npy", heldout_stream)
    save_tokenizer(tokenizer, out_dir, tc.max_position)
    log(
        f"tokenizer: {tokenizer.get_vocab_size()} entries; {len(train_stream):,} train / "
        f"{len(heldout_stream):,} held-out tokens"
    )
    return tokenizer, train_stream, heldout_stream


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, tc.learning_rate, min(tc.warmup_steps, tc.steps - 1), tc.steps, end_value=tc.learning_rate * 0.1
    )
    no_decay_on_vectors = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(tc.grad_clip or float("inf")),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=tc.weight_decay, mask=no_decay_on_vectors),
    )


def make_train_step(cfg, tc: TrainConfig, optimizer):
    def step(params, opt_state, batch):
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, cfg, batch, tc.aux_loss_coef, tc.capacity_factor
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    return jax.jit(step, donate_argnums=(0, 1))


def _checkpoint_manager(out_dir: Path, tc: TrainConfig) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=tc.checkpoint_every)
    return ocp.CheckpointManager((out_dir / "checkpoints").absolute(), options=options)


def train(tc: TrainConfig, out_dir: str | Path, *, progress: bool = True, log=print, stop_after: int | None = None):
    """Train (or resume) in ``out_dir``; export and report when ``tc.steps`` are done.

    ``stop_after``: stop (checkpointed) after that many steps of this call, as an interruption would.
    Returns the report dict (``None`` when stopped early)."""
    out_dir = Path(out_dir)
    tokenizer, train_stream, heldout_stream = prepare(tc, out_dir, log)
    (out_dir / "train_config.json").write_text(tc.to_json())
    special = special_token_ids(tokenizer)
    cfg = model_config(tc, special)
    optimizer = make_optimizer(tc)
    params = init_params(cfg, jax.random.key(tc.seed))
    opt_state = optimizer.init(params)
    start, wall_before = 0, 0.0
    with _checkpoint_manager(out_dir, tc) as manager:
        if manager.latest_step() is not None:
            start = manager.latest_step()
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": opt_state})
            state = manager.restore(start, args=ocp.args.StandardRestore(abstract))
            params, opt_state = state["params"], state["opt_state"]
            wall_before = _read_progress(out_dir).get("wall_s", 0.0)
            log(f"resumed from step {start}")
        step_fn = make_train_step(cfg, tc, optimizer)
        tokens_per_step = tc.batch_size * tc.seq_len
        t0, first_timed = time.perf_counter(), None
        loss = _read_progress(out_dir).get("loss", float("nan"))  # a resumed run that has no step left
        end = tc.steps if stop_after is None else min(tc.steps, start + stop_after)
        with tqdm(total=tc.steps, initial=start, desc="training", disable=not progress, unit="step") as bar:
            for step in range(start, end):
                batch = jnp.asarray(data.batch_at(train_stream, step, tc.seed, tc.batch_size, tc.seq_len))
                params, opt_state, metrics = step_fn(params, opt_state, batch)
                if first_timed is None:  # the first step compiles: time from its end
                    jax.block_until_ready(params)
                    first_timed = (time.perf_counter(), step + 1)
                if (step + 1) % 10 == 0 or step + 1 == end:
                    loss = float(metrics["ce"])
                    elapsed = time.perf_counter() - first_timed[0]
                    rate = (step + 1 - first_timed[1]) * tokens_per_step / elapsed if elapsed > 0 else 0.0
                    extra = (
                        f" aux={float(metrics['aux']):.3f} drop={int(metrics['dropped'])}" if "aux" in metrics else ""
                    )
                    bar.set_postfix_str(f"loss={loss:.3f}{extra} tok/s={rate:,.0f}", refresh=False)
                bar.update(1)
                if manager.should_save(step + 1) or step + 1 == end:
                    state = {"params": params, "opt_state": opt_state}
                    manager.save(step + 1, args=ocp.args.StandardSave(state), force=True)
                    _write_progress(out_dir, step + 1, wall_before + time.perf_counter() - t0, loss)
            manager.wait_until_finished()
    wall = wall_before + time.perf_counter() - t0
    if end < tc.steps:
        return None
    return finish(tc, cfg, params, tokenizer, heldout_stream, out_dir, wall, loss, log)


def finish(tc, cfg, params, tokenizer, heldout_stream, out_dir: Path, wall: float, loss: float, log):
    """Export the model, score the held-out split and write ``report.json``."""
    from jaxmoe.train.evaluate import expert_token_share, perplexity

    hf = None if tc.dense else hf_config(tc, special_token_ids(tokenizer))
    model_dir = export_model(out_dir / "model", params, cfg, hf, out_dir, default_generation_config(hf))
    exported = _load_exported(model_dir)
    windows = data.eval_windows(heldout_stream, tc.seq_len, tc.eval_tokens)
    scored = perplexity(cfg, exported, windows, progress=False)
    report = {
        "model": str(model_dir),
        "dense": tc.dense,
        "steps": tc.steps,
        "train_tokens": tc.steps * tc.batch_size * tc.seq_len,
        "wall_s": round(wall, 1),
        "final_train_loss": loss,
        "heldout": scored,
        "total_params": int(sum(np.size(x) for x in jax.tree.leaves(params))),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, jax {jax.__version__} on {jax.default_backend()}",
        "python": sys.version.split()[0],
    }
    if cfg.num_moe_layers:
        report["expert_share_heldout"] = [
            [round(x, 4) for x in row] for row in expert_token_share(cfg, exported, windows)
        ]
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"held-out perplexity {scored['perplexity']:.3f} over {scored['tokens']} tokens; model in {model_dir}")
    return report


def _load_exported(model_dir: Path) -> dict:
    """Parameters as served (read back from the exported files, so the report scores what ships)."""
    from jaxmoe.checkpoint.model import load_model

    return load_model(model_dir, dtype="float32")[1]


def _write_progress(out_dir: Path, step: int, wall_s: float, loss: float) -> None:
    (out_dir / "progress.json").write_text(json.dumps({"step": step, "wall_s": wall_s, "loss": loss}) + "\n")


def _read_progress(out_dir: Path) -> dict:
    path = out_dir / "progress.json"
    return json.loads(path.read_text()) if path.exists() else {}
