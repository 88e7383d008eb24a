"""vidtune from Python (`vidtune.api`): keywords read as the flags are, errors
raised naming the keyword, a search's folder read back as a SearchResult, and, on the session's
smoke search (a `vidtune search` process long gone), the result equal to what that search wrote
and printed, its best model scoring videos, and its best trial trained again from Python."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

import vidtune
from vidtune.errors import ConfigError, DataError, SearchInterrupted, VidtuneError

# -- import vidtune stays light --------------------------------------------------------------------


def test_import_vidtune_loads_no_torch_ray_or_pandas_until_an_api_name_is_used():
    code = ("import sys, vidtune; heavy = [m for m in ('torch', 'ray', 'pandas', 'mlflow') if m in "
            "sys.modules]; print(heavy, callable(vidtune.search), 'vidtune.api.calls' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[] True True"
    with pytest.raises(AttributeError, match="no attribute 'serch'"):
        vidtune.serch    # noqa: B018


def test_every_api_name_resolves():
    for name in vidtune.__all__:
        assert getattr(vidtune, name) is not None, name
    assert issubclass(vidtune.errors.ConfigError, VidtuneError)
    assert issubclass(SearchInterrupted, KeyboardInterrupt)


# -- keywords: the flags' names, types and checks; errors name the keyword ------------------------

def test_keywords_are_the_flags_with_underscores(tmp_path):
    from vidtune.api.keywords import keyword_values
    from vidtune.tune.config.options import SPECS, resolve

    values = keyword_values("vidtune.search", SPECS, {
        "data": tmp_path, "num_samples": 3, "batch_sizes": (4, 8), "lr_max": 1, "early_stop": False,
        "no_log_model": True, "mlflow_uri": "sqlite:///x.db"})
    assert values == {"train.data.root": str(tmp_path), "num_samples": 3, "space.batch_sizes": (4, 8),
                      "space.lr_max": 1.0, "early_stop": False, "tracking.log_model": False,
                      "tracking.mlflow_uri": "sqlite:///x.db"}
    opts = resolve(values)
    assert opts.num_samples == 3 and opts.space.batch_sizes == (4, 8) and not opts.early_stop
    # the same defaults and presets as the command: no data is the demo's preset
    assert resolve({}).num_samples == 4 and resolve({"smoke_test": True}).num_samples == 2


@pytest.mark.parametrize("keywords, says", [
    ({"num_sample": 3}, "num_sample: vidtune.search() has no option 'num_sample' (did you mean "
                        "num_samples?)"),
    ({"lr_min": -1}, "lr_min (--lr-min): got -1.0; it must be a number > 0"),
    ({"lr_min": "small"}, "lr_min (--lr-min): got 'small'; give a number"),
    ({"batch_sizes": "x"}, "batch_sizes (--batch-sizes): 'x' is not a comma-separated list of integers"),
    ({"batch_sizes": [4, 0]}, "batch_sizes (--batch-sizes): got 4,0; it must be"),
    ({"early_stop": "no"}, "early_stop (--no-early-stop): got 'no'; give true or false"),
    ({"objective": "speed"}, "objective (--objective): got 'speed'; choose one of val_acc, val_f1, pareto"),
    ({"epochs": 2, "grace_period": 3}, "grace_period (--grace-period): 3 is above --epochs 2"),
    ({"model": "tiny", "num_samples": None}, "num_samples (--num-samples): got None; give a value"),
    ({"data": "/no/such/folder"}, "data (--data): /no/such/folder does not exist"),
    ({"name": "../x"}, "name (--name): '../x' is not a folder name"),
    ({"verbose": True, "quiet": True}, "verbose/quiet (--verbose/--quiet): give one of them, not both"),
])
def test_a_bad_keyword_raises_config_error_naming_it_before_ray(keywords, says, no_ray):
    with pytest.raises(ConfigError) as caught:
        vidtune.search(**keywords)
    assert str(caught.value).startswith(says), caught.value


def test_a_config_file_is_read_and_keywords_win(tmp_path, no_ray):
    file = tmp_path / "search.toml"
    file.write_text("num-samples = 5\nlr-min = -1\n")
    with pytest.raises(ConfigError, match=r"set by lr-min in .*search.toml"):
        vidtune.search(config=file)
    with pytest.raises(ConfigError, match=r"^lr_min/lr_max \(--lr-min/--lr-max\): the bounds are inverted"):
        vidtune.search(config=file, lr_min=0.5, lr_max=0.1)


def _factory(num_classes: int = 2):
    raise AssertionError("never built: the reference alone is tested")


def test_a_model_function_is_recorded_by_its_importable_name():
    from vidtune.api.keywords import model_reference

    assert model_reference("tiny") == "tiny"
    assert model_reference(_factory) == f"{__name__}:_factory"
    main = type(_factory)(_factory.__code__, {"__name__": "__main__"}, "build")
    main.__module__ = "__main__"
    with pytest.raises(ConfigError, match=r"^model: 'build' is defined in a notebook cell or a script.*"
                                          r"model='mymodels:build'"):
        model_reference(main)
    with pytest.raises(ConfigError, match=r"^model: 'inner' .*put the factory in a module file"):
        def inner(num_classes: int = 2):
            return None
        model_reference(inner)    # <locals> in its qualified name: not importable
    with pytest.raises(ConfigError, match="^model: got int"):
        model_reference(3)
    assert model_reference(Factories.build) == f"{__name__}:Factories.build"   # as the command takes it


class Factories:
    @staticmethod
    def build(num_classes: int = 2):
        raise AssertionError("never built")


# -- a search's folder read back -------------------------------------------------------------------

def _search_folder(tmp_path: Path, *, interrupted: bool = False, best: bool = True) -> Path:
    """A search's folder as the search writes it: trials.csv, best_config.json, search.json."""
    folder = tmp_path / "vidtune-results" / "s1"
    folder.mkdir(parents=True)
    (folder / "trials.csv").write_text(
        "name,trial_id,status,batch_size,lr,best_val_acc,best_epoch,speed_clips_per_s,checkpoint\n"
        "t02-bs8-lr1e-3,b2,DONE,8,0.001,0.8125,2,30.5,/x/ckpt2\n"
        f"t01-bs4-lr3e-4,a1,{'UNFINISHED' if interrupted else 'DONE'},4,0.0003,0.5,1,20.25,/x/ckpt1\n")
    if best:
        (folder / "best_config.json").write_text(json.dumps({
            "trial_id": "b2", "name": "t02-bs8-lr1e-3", "batch_size": 8, "lr": 0.001, "best_val_acc": 0.8125,
            "best_val_f1": 0.8, "speed_clips_per_s": 30.5, "epoch_time_s": 2.0, "epochs": 2, "status": "DONE",
            "checkpoint": "/x/ckpt2", "node_id": None, "best_epoch": 2,
            "params": {"batch_size": 8, "lr": 0.001}, "objective": "val_acc", "search": "s1",
            "train_config": {"batch_size": 8, "lr": 0.001, "model": "tiny"},
            "checkpoint_trial": "t02-bs8-lr1e-3", "checkpoint_epoch": 2, "checkpoint_val_acc": 0.8125}))
    (folder / "search.json").write_text(json.dumps({
        "format": 1, "name": "s1", "path": str(folder), "objective": "val_acc",
        "exit_code": 130 if interrupted else 0, "interrupted": interrupted, "mlflow_uri": "sqlite:////x/mlruns.db",
        "mlflow_url": "http://127.0.0.1:5000/#/experiments/1/runs?a=<b>", "model_uri": "models:/rwf/3",
        "answer": ["Best: t02-bs8-lr1e-3 (batch 8, lr 1.00e-03), val_acc 0.812 <at> epoch 2."]}))
    return folder


