"""One prepared check of a GPU (or TPU) machine: correctness of every kernel on the device, and the
numbers the design goals are stated in, written as one JSON file.

    python bench/device_check.py                       # on one H100 / H200: < 8 minutes
    python bench/device_check.py --platform cpu --tiny # the dry run CI runs (tests/ops/)

Sections (each runs under its own try; a failure is recorded and the rest still run):

* ``correctness``: each kernel on this device against its reference: the expert-FFN forms
  (``pallas_kernels.expert_ffn``: every one that runs on this platform), the grouped matmul's Pallas
  kernel (Mosaic GPU / TPU; interpreted on CPU), AEBS (the kernel this platform picks, both
  policies where it has them) and paged attention (the form this platform runs: the C++ kernel on
  CPU, the model's XLA form elsewhere);
* ``copy_bandwidth``: a device copy's GB/s (read + write), the roofline's denominator;
* ``grouped_matmul``: the grouped SwiGLU over all experts' weights at DeepSeek-V2-Lite (64 x 2048
  x 1408) and Mixtral (8 x 4096 x 14336) expert shapes, bf16: GB/s and % of the copy bandwidth
  (goal >= 85 %);
* ``aebs``: one AEBS schedule (DeepSeek-V2 routing: 160 experts, top-6, 12 instances x 16
  slots) at batch 16-512, in microseconds (goal <= 15 us);
* ``decode``: decode tokens/s of a DeepSeek-V2-Lite-shaped model with random bf16 weights on one
  device (the monolithic executor, its ModelRunner step: forward + sampling), per expert-FFN form,
  against the weight-read roofline (bytes a step must read / copy bandwidth);
* ``disaggregated``: the disaggregated executor's host time per layer (the time ``forward`` takes
  to return, dispatch only; goal <= 100 us / layer), on a tiny model over 8 host CPU devices
  (a one-GPU machine has no second device for the other sub-mesh).

``--tiny``: every section at toy sizes (seconds on a CPU). ``--out FILE``: where the JSON goes
(default: stdout only; rewritten after every section, so a run cut short keeps what it measured).
``--sections a,b``: only these, in this order (default: all, in the order of ``SECTIONS``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
import traceback

# In the order they run: copy_bandwidth first (the roofline's denominator), decode (compiles a
# 27-layer model per expert-FFN form) and the host-CPU disaggregated section last.
SECTIONS = ("copy_bandwidth", "grouped_matmul", "aebs", "correctness", "decode", "decode_profile", "disaggregated")
GOALS = {"grouped_matmul_pct_of_copy": 85.0, "aebs_us": 15.0, "disaggregated_host_us_per_layer": 100.0}
V2_LITE = {
    "model_type": "deepseek_v2",
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
}
V2_LITE_TINY = dict(
    V2_LITE,
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--platform", default="gpu", choices=["gpu", "tpu", "cpu"], help="the platform to check")
    p.add_argument("--tiny", action="store_true", help="toy sizes (the CPU dry run)")
    p.add_argument("--out", default=None, help="write the JSON here too")
    p.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated, run in this order (default: {','.join(SECTIONS)})",
    )
    p.add_argument("--budget-s", type=float, default=450.0, help="skip what would start after this many seconds")
    args = p.parse_args(argv)
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:  # the disaggregated section's 8 CPU devices
        os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
    if args.platform == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    backend = {"cuda": "gpu", "rocm": "gpu"}.get(jax.default_backend(), jax.default_backend())
    if backend != args.platform:
        print(f"device_check: error: --platform {args.platform} but JAX's backend is {backend}", file=sys.stderr)
        return 2
    sections = tuple(name.strip() for name in args.sections.split(",") if name.strip())
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown or not sections:
        p.error(f"--sections: unknown {unknown}; choose from {','.join(SECTIONS)}")
    check = Check(args.tiny, args.budget_s, sections)

    def write(report: dict) -> None:  # after every section, so a run cut short still leaves its JSON
        if args.out:
            with open(args.out, "w") as f:
                f.write(json.dumps(report, indent=1) + "\n")

    report = check.run(write)
    print(json.dumps(report, indent=1))
    return 0 if not report["errors"] else 1


class Check:
    def __init__(self, tiny: bool, budget_s: float, sections: tuple[str, ...] = SECTIONS):
        import jax

        self.tiny, self.budget_s, self.sections = tiny, budget_s, sections
        self.t0 = time.monotonic()
        self.platform = {"cuda": "gpu", "rocm": "gpu"}.get(jax.default_backend(), jax.default_backend())
        self.device = jax.devices()[0]
        self.errors: list[dict] = []
        self.copy_gbs = None

    def run(self, after_section=lambda report: None) -> dict:
        sections = {}
        for name in self.sections:
            fn = getattr(self, name)
            if time.monotonic() - self.t0 > self.budget_s:
                sections[name] = {"skipped": f"over the {self.budget_s:.0f} s budget"}
                continue
            t = time.monotonic()
            try:
                sections[name] = fn()
            except Exception as e:  # recorded; the other sections still run
                self.errors.append({"section": name, "error": f"{type(e).__name__}: {e}"[:2000]})
                traceback.print_exc(file=sys.stderr)
                sections[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            if isinstance(sections[name], dict):
                sections[name]["seconds"] = round(time.monotonic() - t, 2)
            after_section(self._report(sections))
        return self._report(sections)

    def _report(self, sections: dict) -> dict:
        return {
            "platform": self.platform,
            "device": getattr(self.device, "device_kind", str(self.device)),
            "tiny": self.tiny,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "elapsed_s": round(time.monotonic() - self.t0, 1),
            "goals": GOALS,
            "sections": sections,
            "errors": self.errors,
        }

    # ------------------------------------------------------------------ correctness

    def correctness(self) -> dict:
        results, seconds = [], {}
        for name, fn in (
            ("expert_ffn", self._expert_ffn_forms),
            ("grouped_matmul_pallas", self._grouped_pallas),
            ("aebs", self._aebs_kernel),
            ("paged_attention", self._paged_attention),
        ):
            t = time.perf_counter()
            try:
                results.extend(fn())
            except Exception as e:
                results.append({"kernel": name, "ok": False, "error": f"{type(e).__name__}: {str(e)[:500]}"})
            seconds[name] = round(time.perf_counter() - t, 2)
        bad = [r for r in results if not r["ok"]]
        if bad:
            self.errors.append({"section": "correctness", "error": f"{len(bad)} kernel checks failed", "failed": bad})
        return {"checks": results, "ok": not bad, "seconds_per_kernel": seconds}

    def _expert_ffn_forms(self) -> list[dict]:
        import jax
        import jax.numpy as jnp
        import numpy as np

        from jaxmoe.pallas_kernels.expert_ffn import IMPLS, Stacked, cpu_kernel, expert_ffn, expert_ffn_reference

        T, D, F, E, K = (16, 128, 256, 8, 2) if self.tiny else (64, 1024, 1408, 64, 6)
        dtype = jnp.float32 if self.platform == "cpu" else jnp.bfloat16
        key = jax.random.split(jax.random.key(0), 5)
        x = jax.random.normal(key[0], (T, D), dtype)
        w = Stacked(
            *(jax.random.normal(k, s, dtype) * s[-2] ** -0.5 for k, s in zip(key[1:4], ((E, D, F),) * 2 + ((E, F, D),)))
        )
        ids = jax.random.randint(key[4], (T, K), -1, E)
        weights = jax.nn.softmax(jax.random.normal(key[4], (T, K)), -1).astype(jnp.float32)
        ref = np.asarray(jax.jit(expert_ffn_reference)(x, ids, weights, w), np.float32)
        out = []
        for impl in IMPLS:
            if impl == "reference" or (impl.startswith("cpu_kernel") and not cpu_kernel.available()):
                continue
            if impl == "pallas" and self.platform == "gpu" and dtype == jnp.float32:
                continue
            t = time.perf_counter()
            got = np.asarray(jax.jit(lambda *a, impl=impl: expert_ffn(*a, impl=impl))(x, ids, weights, w), np.float32)
            out.append(_close(f"expert_ffn[{impl}]", got, ref, dtype) | {"seconds": round(time.perf_counter() - t, 2)})
        return out

    def _grouped_pallas(self) -> list[dict]:
        import jax
        import jax.numpy as jnp
        import numpy as np

        from jaxmoe.pallas_kernels.grouped_matmul import api, reference

        G, D, F, M = (4, 128, 256, 64) if self.tiny else (16, 2048, 1408, 512)
        dtype = jnp.float32 if self.platform == "cpu" else jnp.bfloat16
        key = jax.random.split(jax.random.key(1), 4)
        x = jax.random.normal(key[0], (M, D), dtype)
        ws = [
            jax.random.normal(k, s, dtype) * s[-2] ** -0.5 for k, s in zip(key[1:], ((G, D, F), (G, D, F), (G, F, D)))
        ]
        sizes = jnp.asarray(np.diff(np.linspace(0, M - 8, G + 1).astype(np.int32)), jnp.int32)  # 8 rows in no group
        ref = np.asarray(jax.jit(reference.swiglu_loop)(x, sizes, *ws), np.float32)
        got = jax.jit(lambda *a: api.grouped_swiglu(*a, impl="pallas"))(x, sizes, *ws)
        return [_close("grouped_matmul[pallas]", np.asarray(got, np.float32), ref, dtype)]

    def _aebs_kernel(self) -> list[dict]:
        import numpy as np

        from jaxmoe.pallas_kernels.aebs import aebs_numpy, aebs_plus_numpy, schedule
        from jaxmoe.runtime.replicas import ReplicaLayout, default_placement

        E, N, C, T, K = (16, 4, 6, 8, 2) if self.tiny else (160, 12, 16, 256, 6)
        layout = ReplicaLayout(tuple(default_placement(E, N, C)), E, N, C)
        rt, ri = layout.replica_table(), layout.replica_instance()
        rng = np.random.default_rng(2)
        policies = ("aebs",) if self.platform == "tpu" else ("aebs", "aebs_plus")
        out = []
        for policy in policies:
            ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
            ids[rng.random(ids.shape) < 0.1] = -1
            phys, load = schedule(ids, rt, ri, N, policy=policy, impl="kernel")
            want = (aebs_numpy if policy == "aebs" else aebs_plus_numpy)(ids, rt, ri, N)
            ok = np.array_equal(np.asarray(phys), want[0]) and np.array_equal(np.asarray(load), want[1])
            out.append({"kernel": f"aebs[{policy}, kernel]", "ok": bool(ok)})
        return out

    def _paged_attention(self) -> list[dict]:
        import jax
        import jax.numpy as jnp
        import numpy as np

        from jaxmoe.models.attention import AttentionBatch, gqa_xla
        from jaxmoe.pallas_kernels.paged_attention import cpu_kernel, paged_attention, paged_attention_reference

        B, T, H, KVH, hd, bs, NB = (2, 4, 4, 2, 64, 16, 4) if self.tiny else (8, 16, 32, 8, 128, 16, 64)
        L, S = 2, B * NB * bs
        dtype = jnp.float32 if self.platform == "cpu" else jnp.bfloat16
        key = jax.random.split(jax.random.key(3), 3)
        q = jax.random.normal(key[0], (B, T, H, hd), dtype)
        k = jax.random.normal(key[1], (L, S, KVH, hd), dtype)
        v = jax.random.normal(key[2], (L, S, KVH, hd), dtype)
        tables = jnp.arange(B * NB, dtype=jnp.int32).reshape(B, NB)
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) + NB * bs - T - 3, (B, T))
        kw = dict(block_size=bs, scale=hd**-0.5, dtype=dtype)
        ref = np.asarray(jax.jit(lambda *a: paged_attention_reference(*a, **kw))(q, k, v, 1, tables, positions))
        batch = AttentionBatch(positions, jnp.full((B, T), -1, jnp.int32), tables)
        xla = jax.jit(lambda q, k, v: gqa_xla(q, {"k": k, "v": v}, 1, batch, bs, hd**-0.5, dtype))(q, k, v)
        out = [_close("paged_attention[xla form]", np.asarray(xla), ref, dtype)]
        if cpu_kernel.available():
            got = jax.jit(lambda *a: paged_attention(*a, impl="cpu_kernel", **kw))(q, k, v, 1, tables, positions)
            out.append(_close("paged_attention[cpu_kernel]", np.asarray(got), ref, dtype))
        return out

    # ------------------------------------------------------------------ bandwidth

    def copy_bandwidth(self) -> dict:

        n = (8 << 20) if self.tiny else (1 << 30)  # bytes
        self.copy_gbs = copy_gbs(n, repeats=5 if self.tiny else 20)
        return {"bytes": n, "gbs": round(self.copy_gbs, 1)}

    def grouped_matmul(self) -> dict:
        import jax
        import jax.numpy as jnp

        from jaxmoe.pallas_kernels.grouped_matmul import api

        shapes = (
            {"tiny": (4, 128, 256)}
            if self.tiny
            else {"deepseek_v2_lite": (64, 2048, 1408), "mixtral": (8, 4096, 14336)}
        )
        impls = ("ragged_dot",) if self.platform == "cpu" else ("pallas", "ragged_dot")
        rows = []
        for name, (G, D, F) in shapes.items():
            M = G * 8  # every expert's weights read, few rows each: the decode regime
            key = jax.random.split(jax.random.key(4), 4)
            dt = jnp.bfloat16
            x = jax.random.normal(key[0], (M, D), dt)
            ws = [jax.random.normal(k, s, dt) * 0.02 for k, s in zip(key[1:], ((G, D, F), (G, D, F), (G, F, D)))]
            sizes = jnp.full((G,), 8, jnp.int32)
            weight_bytes = 3 * G * D * F * 2
            for impl in impls:
                f = jax.jit(lambda *a, impl=impl: api.grouped_swiglu(*a, impl=impl))
                seconds = _time(f, x, sizes, *ws, iters=3 if self.tiny else 20)
                gbs = weight_bytes / seconds / 1e9
                pct = 100 * gbs / self.copy_gbs if self.copy_gbs else None
                rows.append(
                    {
                        "shape": name,
                        "experts_d_f": [G, D, F],
                        "impl": impl,
                        "us": round(seconds * 1e6, 1),
                        "gbs": round(gbs, 1),
                        "pct_of_copy": None if pct is None else round(pct, 1),
                        "goal_met": None if pct is None else pct >= GOALS["grouped_matmul_pct_of_copy"],
                    }
                )
                del f
            del x, ws
        return {"rows": rows}

    def aebs(self) -> dict:
        import jax
        import jax.numpy as jnp
        import numpy as np

        from jaxmoe.pallas_kernels.aebs import resolve_impl, schedule
        from jaxmoe.runtime.replicas import ReplicaLayout, default_placement

        E, N, C, K = (16, 4, 6, 2) if self.tiny else (160, 12, 16, 6)
        batches = (16, 64) if self.tiny else (16, 32, 64, 128, 256, 512)
        layout = ReplicaLayout(tuple(default_placement(E, N, C)), E, N, C)
        rt, ri = jnp.asarray(layout.replica_table()), jnp.asarray(layout.replica_instance())
        impl = resolve_impl("auto")
        rng = np.random.default_rng(5)
        rows = []
        for T in batches:
            ids = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32))
            f = jax.jit(lambda a, b, c: schedule(a, b, c, N, impl=impl))
            us = _time(f, ids, rt, ri, iters=5 if self.tiny else 200) * 1e6
            rows.append({"batch": T, "impl": impl, "us": round(us, 2), "goal_met": us <= GOALS["aebs_us"]})
        return {"experts": E, "instances": N, "top_k": K, "rows": rows}

    # ------------------------------------------------------------------ decode

    def decode(self) -> dict:
        import jax

        from jaxmoe.config import from_hf_config

        cfg = from_hf_config(V2_LITE_TINY if self.tiny else V2_LITE)
        impls = ("auto",) if self.platform == "cpu" else ("ragged_dot", "pallas", "dense")
        batches = (1,) if self.tiny else (1, 8, 32)
        rows = []
        for impl in impls:
            if time.monotonic() - self.t0 > self.budget_s:
                rows.append({"impl": impl, "skipped": "over budget"})
                continue
            try:
                rows.extend(self._decode_one(cfg, impl, batches))
            except Exception as e:
                rows.append({"impl": impl, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                self.errors.append({"section": "decode", "error": f"{impl}: {type(e).__name__}: {e}"[:2000]})
            jax.clear_caches()
        params_bytes, _ = _model_bytes(cfg, 1)
        return {
            "model": "DeepSeek-V2-Lite shape" + (" (tiny)" if self.tiny else ""),
            "weight_bytes": params_bytes,
            "rows": rows,
            "copy_gbs": None if self.copy_gbs is None else round(self.copy_gbs, 1),
            "note": "random bfloat16 weights",
        }

    def _decode_one(
        self, cfg, impl: str, batches, steps: int | None = None, trace_dir: str | None = None
    ) -> list[dict]:
        import jax
        import jax.numpy as jnp

        from jaxmoe.engine.buckets import ShapePlan
        from jaxmoe.engine.model_runner import ModelRunner, Row
        from jaxmoe.runtime.monolithic import MonolithicExecutor
        from jaxmoe.sampling import SamplingParams

        block, context = 16, 64
        blocks_per_seq = 8
        num_slots = max(batches) * blocks_per_seq * block
        executor = MonolithicExecutor(cfg, _random_params(cfg, jnp.bfloat16), num_slots, block, expert_impl=impl)
        runner = ModelRunner(
            executor, block, blocks_per_seq, ShapePlan(max_num_seqs=max(batches), max_prefill_chunk=16)
        )
        greedy = SamplingParams(max_tokens=1 << 20)
        out = []
        for B in batches:
            steps = steps or (3 if self.tiny else 20)
            seqs = [
                Row([7], context, list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq)), greedy) for b in range(B)
            ]
            runner.run(seqs)  # compile
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = 0  # the device's ops only: no Python frames, and no tracing overhead
            tracing = jax.profiler.trace(trace_dir, profiler_options=options) if trace_dir else contextlib.nullcontext()
            with tracing:
                t = time.perf_counter()
                for s in range(steps):
                    for r in seqs:
                        r.start = context + 1 + s
                    runner.run(seqs)
                seconds = (time.perf_counter() - t) / steps
            _, step_bytes = _model_bytes(cfg, B)
            roofline = B * self.copy_gbs * 1e9 / step_bytes if self.copy_gbs else None
            tps = B / seconds
            out.append(
                {
                    "impl": executor.expert_impl,
                    "batch": B,
                    "step_ms": round(seconds * 1e3, 3),
                    "tokens_per_s": round(tps, 1),
                    "roofline_tokens_per_s": None if roofline is None else round(roofline, 1),
                    "pct_of_roofline": None if roofline is None else round(100 * tps / roofline, 1),
                }
            )
        del executor, runner
        jax.effects_barrier()
        return out

    # ------------------------------------------------------------------ decode profile

    def decode_profile(self) -> dict:
        """Where a decode step's time goes: a ``jax.profiler`` trace of a few steps (the decode
        section's model and runner, the "pallas" form on a GPU, "auto" on a CPU), summed per
        timeline of the device planes and per op name: the device's busy time per step against
        the step's wall time says whether a step is bound by its kernels or by launches and host work."""
        import glob
        import tempfile

        from jax.profiler import ProfileData

        from jaxmoe.config import from_hf_config

        cfg = from_hf_config(V2_LITE_TINY if self.tiny else V2_LITE)
        impl, steps = ("auto", 3) if self.platform == "cpu" else ("pallas", 10)
        out = {}
        for batch in (1,) if self.tiny else (1, 32):
            trace_dir = tempfile.mkdtemp(prefix="jaxmoe-trace-")
            row = self._decode_one(cfg, impl, (batch,), steps=steps, trace_dir=trace_dir)[0]
            data = ProfileData.from_file(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0])
            device = "/host:CPU" if self.platform == "cpu" else f"/device:{self.platform.upper()}:0"
            lines, ops = {}, {}
            for plane in data.planes:
                if not plane.name.startswith(device):
                    continue
                for line in plane.lines:
                    for event in line.events:
                        lines[line.name] = lines.get(line.name, 0.0) + event.duration_ns
                        if "Stream" in line.name or self.platform == "cpu":  # GPU: the streams' kernels
                            n, t = ops.get(event.name, (0, 0.0))
                            ops[event.name] = (n + 1, t + event.duration_ns)
            top = sorted(ops.items(), key=lambda kv: -kv[1][1])[:15]
            out[f"batch_{batch}"] = {
                "step_ms": row["step_ms"],
                "ms_per_step_per_timeline": {k: round(v / steps / 1e6, 3) for k, v in sorted(lines.items())},
                "ops_per_step": round(sum(n for n, _ in ops.values()) / steps, 1),
                "top_ops": [
                    {"name": k[:120], "per_step": round(n / steps, 1), "ms_per_step": round(t / steps / 1e6, 3)}
                    for k, (n, t) in top
                ],
            }
        return {"impl": impl, "steps_traced": steps, **out}

    # ------------------------------------------------------------------ disaggregated

    def disaggregated(self) -> dict:
        import jax

        from jaxmoe.pallas_kernels.platform import lowering_for

        cpus = jax.devices("cpu")
        if len(cpus) < 8:
            return {"skipped": f"needs 8 host CPU devices, have {len(cpus)}"}
        with lowering_for("cpu"):  # the programs run on host CPU devices, whatever the default backend
            return self._disaggregated_on(cpus)

    def _disaggregated_on(self, cpus) -> dict:
        import pathlib

        import jax
        import jax.numpy as jnp
        import numpy as np

        from jaxmoe.demo import demo_config, demo_params
        from jaxmoe.mesh import build_meshes, load_mesh
        from jaxmoe.models.attention import AttentionBatch
        from jaxmoe.runtime.disaggregated import DisaggregatedExecutor

        spec = load_mesh(pathlib.Path(__file__).resolve().parents[1] / "meshes" / "cpu-8.yaml")
        sub = build_meshes(spec, devices=cpus[:8])
        cfg = demo_config()
        with jax.default_device(cpus[0]):
            params = demo_params(cfg, dtype=jnp.float32)
            ex = DisaggregatedExecutor(cfg, params, 256, 16, sub)
        B, steps = 4, 5 if self.tiny else 50
        tokens = np.ones((B, 1), np.int32)
        tables = np.array(
            [[0, 0, 0, 0], [0, 0, 0, 0], [8, 8, 8, 8], [8, 8, 8, 8]], np.int32
        )  # rows on their instance's blocks
        batch = AttentionBatch(np.full((B, 1), 5, np.int32), np.array([[1], [2], [130], [131]], np.int32), tables)
        index = np.zeros((B,), np.int32)
        jax.block_until_ready(ex.forward(tokens, batch, index))  # compile
        dispatch, total = [], []
        for _ in range(steps):
            t = time.perf_counter()
            logits = ex.forward(tokens, batch, index)
            dispatch.append(time.perf_counter() - t)
            jax.block_until_ready(logits)
            total.append(time.perf_counter() - t)
        per_layer = float(np.median(dispatch)) / cfg.num_layers * 1e6
        return {
            "devices": "8 host CPU devices (meshes/cpu-8.yaml)",
            "layers": cfg.num_layers,
            "host_us_per_layer": round(per_layer, 1),
            "step_us_per_layer": round(float(np.median(total)) / cfg.num_layers * 1e6, 1),
            "goal_met": per_layer <= GOALS["disaggregated_host_us_per_layer"],
        }


