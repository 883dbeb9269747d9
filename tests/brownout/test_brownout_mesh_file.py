"""BrownoutServe from the mesh file: the ``brownout:`` section (start threshold, full / partial
brownout, SALC on or off with its parameters), ``jaxmoe serve`` flags overriding it, bad values named
by field and value, and an engine built from a mesh file with SALC on running SALC (the
``jaxmoe_brownout_threshold`` gauge) and with SALC off not running it."""

from __future__ import annotations

import http.client
import shutil
import sysconfig
from pathlib import Path

import pytest
import yaml

from jaxmoe import LLM, SamplingParams
from jaxmoe.brownout.config import BrownoutSettings, describe, mesh_brownout
from jaxmoe.brownout.controller import BrownoutController
from jaxmoe.brownout.routing import threshold as brownout_threshold
from jaxmoe.mesh import MeshConfigError, load_mesh

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
PROMPTS = [[3, 9, 27, 81, 11], [5, 25, 17], [2, 4, 8, 16, 32, 64]]
ENGINE = ["--num-blocks", "64", "--block-size", "8", "--max-num-seqs", "4", "--dtype", "float32"]
SECTION = {
    "salc": True,
    "threshold": 0.9,
    "slo_tpot_ms": 1e-3,  # no step meets it: SALC shrinks the threshold every step
    "slo_ttft_ms": 2000,
    "tw": 60,
    "warning_factor": 0.7,
    "increment": 0.2,
    "shrink_ratio": 0.5,
}


def _mesh(brownout=None) -> dict:
    raw = yaml.safe_load(Path("meshes/monolithic.yaml").read_text())
    if brownout is not None:
        raw["brownout"] = brownout
    return raw


