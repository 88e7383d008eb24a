"""bench/cpu_noise.py: its table and JSON from a short run, and its flag checks."""
from __future__ import annotations

import json

import pytest

from bench import cpu_noise


def test_cpu_noise_times_each_case_and_writes_json(capsys, tmp_path):
    out = tmp_path / "noise.json"
    argv = ["--steps", "2", "--rounds", "1", "--threads", "1", "--noise-cores", "0", "0.2",
            "--json", str(out)]
    assert cpu_noise.main(argv) == 0
    table = capsys.readouterr().out
    assert "background cores" in table and "x time at 0 cores" in table
    rows = json.loads(out.read_text())["rows"]
    assert [(r["threads"], r["noise_cores"]) for r in rows] == [(1, 0.0), (1, 0.2)]
    assert rows[0]["x_first"] == 1.0 and all(r["wall_s"] > 0 and r["clips_per_s"] > 0 for r in rows)


@pytest.mark.parametrize("argv, flag", [
    (["--steps", "0"], "--steps 0"),
    (["--threads", "0"], "--threads 0"),
    (["--burst-ms", "0"], "--burst-ms 0"),
    (["--noise-cores", "2.5"], "--noise-cores 2.5"),    # 2 processes can take at most 2 cores
    (["--noise-cores", "-0.1"], "--noise-cores -0.1"),
])
def test_cpu_noise_rejects_bad_flags_naming_them(argv, flag):
    with pytest.raises(SystemExit) as e:
        cpu_noise.check_args(cpu_noise.build_parser().parse_args(argv))
    assert str(e.value).startswith(flag)
