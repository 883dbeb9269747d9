"""What the engine gives back: ``RequestOutput`` per request and step (with ``TokenLogprob`` s), and
``StepFailedError`` when a step's model run raised."""

from __future__ import annotations

import dataclasses


class StepFailedError(RuntimeError):
    """A step's model run raised; ``request_ids`` were in that step (the caller decides their
    fate: ``AsyncEngine`` fails them). The KV cache is valid again when this is raised."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"engine step failed: {type(cause).__name__}: {cause}")
        self.request_ids = request_ids


@dataclasses.dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclasses.dataclass
class RequestOutput:
    """The state of one request after a step (``delta_*`` is what this step added)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_token_ids: list[int]
    delta_text: str
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None
    priority: str
    ttft: float | None = None
    tpot: float | None = None
    error: str | None = None  # set (with finish_reason "error") when this request failed in the engine
    prompt_logprobs: list[TokenLogprob | None] | None = (
        None  # per prompt token (the first: None); on the first output with tokens and the final one
    )
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    @property
    def usage(self) -> dict[str, int]:
        p, c = len(self.prompt_token_ids), len(self.token_ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