# ---------------------------------------------------------------------- helpers


def copy_gbs(nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """The roofline's denominator: GB/s of a device copy (read + write) of an ``nbytes`` bf16 array,
    the fastest of ``repeats`` (after one warm-up call). The other bench scripts' rooflines use it too."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: a + jnp.bfloat16(1))
    jax.block_until_ready(f(x))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(x))
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best / 1e9


def _time(f, *args, iters: int) -> float:
    """Seconds per call of jitted ``f`` (after one warm-up call), ``iters`` calls back to back."""
    import jax

    jax.block_until_ready(f(*args))
    t = time.perf_counter()
    for _ in range(iters):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / iters


def _close(name: str, got, ref, dtype) -> dict:
    import numpy as np

    tol = 2e-3 if np.dtype(dtype) == np.float32 else 5e-2
    scale = float(np.max(np.abs(ref))) or 1.0
    err = float(np.max(np.abs(np.asarray(got, np.float32) - ref))) / scale
    return {"kernel": name, "ok": bool(err <= tol), "max_rel_err": round(err, 6)}


def _random_params(cfg, dtype) -> dict:
    """Random parameters of ``cfg`` drawn on the device (norms 1, matrices N(0, 1/fan_in))."""
    import jax
    import jax.numpy as jnp

    from jaxmoe.checkpoint.hf_names import param_plan
    from jaxmoe.checkpoint.loader import empty_tree, set_leaf

    params, key = empty_tree(cfg), jax.random.key(0)
    for i, leaf in enumerate(param_plan(cfg)):
        shape = leaf.shape[::-1] if leaf.transpose else leaf.shape
        if leaf.stack:
            shape = (len(leaf.sources),) + tuple(shape)
        if len(shape) == 1:
            value = jnp.ones(shape, dtype)
        else:
            value = (jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32) * shape[-2] ** -0.5).astype(
                dtype
            )
        set_leaf(params, leaf.path, value)
    return params


def _model_bytes(cfg, batch: int) -> tuple[int, int]:
    """(bytes of all weights, bytes a decode step of ``batch`` rows must read: every weight but the
    embedding table and the routed experts, plus the expected distinct routed experts per MoE layer)."""
    from jaxmoe.checkpoint.hf_names import param_plan

    total = step = 0
    E, k = cfg.moe.num_experts, cfg.moe.top_k
    distinct = E * (1 - (1 - k / E) ** batch) if E else 0
    for leaf in param_plan(cfg):
        n = 2 * len(leaf.sources) * _prod(leaf.shape)  # bf16
        total += n
        if leaf.path == ("embed",):
            step += 2 * batch * leaf.shape[-1]
        elif leaf.stack:
            step += n * distinct / E
        else:
            step += n
    return total, int(step)


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


if __name__ == "__main__":
    sys.exit(main())
