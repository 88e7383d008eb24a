"""bench/index_hashing.py: its table and JSON from a short run, and its flag checks."""
from __future__ import annotations

import json

import pytest

from bench import index_hashing


def test_index_hashing_times_each_case_and_writes_json(capsys, tmp_path):
    out = tmp_path / "hashing.json"
    assert index_hashing.main(["--files", "3", "--mb", "0.05", "--repeats", "1", "--dir", str(tmp_path),
                               "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "x plain read" in table and "sha256 of every file" in table
    rows = {r["case"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["plain read of every byte"]["x_plain_read"] == 1.0
    assert rows["index dedupe, distinct sizes (nothing hashed)"]["bytes_hashed"] == 0
    assert rows["index dedupe, one size (everything hashed)"]["bytes_hashed"] == 3 * 50_000
    assert not list(tmp_path.glob("vidtune-hashing-*"))      # its files are gone


@pytest.mark.parametrize("argv, flag", [(["--files", "0"], "--files 0"), (["--mb", "0"], "--mb 0"),
                                        (["--repeats", "0"], "--repeats 0")])
def test_index_hashing_rejects_bad_flags_naming_them(argv, flag):
    with pytest.raises(SystemExit, match=flag):
        index_hashing.main(argv)


@pytest.mark.slow        # a fresh interpreter
@pytest.mark.timeout(120)
def test_index_hashing_quick_runs_as_a_user_runs_it(tmp_path):
    from tests.test_bench_runs import ok, run_bench, table_rows

    out = ok(run_bench("index_hashing", "--quick", "--json", str(tmp_path / "h.json"), timeout_s=110))
    rows = table_rows(out, "case", "s", "GB/s", "x plain read")
    assert len(rows) == 6 and rows[0].startswith("plain read of every byte")
    doc = json.loads((tmp_path / "h.json").read_text())
    assert (doc["files"], doc["mb"], doc["repeats"], doc["quick"]) == (4, 1.0, 1, True)
    assert doc["rows"][4]["bytes_hashed"] == 4 * 1_000_000 and "machine" in doc