def test_load_reads_a_search_folder_into_a_typed_result(tmp_path):
    folder = _search_folder(tmp_path)
    result = vidtune.load(folder)
    assert isinstance(result, vidtune.SearchResult) and result.path == folder.resolve()
    pd.testing.assert_frame_equal(result.trials, pd.read_csv(folder / "trials.csv"))
    best = result.best
    assert isinstance(best, vidtune.TrialResult)
    assert (best.label, best.batch_size, best.lr, best.val_acc, best.val_f1, best.clips_per_s,
            best.best_epoch) == ("t02-bs8-lr1e-3", 8, 0.001, 0.8125, 0.8, 30.5, 2)
    assert best.params == {"batch_size": 8, "lr": 0.001} and best.checkpoint == "/x/ckpt2"
    assert math.isnan(best.concurrent_trainings)       # not in the file: the field's default
    assert result.best_config == {"batch_size": 8, "lr": 0.001, "model": "tiny"}
    assert (result.best_checkpoint, result.model_uri, result.mlflow_uri, result.interrupted) == \
        ("/x/ckpt2", "models:/rwf/3", "sqlite:////x/mlruns.db", False)
    assert result.best_config_file == folder.resolve() / "best_config.json"
    assert repr(result).startswith("SearchResult('s1': 2 trial(s), best t02-bs8-lr1e-3 (batch 8, lr 0.001)")
    page = result._repr_html_()
    # the answer (escaped), the table, the links
    assert "val_acc 0.812 &lt;at&gt; epoch 2." in page and "<table" in page and "t01-bs4-lr3e-4" in page
    assert 'href="http://127.0.0.1:5000/#/experiments/1/runs?a=&lt;b&gt;"' in page
    assert "models:/rwf/3" in page and "vidtune.ui(result)" in page


