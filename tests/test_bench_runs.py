"""Every benchmark a person runs, run end to end in its quick mode as a user runs it
(`python -m bench.NAME --quick --json FILE` from the repository root, in a fresh interpreter), so
a layout or API change that breaks one fails here: each must print its table (header and at
least one row) and write the JSON keys its readers use. The benchmarks with a test file of their
own run there (tests/test_bench_cpu_noise.py, test_bench_index_hashing.py, test_bench_gpu.py);
bench/cpu_usage.py, learning_check.py, gpu_decode.py and sq_*.py are modules the scripts import."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_bench(name: str, *argv: str, timeout_s: float) -> subprocess.CompletedProcess:
    """`python -m bench.NAME ARGV` from the repository root. Without RAY_ADDRESS: a bench that
    starts Ray starts its own, as on a user's machine (not another test's)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, "-m", f"bench.{name}", *argv], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout_s)


def table_rows(out: str, *columns: str) -> list[str]:
    """The rows under the first header line naming all `columns` in that order, ruled by a line of
    dashes beneath it; fails (with the output) when there is no such table or it has no row."""
    def names_all(line: str) -> bool:        # each column after the one before it
        at = 0
        for column in columns:
            at = line.find(column, at)
            if at < 0:
                return False
            at += len(column)
        return True

    lines = out.splitlines()
    for i, line in enumerate(lines):
        if names_all(line) and i + 1 < len(lines) and set(lines[i + 1]) <= {"-", " "} and "-" in lines[i + 1]:
            rows = []
            for row in lines[i + 2:]:
                if not row.strip():
                    break
                rows.append(row)
            assert rows, f"table {columns} has no row:\n{out}"
            return rows
    raise AssertionError(f"no table with columns {columns} in:\n{out}")


def ok(proc: subprocess.CompletedProcess) -> str:
    """The stdout of a run that exited 0 (else fail with its output)."""
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_data_loading_quick(tmp_path):
    out = ok(run_bench("data_loading", "--quick", "--json", str(tmp_path / "d.json"), timeout_s=380))
    rows = table_rows(out, "size", "T", "reader", "clips/s", "first_s")
    assert [r.split()[2] for r in rows] == ["Dataset[i]", "DataLoader,", "DataLoader,"]   # workers 0 and 1
    assert table_rows(out, "corpus", "reader", "clips/s", "x decord", "cpu/s")
    doc = json.loads((tmp_path / "d.json").read_text())
    assert {"rows", "ratios", "disk"} <= set(doc) and doc["ratios"]["warm_cache_vs_decord"] > 0
    assert {r["table"] for r in doc["rows"]} == {"decode", "cache"}


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_trial_overhead_quick(tmp_path):
    out = ok(run_bench("trial_overhead", "--quick", "--json", str(tmp_path / "t.json"), timeout_s=480))
    rows = table_rows(out, "step", "mean_s", "min_s", "max_s", "n")
    assert any(r.startswith("ray.init (local, 2 CPUs)") for r in rows)     # its own Ray, not joined
    assert any("trainer.fit -> worker function starts" in r for r in rows)
    doc = json.loads((tmp_path / "t.json").read_text())
    fit = [v for k, v in doc.items()
           if k.startswith("vidtune's TorchTrainer") and k.endswith("trainer.fit total")]
    assert len(fit) == 1 and fit[0]["seconds"] == [fit[0]["mean"]] and fit[0]["mean"] > 0   # one repetition


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_search_overhead_quick(tmp_path):
    """The search and the plain run of the trials it drew: issue 40 found this exiting 1 after a
    search that succeeded (Tune's trial folders had moved into the search folder's ray/)."""
    out = ok(run_bench("search_overhead", "--quick", "--json", str(tmp_path / "o.json"), timeout_s=870))
    rows = table_rows(out, "seconds", "plain", "search", "search-plain")
    assert rows[0].startswith("wall time")
    assert len(table_rows(out, "trial", "batch", "lr", "epochs", "train_s", "total_s")) == 4   # 2 per side
    assert "ratio search / plain wall time:" in out
    doc = json.loads((tmp_path / "o.json").read_text())
    assert doc["preset"] == "quick" and doc["trials"] == 2 and doc["ratio"] > 0
    assert len(doc["plain_trials"]) == len(doc["search_trials"]) == 2
    wall = next(r for r in doc["rows"] if r["name"] == "wall_s")
    assert wall["search_s"] / wall["plain_s"] == pytest.approx(doc["ratio"])
    assert all(len(t["epochs"]) == 1 for t in doc["search_trials"] + doc["plain_trials"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_search_quality_record_then_replay_quick(tmp_path):
    """`record --quick` trains its small grid on a generated dataset (what `vidtune synth` makes);
    `replay --quick` replays the strategies on that table and a checked-in one."""
    from vidtune.datasets.synthetic import generate

    data = generate(tmp_path / "videos", videos=12, size=64, seed=0)
    table = tmp_path / "t.json"
    out = ok(run_bench("search_quality", "record", "--quick", "--data", str(data), "--out", str(table),
                       "--no-progress", "--cache-dir", str(tmp_path / "clips"), timeout_s=300))
    assert f"2 runs in {table}" in out
    doc = json.loads(table.read_text())
    assert doc["grid"]["batch_sizes"] == [4] and doc["grid"]["seeds"] == [0] and doc["grid"]["epochs"] == 2
    assert len(doc["runs"]) == 2 and all(len(r["epochs"]) == 2 for r in doc["runs"])
    checked_in = REPO_ROOT / "bench" / "tables" / "tiny-synth480-lr11.json"
    out = ok(run_bench("search_quality", "replay", str(table), str(checked_in), "--quick",
                       "--json", str(tmp_path / "r.json"), timeout_s=240))
    rows = table_rows(out, "strategy", "target q1", "median", "q3", "reached", "trials")
    assert [r.split()[0] for r in rows] == ["grid", "random", "random+asha", "default", "share=.4"]
    replay = json.loads((tmp_path / "r.json").read_text())
    assert replay["seeds"] == 2 and set(replay["tables"]) == {"t", "tiny-synth480-lr11"}
    assert {"default_time_to_1pt_vs_grid", "default_beats_random_asha"} <= set(replay["worst"])
