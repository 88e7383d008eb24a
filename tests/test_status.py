"""vidtune.tune.outputs.status: a trial's outcome declared once, read by the console, the table's legend,
MLflow's outcome tag and the Optuna study."""
from __future__ import annotations

from tests.test_console import _row
from vidtune.tune.outputs import console, tables
from vidtune.tune.outputs.results import STATUSES
from vidtune.tune.outputs.status import Status, word_of
from vidtune.tune.tracking.schema import OUTCOMES


def test_each_output_reads_the_status_words_from_the_one_declaration():
    assert STATUSES == tuple(Status) and all(isinstance(s, str) for s in STATUSES)
    assert OUTCOMES == {s.value: s.word for s in Status} and OUTCOMES["STOPPED"] == "stopped early"
    rows = [_row(f"t{i}", s) for i, s in enumerate(Status)]
    count = console.outcome_line(rows, 60.0)
    assert all(f"1 {s.word}" in count for s in Status), count
    legend = " ".join(line.strip() for line in tables.column_notes(rows, width=1000))
    assert all(f"{s.value} = {s.meaning}" in legend for s in Status), legend


def test_a_status_is_its_plain_name_where_one_is_written_or_compared():
    assert Status.DONE == "DONE" and f"{Status.OOM}" == "OOM" and {"ERROR": 1}[Status.ERROR] == 1
    assert Status("DIVERGED") is Status.DIVERGED
    assert word_of("UNFINISHED") == "interrupted" and word_of("RUNNING") == "running"   # Tune's own