def test_load_of_an_interrupted_search_says_so(tmp_path):
    result = vidtune.load(_search_folder(tmp_path, interrupted=True, best=False))
    assert result.interrupted and result.best is None and result.best_config_file is None
    assert "resume=True" in result._repr_html_() and "no best trial" in repr(result)


@pytest.mark.parametrize("make, says", [
    (lambda p: p / "nothing", "is not a folder; pass the search's folder"),
    (lambda p: p, "it is not a search's folder (no trials.csv)"),
    (lambda p: (p / "ray").mkdir() or p, "has not finished a summary yet"),
    (lambda p: _broken_record(p), "search.json cannot be read"),
])
def test_load_of_a_folder_without_a_search_names_it(tmp_path, make, says):
    with pytest.raises(ConfigError, match=re.escape(says)) as caught:
        vidtune.load(make(tmp_path))
    assert caught.value.flag == "path"


def _broken_record(tmp_path: Path) -> Path:
    folder = _search_folder(tmp_path)
    (folder / "search.json").write_text("{cut")
    return folder


def test_load_of_remote_storage_says_where_the_results_are():
    with pytest.raises(ConfigError, match=r"reads a local folder; a search on remote storage leaves a local "
                                          r"copy of its results in .*vidtune-results/<name>.*MLflow run"):
        vidtune.load("s3://bucket/searches/s1")


def test_a_search_on_remote_storage_keeps_a_local_copy_of_its_results(tmp_path, monkeypatch):
    """--storage s3://...: trials.csv, best_config.json and search.json go to a local folder named
    after the search (and to MLflow), which `vidtune.search` returns as the result's path."""
    from vidtune.tune import summary
    from vidtune.tune.config.options import parse_options
    from vidtune.tune.preflight import Plan

    monkeypatch.setattr(summary, "REMOTE_COPIES", tmp_path / "copies")
    opts = parse_options(["--smoke-test"])
    remote = Plan(opts=opts, base=opts.train, storage="s3://bucket/searches", name="s1", demo=False)
    copy = tmp_path / "copies" / "s1"
    assert summary.results_folder(remote) == copy and copy.is_dir()
    local = Plan(opts=opts, base=opts.train, storage=str(tmp_path), name="s2", demo=False)
    assert summary.results_folder(local) is None          # not made yet: the search makes its folder
    (tmp_path / "s2").mkdir()
    assert summary.results_folder(local) == tmp_path / "s2"


def test_predict_refuses_what_is_not_a_model(tmp_path):
    with pytest.raises(ConfigError, match="^on_error: got 'skip'"):
        vidtune.predict("x", [], on_error="skip")
    with pytest.raises(ConfigError, match="^model: got int"):
        vidtune.predict(3, [])
    with pytest.raises(ConfigError, match=r"^model: .*nothing"):
        vidtune.predict(tmp_path / "nothing", ["a.mp4"])
    no_checkpoint = vidtune.load(_search_folder(tmp_path))
    object.__setattr__(no_checkpoint, "model_uri", None)
    with pytest.raises(ConfigError, match="has no best checkpoint left"):
        vidtune.predict(no_checkpoint, ["a.mp4"])


# -- the session's smoke search, read back and used from Python -------------------------------------

@pytest.mark.slow
def test_the_smoke_search_loads_as_printed_and_its_best_model_scores_videos(smoke_search, synthetic_root):
    """The smoke search's process is gone: `vidtune.load` gives its trials.csv as a DataFrame, its
    best trial as the console's Best: line names it, and the model the summary printed; the best
    checkpoint scores three validation videos; a missing one raises DataError naming it."""
    assert smoke_search.returncode == 0, smoke_search.stderr
    result = vidtune.load(smoke_search.results)
    pd.testing.assert_frame_equal(result.trials, pd.read_csv(smoke_search.results / "trials.csv"))
    best = re.search(r"^Best: (\S+) \(batch (\d+), lr (\S+)\), val_acc ([0-9.]+)", smoke_search.stdout, re.M)
    assert best, smoke_search.stdout
    assert (result.best.label, result.best.batch_size, f"{result.best.val_acc:.3f}") == \
        (best.group(1), int(best.group(2)), best.group(4))
    assert result.answer[0] == best.group(0) + smoke_search.stdout.split(best.group(0), 1)[1].split("\n")[0]
    assert f"best model: {result.model_uri} (" in smoke_search.stdout and result.model_uri.startswith(
        "models:/rwf-tiny/")
    assert result.mlflow_url and result.mlflow_url in smoke_search.stdout
    assert result.mlflow_uri == smoke_search.uri and not result.interrupted
    assert result.best_checkpoint == smoke_search.checkpoint

    videos = sorted((synthetic_root / "val").rglob("*.mp4"))[:3]
    scores = vidtune.predict(result, videos)
    assert list(scores.index) == [str(v) for v in videos] and scores.name == "P(Fight)"
    assert all(0.0 <= s <= 1.0 for s in scores), scores
    with pytest.raises(DataError, match=r"1 of 2 video\(s\) could not be scored: .*gone\.mp4.*on_error="):
        vidtune.predict(result, [videos[0], synthetic_root / "gone.mp4"])


