"""Where a search's files go (`vidtune.tune.config.layout`): the user's files at the top of its folder,
Ray Tune's state in its `ray` subfolder, and a search of the old layout (Tune's state at the
top) found where it is."""
from __future__ import annotations

import pytest

from vidtune.flags import ConfigError
from vidtune.tune.config import layout
from vidtune.tune.config.options import parse_options
from vidtune.tune.preflight import Plan
from vidtune.tune.running.faults import failure_file


def test_a_new_search_keeps_tunes_state_in_its_subfolder(tmp_path):
    search = layout.search_path(str(tmp_path), "s")
    assert layout.state_path(search) == f"{search}/ray"
    assert layout.search_of(layout.state_path(search)) == search
    opts = parse_options(["--smoke-test", "--storage", str(tmp_path), "--name", "s"])
    plan = Plan(opts=opts, base=None, storage=str(tmp_path), name="s", demo=False)
    assert (plan.search_path, plan.experiment_path, plan.tune_name) == (search, f"{search}/ray", "s/ray")
    # a failed trial's traceback is the user's: at the top, whichever folder names the search
    assert failure_file(plan.experiment_path, "t01") == failure_file(search, "t01") == \
        tmp_path / "s" / "failures" / "t01.txt"


def test_a_search_of_the_old_layout_is_found_where_tune_left_it(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    (old / "tuner.pkl").write_bytes(b"")
    assert layout.state_path(str(old)) == str(old)
    (old / "ray").mkdir()                            # a new layout's subfolder wins
    assert layout.state_path(str(old)) == f"{old}/ray"
    assert layout.state_path("s3://bucket/runs/s") == "s3://bucket/runs/s/ray"


def test_a_search_cannot_be_named_like_the_state_subfolder():
    with pytest.raises(ConfigError, match="--name.*'ray' is the name of the subfolder"):
        parse_options(["--smoke-test", "--name", "ray"])
