"""Load speed: Hugging Face safetensors + conversion vs Orbax restore of the converted parameters.

On the Mixtral-style ~114M-parameter fp32 checkpoint of ``bench/decode_throughput.py`` (imported, same
generator and config), times in one process:

1. convert: ``jaxmoe.checkpoint.loader.load_params(path, cfg, dtype="float32", place=...)`` -- what
   ``LLM(path)`` does (name mapping, expert stacking, transposes, placement), ending when every array
   is ready on its devices;
2. save: ``orbax_io.save_converted(dir, params, cfg)`` once (the one-time cost of converting);
3. restore: ``orbax_io.restore_converted(dir, target)`` -- what ``LLM(converted_dir)`` does.

Two layouts, both from the same saved checkpoint: "1 device" (everything on device 0, the default of
``load_params`` and ``restore_converted``) and "8 devices" (``--xla_force_host_platform_device_count=8``,
a 1-D mesh: routed-expert weights sharded over their expert axis, embeddings / LM head over the
vocabulary, the rest replicated; conversion places each leaf with ``jax.device_put(host, sharding)``,
restore passes a ``jax.ShapeDtypeStruct`` target with those shardings).  Convert and restore runs
alternate ``--repeats`` times per layout (the checkpoint files are in the page cache after the first
read, for both sides alike); medians are reported with the ratio convert / restore.  Unless
``--no-zstd``, the same tree is also saved once with Orbax's defaults (``StandardCheckpointer``: OCDBT +
zstd, what ``save_converted`` did before) and that copy's restore is timed in the same loop.

Run (from the repository root):
  .venv/bin/python bench/load_speed.py --ckpt-dir /tmp/moe100m     # reuse decode_throughput's checkpoint
  .venv/bin/python bench/load_speed.py --repeats 5 --out /tmp/load.md
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from decode_throughput import cpu_model, loadavg, make_checkpoint  # noqa: E402


def _dir_bytes(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def layouts(num_devices: int):
    """name -> (place(path, host) -> jax.Array, sharding_for(path, shape) -> Sharding)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

    one = SingleDeviceSharding(jax.devices()[0])
    out = {"1 device": lambda path, ndim: one}
    if num_devices > 1:
        mesh = Mesh(np.array(jax.devices()[:num_devices]), ("x",))

        def sharded(path, ndim):
            name = path[-1]
            if name in ("w_gate", "w_up", "w_down"):  # [E, ...]: experts over devices
                return NamedSharding(mesh, P("x"))
            if name == "embed":  # [V, D]
                return NamedSharding(mesh, P("x", None))
            if name == "lm_head":  # [D, V]
                return NamedSharding(mesh, P(None, "x"))
            return NamedSharding(mesh, P())

        out[f"{num_devices} devices"] = sharded
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt-dir", default=None, help="create / reuse the HF checkpoint here (default: temp dir)")
    p.add_argument("--work-dir", default=None, help="where the Orbax checkpoint is written (default: temp dir)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument(
        "--no-zstd",
        action="store_true",
        help="skip the extra restore of a zstd-compressed save (Orbax's default codec)",
    )
    p.add_argument("--out", default=None, help="also write the markdown table here")
    a = p.parse_args(argv)

    import jax
    import numpy as np

    from jaxmoe.checkpoint import orbax_io
    from jaxmoe.checkpoint.loader import load_params
    from jaxmoe.config import load_config

    tmps = []

    def tmpdir(prefix):
        tmps.append(tempfile.TemporaryDirectory(prefix=prefix))
        return pathlib.Path(tmps[-1].name)

    load_before = loadavg()
    ckpt = pathlib.Path(a.ckpt_dir) if a.ckpt_dir else tmpdir("jaxmoe-load-hf-")
    n_params = make_checkpoint(ckpt)
    cfg = load_config(ckpt)
    work = pathlib.Path(a.work_dir) if a.work_dir else tmpdir("jaxmoe-load-orbax-")
    converted = work / "converted"
    shutil.rmtree(converted, ignore_errors=True)
    print(
        f"checkpoint {ckpt}: {n_params:,} parameters, {_dir_bytes(ckpt) / 1e6:.0f} MB safetensors; "
        f"jax {jax.__version__}, {jax.device_count()} devices",
        flush=True,
    )

    def convert(sharding_for):
        t0 = time.perf_counter()
        params = load_params(
            ckpt,
            cfg,
            dtype="float32",
            progress=False,
            place=lambda path, host: jax.device_put(host, sharding_for(path, host.ndim)),
        )
        jax.block_until_ready(params)
        return time.perf_counter() - t0, params

    def restore(target, directory=converted):
        t0 = time.perf_counter()
        params, _ = orbax_io.restore_converted(directory, target)
        jax.block_until_ready(params)
        return time.perf_counter() - t0, params

    def check_same(a_params, b_params, sharding_for):
        la = jax.tree_util.tree_leaves_with_path(a_params)
        lb = jax.tree_util.tree_leaves_with_path(b_params)
        assert [k for k, _ in la] == [k for k, _ in lb]
        for (k, x), (_, y) in zip(la, lb):
            assert x.sharding.is_equivalent_to(y.sharding, x.ndim), (k, x.sharding, y.sharding)
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(k))

    lay = layouts(a.devices)
    # one-time save (from the 1-device conversion; restore re-shards onto any target)
    _, params = convert(lay["1 device"])
    t0 = time.perf_counter()
    orbax_io.save_converted(converted, params, cfg)
    save_s = time.perf_counter() - t0
    print(f"save_converted: {save_s:.2f}s, {_dir_bytes(converted) / 1e6:.0f} MB on disk", flush=True)
    zstd = None
    if not a.no_zstd:  # the same tree saved with Orbax's defaults (StandardCheckpointer: OCDBT + zstd)
        import orbax.checkpoint as ocp

        zstd = work / "converted_zstd"
        shutil.rmtree(zstd, ignore_errors=True)
        with ocp.StandardCheckpointer() as ckptr:
            t0 = time.perf_counter()
            ckptr.save(zstd.absolute() / "params", params)
            ckptr.wait_until_finished()
            zstd_save_s = time.perf_counter() - t0
        shutil.copy(converted / orbax_io.CONFIG_FILE, zstd / orbax_io.CONFIG_FILE)
        print(
            f"zstd save (StandardCheckpointer): {zstd_save_s:.2f}s, {_dir_bytes(zstd) / 1e6:.0f} MB on disk", flush=True
        )
    del params

    rows = []
    for name, sharding_for in lay.items():
        ct, rt, zt = [], [], []
        for i in range(a.repeats + 1):  # the first pair warms the page cache and jax: not counted
            dt_c, conv = convert(sharding_for)
            target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), conv)
            if name == "1 device":
                target = None  # what LLM(converted_dir) does: default target on device 0
            dt_r, rest = restore(target)
            if i == 0:
                check_same(conv, rest, sharding_for)
            del rest
            dt_z = None
            if zstd is not None:
                dt_z, rest = restore(target, zstd)
                if i == 0:
                    check_same(conv, rest, sharding_for)
                del rest
            if i > 0:
                ct.append(dt_c)
                rt.append(dt_r)
                if dt_z is not None:
                    zt.append(dt_z)
            del conv
            print(
                f"  {name}: run {i}{' (warm-up)' if i == 0 else ''}: convert {dt_c:.2f}s, restore {dt_r:.2f}s"
                + (f", restore of the zstd save {dt_z:.2f}s" if dt_z is not None else ""),
                flush=True,
            )
        row = dict(
            layout=name,
            convert=statistics.median(ct),
            restore=statistics.median(rt),
            ct=ct,
            rt=rt,
            zstd=statistics.median(zt) if zt else None,
            zt=zt,
        )
        rows.append(row)
        print(
            f"{name}: convert median {row['convert']:.2f}s, restore median {row['restore']:.2f}s, "
            f"convert / restore {row['convert'] / row['restore']:.2f}x"
            + (f"; zstd restore median {row['zstd']:.2f}s ({row['convert'] / row['zstd']:.2f}x)" if zt else ""),
            flush=True,
        )

    gb = _dir_bytes(ckpt) / 1e9
    lines = [
        f"- CPU: {cpu_model()}, {os.cpu_count()} cores (nproc); load average before {load_before}, after {loadavg()}",
        f"- jax {jax.__version__}, {jax.device_count()} host devices; checkpoint {n_params:,} parameters fp32 "
        f"({gb * 1e3:.0f} MB); save_converted once: {save_s:.2f}s ({_dir_bytes(converted) / 1e6:.0f} MB)"
        + (f"; zstd save {zstd_save_s:.2f}s ({_dir_bytes(zstd) / 1e6:.0f} MB)" if zstd is not None else ""),
        f"- median of {a.repeats} alternating runs after one warm-up pair; values and shardings of the "
        f"restored tree checked equal to the converted one",
        "",
        "| layout | convert (load_params) s | restore (restore_converted) s | convert / restore | "
        "restore of a zstd save s | convert / zstd restore | convert runs | restore runs | zstd restore runs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def runs(ts):
        return ", ".join(f"{t:.2f}" for t in ts) or "-"

    for r in rows:
        z = f"{r['zstd']:.2f} | {r['convert'] / r['zstd']:.2f}x" if r["zstd"] else "- | -"
        lines.append(
            f"| {r['layout']} | {r['convert']:.2f} | {r['restore']:.2f} | {r['convert'] / r['restore']:.2f}x "
            f"| {z} | {runs(r['ct'])} | {runs(r['rt'])} | {runs(r['zt'])} |"
        )
    table = "\n".join(lines)
    print("\n" + table)
    if a.out:
        pathlib.Path(a.out).write_text(table + "\n")
    for t in tmps:
        t.cleanup()


if __name__ == "__main__":
    main()