@pytest.mark.slow
def test_train_retrains_the_smoke_searchs_best_trial(smoke_search, ray_session, tmp_path, capsys):
    """`vidtune.train(config=result)`: the best trial's whole configuration trained again (the
    command's `--config best_config.json`), keywords overriding it; a TrainResult with its history."""
    result = vidtune.load(smoke_search.results)
    run = vidtune.train(config=result, storage=str(tmp_path), name="again", loader_workers=0)
    out = capsys.readouterr().out
    assert out.startswith(f"config: {result.best_config_file} (the best trial {result.best.label} of search "
                          f"{result.name}"), out
    assert re.search(r"^epoch 1/1  train_loss ", out, flags=re.M), out
    assert isinstance(run, vidtune.TrainResult) and run.name == "again" and run.epoch == 1
    checkpoint = Path(run.checkpoint)
    assert (checkpoint / "checkpoint.pt").is_file() and checkpoint.is_relative_to(tmp_path)
    assert list(run.history["epoch"]) == [1] and run.history["val_acc"].iloc[0] == pytest.approx(run.val_acc)
    assert run.history["batch_size"].iloc[0] == result.best.batch_size
    with pytest.raises(ConfigError, match=r"^batch_size \(--batch-size\): got 0"):
        vidtune.train(config=result, batch_size=0, storage=str(tmp_path))


def test_a_search_puts_back_the_sigint_handler_it_found():
    """A notebook kernel handles its interrupt button itself: the search's Ctrl-C handling
    (`tune.running.faults.install`) gives SIGINT and SIGTERM back as it found them."""
    import signal

    from vidtune.tune.running import faults

    def kernels(signum, frame):
        return None

    before = signal.signal(signal.SIGINT, kernels)
    sigterm = signal.getsignal(signal.SIGTERM)   # Ray's, when this process has started one
    try:
        faults.install()
        assert signal.getsignal(signal.SIGINT) is faults._on_signal
        faults.uninstall()
        assert signal.getsignal(signal.SIGINT) is kernels
        assert signal.getsignal(signal.SIGTERM) is sigterm
    finally:
        signal.signal(signal.SIGINT, before)


def test_the_summary_counts_the_searchs_own_time_not_the_processs(tmp_path, capsys):
    """A notebook's kernel outlives its searches: "N trials in T" is the search's time."""
    import time
    from types import SimpleNamespace

    from vidtune.tune.config.options import parse_options
    from vidtune.tune.outputs.found import Summary
    from vidtune.tune.preflight import Plan
    from vidtune.tune.summary import print_summary

    opts = parse_options(["--smoke-test", "--storage", str(tmp_path), "--name", "s"])
    plan = Plan(opts=opts, base=opts.train, storage=str(tmp_path), name="s", demo=False,
                started_at=time.time() - 75)
    summary = Summary(objective="val_acc", rows=[], trials=[], trial_states=[], interrupted=False,
                      val_clips=0, answer=[], best=None, checkpoint=None,
                      importance=SimpleNamespace(shares={}, sentence=lambda: ""), files={})
    print_summary(plan, opts, summary, mlflow_links="", pending=None)
    assert re.search(r"^0 trials in 1m1[56]s", capsys.readouterr().out, flags=re.M)


def test_a_dry_run_checks_prints_and_returns_none(synthetic_root, tmp_path, capsys, no_ray):
    """`dry_run=True`, as `--dry-run`: everything checked on the driver, the resolved configuration
    printed, nothing run (no Ray, no search folder)."""
    assert vidtune.search(data=synthetic_root, smoke_test=True, storage=tmp_path / "results",
                          dry_run=True) is None
    out = capsys.readouterr().out
    assert "dry run: everything checked" in out and str(synthetic_root) in out
    assert not (tmp_path / "results").exists() or not any((tmp_path / "results").iterdir())