def _write(tmp_path, brownout, name="mesh.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(_mesh(brownout)))
    return str(path)


def _args(*argv):
    from jaxmoe.cli import build_parser

    return build_parser().parse_args(["serve", "--grpc-port", "0", "--http-port", "0", *argv])


@pytest.fixture(scope="module")
def united(checkpoint_dir, tmp_path_factory):
    """The tiny Mixtral checkpoint with united experts (k = 2, a short distillation)."""
    from jaxmoe.brownout.united import unite

    corpus = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap.py", "bisect.py"):
        shutil.copy(stdlib / name, corpus / name)
    out = tmp_path_factory.mktemp("united") / "m"
    unite(checkpoint_dir("mixtral"), 2, out, tokens=256, steps=5, corpus=str(corpus), progress=False)
    return out


def test_the_brownout_section_is_read(capsys):
    from jaxmoe.cli import main

    spec = load_mesh(_mesh(SECTION))
    assert spec.brownout == SECTION  # handed over as written: the brownout package validates it
    assert mesh_brownout(spec) == BrownoutSettings(
        threshold=0.9,
        salc=True,
        slo_ttft_s=2.0,
        slo_tpot_s=1e-6,
        window_s=60.0,
        warning_factor=0.7,
        increment=0.2,
        shrink_ratio=0.5,
    )
    assert mesh_brownout(spec).salc_config().slo_tpot_s == pytest.approx(1e-6)
    assert main(["mesh", "show", "meshes/cpu-8-brownout.yaml"]) == 0
    assert "brownout: start threshold 1 (partial brownout), SALC on: P90 SLO TTFT 2000 ms" in capsys.readouterr().out
    off = load_mesh(_mesh({"use_full_brownout": True, "threshold": 0.4}))
    assert mesh_brownout(off) == BrownoutSettings(threshold=0.4, use_full_brownout=True)
    assert mesh_brownout(off).salc_config() is None
    phases = mesh_brownout(_mesh({"threshold": 0.4, "decode_threshold": 0.2}))
    assert (phases.brownout().prefill, phases.brownout().decode) == (0.4, 0.2)
    assert describe(phases) == "start threshold prefill 0.4, decode 0.2 (partial brownout), SALC off"
    assert load_mesh(_mesh()).brownout is None and mesh_brownout(_mesh()) is None
    shipped = load_mesh("meshes/cpu-8-brownout.yaml")
    assert mesh_brownout(shipped) == BrownoutSettings(salc=True, slo_ttft_s=2.0, slo_tpot_s=0.15)
    layout = load_mesh("meshes/cpu-8.yaml")
    assert (shipped.attention, shipped.experts, shipped.transfer) == (layout.attention, layout.experts, layout.transfer)
    assert load_mesh(_mesh(SECTION)) == load_mesh(_mesh())  # a serving setting, not part of the layout


@pytest.mark.parametrize(
    "section,message",
    [
        ({"threshold": 1.5}, r"brownout.threshold: brownout threshold must be a number in \[0, 1\], got 1.5"),
        ({"threshold": "high"}, "brownout.threshold: brownout threshold must be a number in \\[0, 1\\], got 'high'"),
        (
            {"prefill_threshold": -1},
            r"brownout.prefill_threshold: brownout prefill_threshold must be a number in \[0, 1\], got -1",
        ),
        ({"salc": "yes"}, "brownout.salc: expected true or false, got 'yes'"),
        ({"use_full_brownout": 1}, "brownout.use_full_brownout: expected true or false, got 1"),
        ({"salc": True}, "brownout.salc: SALC needs an SLO: give slo_ttft_ms and/or slo_tpot_ms"),
        ({"slo_tpot_ms": -5}, "brownout.slo_tpot_ms: SALC slo_tpot_ms must be > 0 milliseconds, got -5"),
        ({"slo_ttft_ms": True}, "brownout.slo_ttft_ms: SALC slo_ttft_ms must be > 0 milliseconds, got True"),
        ({"tw": 0}, "brownout.tw: SALC window must be > 0 seconds, got 0"),
        ({"warning_factor": 1.2}, r"brownout.warning_factor: SALC warning_factor must be in \(0, 1\], got 1.2"),
        ({"increment": 0}, r"brownout.increment: SALC increment must be in \(0, 1\], got 0"),
        ({"shrink_ratio": 1.0}, r"brownout.shrink_ratio: SALC shrink_ratio must be in \(0, 1\), got 1.0"),
        ({"period": -1}, "brownout.period: SALC period must be >= 0 seconds, got -1"),
        ({"slo": 100}, "brownout.slo: unknown key"),
        ([0.5], "brownout: expected a mapping, got list"),
    ],
)
def test_bad_values_name_the_field_and_the_value(section, message):
    with pytest.raises(MeshConfigError, match=rf"<dict>: {message}"):
        mesh_brownout(_mesh(section))


def test_flags_override_the_mesh_file(tmp_path, capsys):
    from jaxmoe.cli import main
    from jaxmoe.server.brownout_flags import serve_brownout

    path = _write(tmp_path, SECTION)
    spec = load_mesh(path)
    assert serve_brownout(_args("--mesh", path), spec) == mesh_brownout(spec)
    got = serve_brownout(
        _args("--mesh", path, "--brownout-threshold", "0.3", "--salc-shrink-ratio", "0.9", "--slo-tpot-ms", "40"), spec
    )
    assert (got.threshold, got.shrink_ratio, got.slo_tpot_s, got.increment) == (0.3, 0.9, 0.04, 0.2)
    got = serve_brownout(_args("--mesh", path, "--brownout-decode-threshold", "0.25"), spec).brownout()
    assert (got.prefill, got.decode) == (0.9, 0.25)  # the file's threshold for prefill, the flag's for decode
    phases = load_mesh(_mesh({"prefill_threshold": 0.5}))
    got = serve_brownout(_args("--brownout-threshold", "0.7"), phases).brownout()
    assert (got.prefill, got.decode) == (0.7, 0.7)  # --brownout-threshold sets both phases
    assert serve_brownout(_args("--mesh", path, "--no-salc"), spec).salc_config() is None
    assert serve_brownout(_args("--mesh", path, "--full-brownout"), spec).use_full_brownout
    plain = load_mesh(_mesh())
    assert serve_brownout(_args("--salc-window", "3"), plain) is None  # no section, no brownout flag: off
    assert serve_brownout(_args("--salc", "--slo-ttft-ms", "500"), plain).salc_config().slo_ttft_s == 0.5
    # a bad flag value over a good mesh file, and a bad mesh file: refused before the model loads
    assert main(["serve", "--model", "nowhere", "--mesh", path, "--salc-shrink-ratio", "1.5"]) == 2
    assert "SALC shrink_ratio must be in (0, 1), got 1.5" in capsys.readouterr().err
    assert main(["serve", "--model", "nowhere", "--mesh", path, "--brownout-threshold", "2"]) == 2
    assert "--brownout-threshold: must be in [0, 1], got 2.0" in capsys.readouterr().err
    bad = _write(tmp_path, {"salc": True, "tw": -3, "slo_tpot_ms": 50}, "bad.yaml")
    assert main(["serve", "--model", "nowhere", "--mesh", bad]) == 2
    assert f"{bad}: brownout.tw: SALC window must be > 0 seconds, got -3" in capsys.readouterr().err


def _metrics(engine) -> tuple[str, dict]:
    """(the /metrics text, the engine stats snapshot) of a server over ``engine``."""
    from jaxmoe.server.app import ServeOptions, ServerThread

    st = ServerThread(engine, ServeOptions(warmup=False))
    server = st.start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
        conn.request("GET", "/metrics")
        return conn.getresponse().read().decode(), server.async_engine.snapshot()
    finally:
        st.stop()


def _run(engine, n=len(PROMPTS)):
    for prompt in PROMPTS[:n]:
        engine.add_request(prompt, GREEDY)
    for _ in range(200):
        if not engine.has_work():
            return
        engine.step()
    raise AssertionError("the engine did not finish")


@pytest.mark.slow
def test_a_mesh_file_with_salc_on_runs_salc_and_off_does_not(united, tmp_path):
    from jaxmoe.assembly import build_engine
    from jaxmoe.server.cli import runtime_config

    on = _write(tmp_path, SECTION, "on.yaml")
    engine = build_engine(runtime_config(_args("--model", str(united), "--mesh", on, *ENGINE))[0])
    (controller,) = [h for h in engine.hooks if isinstance(h, BrownoutController)]
    assert controller.config.shrink_ratio == 0.5 and controller.config.window_s == 60.0
    _run(engine)
    threshold = brownout_threshold(engine.executor, "decode")  # the TPOT SALC's phase
    assert threshold < 0.9 * 0.5**3  # shrunk by 0.5 per step from the file's start threshold 0.9
    both = {"prefill": brownout_threshold(engine.executor, "prefill"), "decode": threshold}
    assert controller.state()["threshold"] == both
    text, stats = _metrics(engine)
    for phase, value in both.items():
        assert f'jaxmoe_brownout_threshold{{phase="{phase}"}} {value}' in text
    assert stats["brownout"]["threshold"] == both

    off = _write(tmp_path, {**SECTION, "salc": False, "threshold": 0.6}, "off.yaml")
    engine = build_engine(runtime_config(_args("--model", str(united), "--mesh", off, *ENGINE))[0])
    assert not [h for h in engine.hooks if isinstance(h, BrownoutController)]
    _run(engine, 1)
    assert brownout_threshold(engine.executor) == 0.6  # brownout at the file's threshold, never moved
    text, stats = _metrics(engine)
    assert "jaxmoe_brownout_threshold" not in text and "brownout" not in stats

    # the flag turns the file's SALC off; the file's SALC on again with the LLM API
    engine = build_engine(runtime_config(_args("--model", str(united), "--mesh", on, "--no-salc", *ENGINE))[0])
    assert not [h for h in engine.hooks if isinstance(h, BrownoutController)]
    assert brownout_threshold(engine.executor) == 0.9
    llm = LLM(united, dtype="float32", mesh=on, num_blocks=64, block_size=8, max_num_seqs=4)
    llm.generate(PROMPTS, GREEDY)
    assert llm.brownout_controller is not None and brownout_threshold(llm.executor) < 0.9 * 0.5**3
