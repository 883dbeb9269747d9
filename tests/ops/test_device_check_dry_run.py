"""``bench/device_check.py`` runs first time: its CPU dry run (``--platform cpu --tiny``) goes
through every section, checks every kernel against its reference and writes the JSON report."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_cpu_dry_run_writes_every_section(tmp_path):
    out = tmp_path / "device_check.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "device_check.py"), "--platform", "cpu", "--tiny", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["platform"] == "cpu" and report["tiny"] is True and report["errors"] == []
    s = report["sections"]
    assert list(s) == [
        "copy_bandwidth",
        "grouped_matmul",
        "aebs",
        "correctness",
        "decode",
        "decode_profile",
        "disaggregated",
    ]
    checks = {c["kernel"]: c["ok"] for c in s["correctness"]["checks"]}
    assert all(checks.values()) and s["correctness"]["ok"]
    assert {"expert_ffn[dense]", "grouped_matmul[pallas]", "aebs[aebs, kernel]", "paged_attention[xla form]"} <= set(
        checks
    )
    assert s["copy_bandwidth"]["gbs"] > 0
    assert [r["shape"] for r in s["grouped_matmul"]["rows"]] == ["tiny"] and s["grouped_matmul"]["rows"][0]["gbs"] > 0
    assert [r["batch"] for r in s["aebs"]["rows"]] == [16, 64] and all(r["us"] > 0 for r in s["aebs"]["rows"])
    decode = s["decode"]["rows"]
    assert decode and all(r["tokens_per_s"] > 0 and r["roofline_tokens_per_s"] > 0 for r in decode)
    profile = s["decode_profile"]["batch_1"]
    assert profile["ops_per_step"] > 0 and profile["top_ops"] and profile["step_ms"] > 0
    assert s["disaggregated"]["host_us_per_layer"] > 0 and s["disaggregated"]["layers"] == 4
    assert json.loads(done.stdout) == report  # the same JSON on stdout
