"""What the engine gives back: ``RequestOutput`` per request and step (with ``TokenLogprob`` s), and
``StepFailedError`` when a step's model run raised.

vLLM's shape is there too: ``RequestOutput.outputs`` is a list of ``CompletionOutput`` (one per
completion: ``n`` > 1 gives several), whose ``logprobs`` are per token a dict {token id:
``Logprob(logprob, rank, decoded_token)``} holding the chosen token and the top alternatives.
"""

from __future__ import annotations

import dataclasses


class StepFailedError(RuntimeError):
    """A step's model run raised; ``request_ids`` were in that step (the caller decides their
    fate: ``AsyncEngine`` fails them). The KV cache is valid again when this is raised."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"engine step failed: {type(cause).__name__}: {cause}")
        self.request_ids = request_ids


@dataclasses.dataclass
class Logprob:
    """One token's logprob as vLLM gives it: ``rank`` 1 is the most likely token (None: not computed)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class TokenLogprob:
    """The logprob of one generated (or prompt) token, with the top alternatives (token id,
    logprob), best first; ``decoded_token`` / ``top_tokens`` are their texts."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None
    decoded_token: str | None = None
    top_tokens: list[str] | None = None

    def as_dict(self) -> dict[int, Logprob]:
        """vLLM's form: {token id: Logprob}, the chosen token first, then the alternatives."""
        texts = self.top_tokens or [None] * len(self.top)
        d = {self.token_id: Logprob(self.logprob, self.rank, self.decoded_token)}
        for r, ((t, lp), text) in enumerate(zip(self.top, texts), 1):
            d.setdefault(t, Logprob(lp, r, text))
        return d


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a request (vLLM's ``CompletionOutput``)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


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
    cumulative_logprob: float | None = None  # sum of the generated tokens' logprobs
    prompt: str | None = None  # the prompt's text, when it was given as text (``LLM.generate``)
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    def __post_init__(self):
        self._outputs: list[CompletionOutput] | None = None

    @property
    def outputs(self) -> list[CompletionOutput]:
        """The completions (vLLM): this request's own unless several were merged in (``n`` > 1)."""
        if self._outputs is None:
            self._outputs = [self.completion(0)]
        return self._outputs

    @outputs.setter
    def outputs(self, value: list[CompletionOutput]) -> None:
        self._outputs = list(value)

    def completion(self, index: int) -> CompletionOutput:
        """This request's tokens as completion ``index``."""
        return CompletionOutput(
            index=index,
            text=self.text,
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else [lp.as_dict() for lp in self.logprobs],
            finish_reason=self.finish_reason if self.finished else None,
        )

    @property
    def usage(self) -> dict[str, int]:
        p = len(self.prompt_token_ids)
        c = sum(len(o.token_ids) for o in self._outputs) if self._outputs else len(self.token_ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
