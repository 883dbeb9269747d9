"""``jaxmoe serve``'s option checks: every option is validated before the model loads, and a bad one
is refused with one line naming the option and its allowed range (``validate_serve_args``); the
ports are tried before the model loads too (``check_ports_free``), so a busy port is one line, not
a traceback after minutes of loading.
"""

from __future__ import annotations

import math
import socket

MAX_PORT = 65535
MAX_MODEL_LEN_LIMIT = 1 << 24  # tokens; the model's own context bounds it further (checked once it is loaded)


class ServeOptionError(ValueError):
    """An option out of its range: the message names it (``--http-port: ...``)."""


def _int(args, name: str, lo: int, hi: int | None = None, *, none_ok: bool = False, hint: str = "") -> None:
    value = getattr(args, name.replace("-", "_"), None)
    if value is None and none_ok:
        return
    if value is None or not lo <= value <= (hi if hi is not None else value):
        allowed = f"an integer in {lo}..{hi}" if hi is not None else f"an integer >= {lo}"
        raise ServeOptionError(f"--{name}: must be {allowed}{hint}, got {value}")


def _real(args, name: str, lo: float, *, low_open: bool = False, none_ok: bool = True, hint: str = "") -> None:
    value = getattr(args, name.replace("-", "_"), None)
    if value is None and none_ok:
        return
    if value is None or not math.isfinite(value) or value < lo or (low_open and value == lo):
        allowed = f"a finite number {'>' if low_open else '>='} {lo:g}"
        raise ServeOptionError(f"--{name}: must be {allowed}{hint}, got {value}")


def validate_serve_args(args) -> None:
    """Raise ``ServeOptionError`` naming the first option out of its range (``jaxmoe serve``'s parsed
    arguments); options another version of the parser lacks are skipped."""
    if not str(getattr(args, "host", "x")).strip():
        raise ServeOptionError("--host: must be an address to bind (e.g. 127.0.0.1 or 0.0.0.0), got ''")
    for port in ("grpc-port", "http-port"):
        _int(args, port, 0, MAX_PORT, hint=" (0: pick a free port)")
    grpc_port, http_port = getattr(args, "grpc_port", 0), getattr(args, "http_port", 0)
    if grpc_port and grpc_port == http_port:
        raise ServeOptionError(
            f"--grpc-port and --http-port: must differ (or be 0: pick a free port), both are {grpc_port}"
        )
    for name in ("max-num-seqs", "max-batch-tokens", "max-waiting", "num-blocks", "max-prefill-chunk"):
        _int(args, name, 1)
    _int(args, "pause-every", 1, none_ok=True, hint=" (default: measured at warm-up)")
    _int(args, "block-size", 1, 1 << 16)
    _int(args, "max-model-len", 2, MAX_MODEL_LEN_LIMIT, none_ok=True, hint=" (default: the model's context)")
    _int(args, "expert-queues", 0, hint=" (0: off)")
    _int(args, "rebalance-every", 0, hint=" (0: off)")
    _int(args, "max-paused-state-bytes", 0, none_ok=True)
    _int(args, "max-body-bytes", 1)
    _int(args, "http-max-connections", 1)
    _int(args, "keep-alive-timeout", 0)
    _int(args, "max-header-bytes", 1024, hint=" (bytes of an HTTP request head)")
    _real(args, "shutdown-grace", 0.0, none_ok=False)
    _real(args, "step-timeout", 0.0, none_ok=False, hint=" (0: no limit)")
    _real(args, "request-timeout", 0.0, none_ok=False, hint=" (0: no deadline)")
    _real(args, "body-read-timeout", 0.0, low_open=True, none_ok=False)
    _real(args, "header-timeout", 0.0, low_open=True, none_ok=False)
    _real(args, "autoscale-interval", 0.0, low_open=True)
    for name in ("slo-ttft-ms", "slo-tpot-ms", "salc-window", "salc-period", "salc-increment", "salc-shrink-ratio"):
        _real(args, name, 0.0, low_open=name != "salc-period")
    _real(args, "salc-warning-factor", 0.0, low_open=True)
    for name in ("brownout-threshold", "brownout-prefill-threshold", "brownout-decode-threshold"):
        threshold = getattr(args, name.replace("-", "_"), None)
        if threshold is not None and not 0.0 <= threshold <= 1.0:
            raise ServeOptionError(f"--{name}: must be in [0, 1], got {threshold}")
    hosts = getattr(args, "allowed_hosts", None)
    if hosts is not None and not [h for h in hosts.split(",") if h.strip()]:
        raise ServeOptionError(
            "--allowed-hosts: must name at least one Host header value ('*': any; leave it out: the bound address)"
        )
    if getattr(args, "api_key", None) is not None and not str(args.api_key).strip():
        raise ServeOptionError("--api-key: must not be empty (leave it out for no key)")


def check_max_model_len(args, model_max_len: int) -> None:
    """Once the model is loaded: ``--max-model-len`` may not exceed the model's context."""
    value = getattr(args, "max_model_len", None)
    if value is not None and value > model_max_len:
        raise ServeOptionError(f"--max-model-len: must be at most {model_max_len} (this model's context), got {value}")


def check_ports_free(host: str, ports: dict[str, int]) -> None:
    """Bind each non-zero port once (and let it go) to report a busy one before the model loads.
    ``ports``: option name -> port. Raises ``ServeOptionError`` naming the option."""
    for option, port in ports.items():
        if not port:
            continue
        try:
            family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        except OSError as e:
            raise ServeOptionError(f"--host: cannot resolve {host!r}: {e.strerror or e}") from None
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(addr)
            except OSError as e:
                raise ServeOptionError(f"{option}: cannot listen on {host}:{port}: {e.strerror or e}") from None


def raise_open_files_limit() -> int:
    """Raise this process's open-file limit (RLIMIT_NOFILE) to its hard limit, as a server holding
    thousands of connections needs; returns the limit in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # not allowed here: keep the soft limit
            pass
    return soft
