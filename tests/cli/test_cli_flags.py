"""Command-line flags a vLLM user reaches for: ``serve --port`` (HTTP; gRPC keeps ``--grpc-port``),
default ports beside vLLM's, ``--dtype auto|float32|bfloat16|float16`` checked before anything
loads (one error line), no flag shown that is ignored, and a mesh needing more CPU devices than
exist saying how to get them."""

from __future__ import annotations

import pytest
import yaml

from jaxmoe.cli import build_parser, main


def test_serve_port_flags_and_defaults():
    p = build_parser()
    args = p.parse_args(["serve"])
    assert (args.http_port, args.grpc_port) == (8100, 50151)
    assert p.parse_args(["serve", "--port", "9000"]).http_port == 9000
    assert p.parse_args(["serve", "--http-port", "9001", "--grpc-port", "0"]).http_port == 9001
    assert p.parse_args(["client"]).target == "127.0.0.1:50151"


@pytest.mark.parametrize(
    "value, want", [("auto", None), ("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float16")]
)
def test_dtype_choices(value, want):
    assert build_parser().parse_args(["generate", "--dtype", value]).dtype == want
    assert build_parser().parse_args(["serve"]).dtype is None  # auto: the checkpoint's torch_dtype


def test_a_bad_dtype_is_one_line_before_loading(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", "/nowhere/at/all", "--dtype", "fp33"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --dtype: expected one of auto, float32, bfloat16, float16, got 'fp33'" in err
    assert err.count("\n") == 1 and err.startswith("jaxmoe serve: error: argument --dtype")


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "--mesh", "meshes/cpu-8.yaml"],
        ["unite", "--ways", "2", "--out", "x", "--mesh", "meshes/cpu-8.yaml"],
        ["unite", "--ways", "2", "--out", "x", "--dtype", "bfloat16"],
    ],
)
def test_flags_that_would_be_ignored_are_not_offered(argv, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


@pytest.mark.slow
def test_a_mesh_needing_more_cpu_devices_says_how(capsys, tmp_path):
    # the test session has 8 host devices; this file needs 16
    raw = {
        "platform": "cpu",
        "nodes": 2,
        "devices_per_node": 8,
        "attention": {"instances": 2},
        "experts": {"instances": 2, "slots_per_instance": 4},
    }
    path = tmp_path / "cpu-16.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["generate", "--model", "tiny-random", "--mesh", str(path), "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "only 8 jax devices exist" in err and "XLA_FLAGS=--xla_force_host_platform_device_count=16" in err


def test_serve_async_scheduling_flag_reaches_the_engine_config():
    """``--async-scheduling`` (off by default) sets the engine's async scheduling (what it does to
    layer preemption's default: tests/qllm/test_layer_preemption_default.py)."""
    from jaxmoe.server.cli import runtime_config

    serve = lambda *argv: runtime_config(build_parser().parse_args(["serve", *argv]))[0]  # noqa: E731
    assert serve().engine.async_scheduling is False
    assert serve("--async-scheduling").engine.async_scheduling is True
    assert serve("--no-async-scheduling").engine.async_scheduling is False
