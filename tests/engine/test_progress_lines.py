"""Progress when stderr is not a terminal: warm-up (and any stage using ``jaxmoe.progress``) prints a
line when it starts, lines with counts and seconds while it runs, and one when it ends."""

from __future__ import annotations

import pytest

import re

from jaxmoe import LLM
from jaxmoe.engine.warmup import warm_up
from jaxmoe.progress import LineProgress, progress


def test_line_progress_counts_and_seconds(capsys):
    bar = LineProgress("loading weights", 3 << 20, "B", every_s=0.0)
    bar.set_postfix_str("1/3 tensors")
    bar.update(1 << 20)
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "loading weights: 3.0 MiB to go"
    assert re.fullmatch(r"loading weights: 1\.0 MiB/3\.0 MiB, 1/3 tensors \(\d+\.\d s\)", lines[1])
    assert re.fullmatch(r"loading weights: done, 1\.0 MiB/3\.0 MiB \(\d+\.\d s\)", lines[2])
    assert isinstance(progress("x", 1, "step"), LineProgress)  # pytest's stderr is not a terminal
    capsys.readouterr()
    assert not isinstance(progress("x", 1, "step", enabled=False), LineProgress)


@pytest.mark.slow
def test_warm_up_reports_lines_off_a_terminal(capsys):
    llm = LLM("tiny-random", num_blocks=16, block_size=8, max_num_seqs=2)
    capsys.readouterr()
    warm_up(llm.engine, shapes=[(1, 1), (1, 16)])
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "jaxmoe warm-up: 2 programs to go"
    done = err[-1]
    # each shape's step program plus, per batch size, the sampler and adjust_logits
    assert re.fullmatch(r"jaxmoe warm-up: done, (\d+) programs/\1 programs \(\d+\.\d s\)", done), done
    assert int(re.search(r"done, (\d+)", done).group(1)) >= 4
