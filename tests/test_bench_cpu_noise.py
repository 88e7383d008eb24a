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


@pytest.mark.slow        # a fresh interpreter importing torch, and background processes
@pytest.mark.timeout(300)
def test_cpu_noise_quick_runs_as_a_user_runs_it(tmp_path):
    from tests.test_bench_runs import ok, run_bench, table_rows

    out = ok(run_bench("cpu_noise", "--quick", "--json", str(tmp_path / "n.json"), timeout_s=280))
    rows = table_rows(out, "threads", "background cores", "wall s", "clips/s", "x time at 0 cores", "CPU s")
    assert [r.split()[:2] for r in rows] == [["1", "0.00"], ["1", "0.20"]]
    doc = json.loads((tmp_path / "n.json").read_text())
    assert doc["quick"] and (doc["steps"], doc["rounds"]) == (4, 1) and len(doc["rows"]) == 2
    assert {"threads", "noise_cores", "wall_s", "cpu_s", "clips_per_s", "x_first"} <= set(doc["rows"][0])
