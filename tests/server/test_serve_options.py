"""``jaxmoe serve`` refuses every out-of-range option at start with one line naming it (no traceback,
non-zero exit), a busy port included; the HTTP API refuses absurd sampling numbers naming the field."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from jaxmoe.cli import build_parser
from jaxmoe.server.serve_options import ServeOptionError, validate_serve_args

pytestmark = pytest.mark.timeout(180)


def _args(*flags):
    return build_parser().parse_args(["serve", "--model", "tiny-random", *flags])


@pytest.mark.parametrize(
    "flags, option, allowed",
    [
        (["--http-port", "70000"], "--http-port", "0..65535"),
        (["--grpc-port", "-1"], "--grpc-port", "0..65535"),
        (["--http-port", "9000", "--grpc-port", "9000"], "--grpc-port and --http-port", "must differ"),
        (["--http-max-connections", "0"], "--http-max-connections", ">= 1"),
        (["--allowed-hosts", ""], "--allowed-hosts", "at least one"),
        (["--allowed-hosts", " , "], "--allowed-hosts", "at least one"),
        (["--max-body-bytes", "-1"], "--max-body-bytes", ">= 1"),
        (["--header-timeout", "-1"], "--header-timeout", "> 0"),
        (["--header-timeout", "nan"], "--header-timeout", "finite"),
        (["--max-header-bytes", "0"], "--max-header-bytes", ">= 1024"),
        (["--request-timeout", "-5"], "--request-timeout", ">= 0"),
        (["--shutdown-grace", "inf"], "--shutdown-grace", "finite"),
        (["--body-read-timeout", "0"], "--body-read-timeout", "> 0"),
        (["--max-waiting", "0"], "--max-waiting", ">= 1"),
        (["--max-num-seqs", "0"], "--max-num-seqs", ">= 1"),
        (["--num-blocks", "0"], "--num-blocks", ">= 1"),
        (["--max-model-len", "1000000000"], "--max-model-len", "2..16777216"),
        (["--keep-alive-timeout", "-1"], "--keep-alive-timeout", ">= 0"),
        (["--brownout-threshold", "1.5"], "--brownout-threshold", "[0, 1]"),
        (["--slo-tpot-ms", "-3"], "--slo-tpot-ms", "> 0"),
        (["--api-key", ""], "--api-key", "must not be empty"),
        (["--host", ""], "--host", "address"),
    ],
)
def test_each_bad_option_is_named_with_its_range(flags, option, allowed):
    with pytest.raises(ServeOptionError) as err:
        validate_serve_args(_args(*flags))
    message = str(err.value)
    assert message.startswith(option + ":") and allowed in message and "\n" not in message, message


def test_defaults_and_ephemeral_ports_are_valid():
    validate_serve_args(_args())
    validate_serve_args(_args("--http-port", "0", "--grpc-port", "0", "--request-timeout", "0"))


def _serve(*flags, timeout=120):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "jaxmoe.cli", "serve", "--model", "tiny-random", *flags]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, option",
    [
        (["--http-port", "70000", "--grpc-port", "0"], "--http-port"),
        (["--http-port", "0", "--grpc-port", "0", "--max-waiting", "0"], "--max-waiting"),
        (["--http-port", "0", "--grpc-port", "0", "--allowed-hosts", ""], "--allowed-hosts"),
    ],
)
def test_cli_bad_option_one_line_no_traceback(flags, option):
    proc = _serve(*flags)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    err = proc.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1 and err.startswith(f"jaxmoe: {option}:"), err


@pytest.mark.slow
@pytest.mark.parametrize("which", ["--http-port", "--grpc-port"])
def test_cli_busy_port_one_line_no_traceback(which):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        other = "--grpc-port" if which == "--http-port" else "--http-port"
        proc = _serve(which, str(port), other, "0")
    assert proc.returncode != 0, (proc.stdout, proc.stderr)
    err = proc.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith(f"jaxmoe: {which}: cannot listen on 127.0.0.1:{port}"), err


@pytest.mark.slow
def test_cli_sigterm_when_idle_exits_within_a_second():
    import signal
    import time

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "jaxmoe.cli", "serve", "--model", "tiny-random", "--no-warmup"]
    proc = subprocess.Popen(
        [*cmd, "--http-port", "0", "--grpc-port", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if "http listening" in line or (not line and proc.poll() is not None):
                break
        assert "http listening" in line, line
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0 and took < 1.0, (code, took)
