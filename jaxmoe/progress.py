"""Progress a person can see on stderr, terminal or not: a tqdm bar on a terminal; otherwise (a log
file, a pipe, a container's output) one line when a stage starts, a line at most every
``every_s`` seconds while it runs, and one when it ends, with counts and seconds."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


def _amount(n: float, unit: str) -> str:
    if unit == "B":
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n:g} {unit}{'' if n == 1 else 's'}"


class LineProgress:
    """The part of tqdm's interface the stages use (``update``, ``set_postfix_str``, ``total``,
    ``close``), as plain lines."""

    def __init__(self, desc: str, total: float, unit: str, every_s: float = 10.0, file=None):
        self.desc, self.total, self.unit, self.every_s = desc, total, unit, every_s
        self.file = file or sys.stderr
        self.n, self.postfix = 0, ""
        self.t0 = self._last = time.monotonic()
        self._print(f"{desc}: {_amount(total, unit)} to go")

    def _print(self, text: str) -> None:
        print(text, file=self.file, flush=True)

    def _line(self, what: str) -> str:
        extra = f", {self.postfix}" if self.postfix else ""
        done = f"{_amount(self.n, self.unit)}/{_amount(self.total, self.unit)}"
        return f"{self.desc}: {what}{done}{extra} ({time.monotonic() - self.t0:.1f} s)"

    def update(self, n: float = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            self._print(self._line(""))

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def close(self) -> None:
        self.postfix = ""
        self._print(self._line("done, "))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(desc: str, total: float, unit: str, enabled: bool | None = None, every_s: float = 10.0, **tqdm_kw):
    """A progress reporter on stderr: ``enabled`` True: a tqdm bar; False: nothing; None: a tqdm bar
    on a terminal, else ``LineProgress`` lines."""
    if enabled is None and not sys.stderr.isatty():
        return LineProgress(desc, total, unit, every_s)
    return tqdm(
        total=total, desc=desc, unit=unit, file=sys.stderr, disable=not enabled and enabled is not None, **tqdm_kw
    )
