"""One log line per request (logger ``jaxmoe.requests``): id, route, prompt / output tokens, time to
first token and status. ``jaxmoe serve`` logs them by default (``--no-log-requests`` or ``--quiet``
turn them off, by setting this logger's level)."""

from __future__ import annotations

import logging

log = logging.getLogger("jaxmoe.requests")


def log_request(route: str, request_id: str, status, outs=(), per_prompt: int = 1) -> None:
    """``outs``: the last ``RequestOutput`` of each of the request's sequences, prompt-major with
    ``per_prompt`` sequences per prompt (each prompt counted once; None: nothing came back); none
    when the request was refused."""
    if not log.isEnabledFor(logging.INFO):
        return
    prompt = sum(len(o.prompt_token_ids) for i, o in enumerate(outs) if o is not None and i % per_prompt == 0)
    outs = [o for o in outs if o is not None]
    output = sum(len(o.token_ids) for o in outs)
    ttfts = [o.ttft for o in outs if o.ttft is not None]
    ttft = f"{min(ttfts):.3f}s" if ttfts else "-"
    finish = ",".join(sorted({o.finish_reason for o in outs if o.finish_reason})) or "-"
    log.info(
        "%s %s status=%s prompt_tokens=%d output_tokens=%d ttft=%s finish=%s",
        request_id,
        route,
        status,
        prompt,
        output,
        ttft,
        finish,
    )
