"""The search-quality benchmark (bench/search_quality.py): replay against a hand-made table of a few
configurations, and a record that resumes after it was killed."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from bench import search_quality
from bench.sq_choose import GOAL_BEATS, GOAL_TIME, choose
from bench.sq_record import Grid, record, run_key
from bench.sq_replay import GridSearcher, replay
from bench.sq_report import one_seed_warning, summarise
from bench.sq_strategies import Strategy, options_for, run_strategy
from bench.sq_table import Table
from vidtune.trainer.training.config import TrainConfig
from vidtune.tune.study.space import build_scheduler, build_searcher, objective_for, param_space

REPO_ROOT = Path(__file__).resolve().parents[1]
TABLES_DIR = REPO_ROOT / "bench" / "tables"


def recorded_tables(folder: Path) -> list[Path]:
    """The recorded learning-curve tables in `folder` (a JSON with a grid and runs; the replay
    summaries beside them are not tables)."""
    return [p for p in sorted(folder.glob("*.json")) if {"grid", "runs"} <= set(json.loads(p.read_text()))]


TABLES = recorded_tables(TABLES_DIR)                       # the tables the defaults are judged on
UNJUDGED = recorded_tables(TABLES_DIR / "unjudged")        # recorded, but the goals mean nothing there
MISSED = recorded_tables(TABLES_DIR / "missed")            # judgeable, and the defaults miss a goal there
LRS = (1e-4, 1e-3, 1e-2)
EPOCHS = 4
START_S = 10.0


def acc_curve(batch: int, lr: float, seed: int) -> list[float]:
    """lr 1e-3 best; batch 8 a little better; seeds differ by 0.01; still rising at the last epoch."""
    quality = {1e-4: 0.6, 1e-3: 0.9, 1e-2: 0.7}[lr] + (0.02 if batch == 8 else 0.0)
    return [0.5 + (quality - 0.5) * e / EPOCHS + 0.01 * seed for e in range(1, EPOCHS + 1)]


def make_doc(curve=acc_curve) -> dict:
    runs = []
    for seed in (0, 1):
        for batch in (4, 8):
            for lr in LRS:
                epochs = [{"epoch": e + 1, "val_acc": a, "val_loss": 1 - a, "train_s": 3.0 * batch / 4 + e,
                           "eval_s": 1.0, "clips_per_s": 10.0} for e, a in enumerate(curve(batch, lr, seed))]
                runs.append({"key": run_key(batch, lr, seed), "batch_size": batch, "lr": lr, "seed": seed,
                             "outcome": "trained", "start_s": 0.0, "epochs": epochs})
    grid = {"batch_sizes": [4, 8], "lrs": list(LRS), "seeds": [0, 1], "epochs": EPOCHS}
    return {"grid": grid, "runs": runs}


@pytest.fixture
def table() -> Table:
    return Table(make_doc())


def test_interpolation_in_log_lr(table):
    mid = math.sqrt(1e-3 * 1e-2)     # halfway in log between two grid points
    assert table.curve(8, mid, 0).val_acc[-1] == pytest.approx((0.92 + 0.72) / 2)
    assert table.curve(4, 1e-6, 0) == table.runs[(4, 1e-4, 0)]     # outside the grid: the end's curve


def test_grid_finds_the_known_best(table):
    trace = replay(table, GridSearcher(table.configs, seed=3), None, num_samples=len(table.configs),
                   concurrency=1, table_seed=0, start_cost_s=START_S)
    assert len(trace.trials) == len(table.configs)
    assert trace.steps[-1][1] == pytest.approx(table.best_final_mean)
    best = max(trace.trials, key=lambda t: t.best_acc)
    assert (best.batch_size, best.lr) == (8, 1e-3)


def test_clock_is_epochs_run_plus_start_costs(table):
    for strategy in (Strategy("default"), Strategy("fifo", changes={"early_stop": False, "num_samples": 5})):
        trace = run_strategy(table, strategy, 2, concurrency=1, start_cost_s=START_S)
        expected = sum(START_S + sum(t.curve.epoch_s[:t.epochs_run]) for t in trace.trials)
        assert trace.end_s == pytest.approx(expected)
        for t in trace.trials:
            assert t.ended_s == pytest.approx(t.started_s + START_S + sum(t.curve.epoch_s[:t.epochs_run]))


def test_concurrent_trials_overlap(table):
    trace = run_strategy(table, Strategy("fifo", changes={"early_stop": False, "num_samples": 4}), 0,
                         concurrency=2, start_cost_s=START_S)
    assert trace.trials[1].started_s == 0.0
    busy = sum(t.ended_s - t.started_s for t in trace.trials)
    assert busy / 2 <= trace.end_s < busy


def test_a_seeded_strategy_is_reproducible(table):
    runs = [run_strategy(table, Strategy("default", changes={"num_samples": 6}), 7, concurrency=1,
                         start_cost_s=START_S) for _ in range(2)]
    assert [(t.batch_size, t.lr, t.epochs_run) for t in runs[0].trials] == \
        [(t.batch_size, t.lr, t.epochs_run) for t in runs[1].trials]
    assert runs[0].steps == runs[1].steps


def test_asha_stops_what_its_rules_say(table):
    """Grace 1, reduction factor 2, max_t 4: rungs at epochs 1, 2, 4; a trial is stopped at a rung
    when it is below the median of the trials recorded there before it."""
    opts = options_for(table, Strategy("asha", changes={"grace_period": 1, "reduction_factor": 2}), 0)
    scheduler = build_scheduler(opts)
    objective = objective_for("val_acc")
    scheduler.set_search_properties(objective.metric, objective.mode)
    order = [(4, 1e-3), (4, 1e-4), (8, 1e-3), (4, 1e-2)]      # epoch-1 acc: .60, .525, .605, .55
    searcher = GridSearcher(order, seed=0)
    searcher.queue = list(order)
    trace = replay(table, searcher, scheduler, num_samples=4, concurrency=1, table_seed=0, start_cost_s=0.0)
    # 1st: nobody before it at any rung -> runs to max_t. 2nd: below the 1st at epoch 1 -> stopped.
    # 3rd: above the median of {.60, .525} at epoch 1 and of the 1st at epoch 2 -> runs on.
    # 4th: .55 below the median of {.60, .525, .605} (.60) -> stopped after epoch 1.
    assert [t.epochs_run for t in trace.trials] == [4, 1, 4, 1]


def test_lr_scaling_gives_the_trial_the_scaled_lr(table):
    """Optuna draws the lr for the reference batch (the smallest, 4); a batch-8 trial's config,
    which the table, CSV and MLflow show, holds twice that under linear scaling."""
    opts = options_for(table, Strategy("lin", changes={"space.lr_scaling": "linear", "num_samples": 8}), 1)
    searcher = build_searcher(opts, objective_for("val_acc"), study_name="t")
    searcher.set_search_properties("val_acc", "max", param_space(opts))
    seen = set()
    for i in range(8):
        config = searcher.suggest(str(i))
        drawn = searcher._ot_trials[str(i)].params["lr"]
        assert config["lr"] == pytest.approx(drawn * config["batch_size"] / 4)
        seen.add(config["batch_size"])
    assert seen == {4, 8}


def test_record_resumes_after_a_kill(tmp_path):
    grid = Grid(batch_sizes=(4, 8), lrs=(1e-4, 1e-3), seeds=(0,), epochs=2)
    trained: list[tuple[int, float]] = []

    def fake_trainer(cfg: TrainConfig, index, kill_at: int | None = None):
        if kill_at is not None and len(trained) == kill_at:
            raise KeyboardInterrupt      # the record is killed during this run
        trained.append((cfg.batch_size, cfg.lr))
        yield {"start_s": 0.5}
        for epoch in range(1, cfg.epochs + 1):
            yield {"val_acc": 0.5 + 0.1 * epoch, "val_loss": 0.5, "train_s": 1.0, "eval_s": 0.2,
                   "clips_per_s": 9.0}

    out = tmp_path / "table.json"
    base = TrainConfig()
    with pytest.raises(KeyboardInterrupt):
        record(base, None, grid, out, trainer=lambda c, i: fake_trainer(c, i, kill_at=2), progress=False)
    assert [r["key"] for r in json.loads(out.read_text())["runs"]] == [run_key(*r) for r in grid.runs()[:2]]
    record(base, None, grid, out, trainer=fake_trainer, progress=False)
    doc = json.loads(out.read_text())
    assert [r["key"] for r in doc["runs"]] == [run_key(*r) for r in grid.runs()]
    assert trained == [(b, lr) for b, lr, _ in grid.runs()]       # each run trained once
    assert len(doc["runs"][0]["epochs"]) == 2 and doc["runs"][0]["epochs"][1]["val_acc"] == pytest.approx(0.7)
    assert Table(doc).final_mean(4, 1e-3) == pytest.approx(0.7)
    with pytest.raises(SystemExit, match="another grid"):
        record(base, None, replace(grid, epochs=3), out, trainer=fake_trainer, progress=False)


def curve_trainer(cfg: TrainConfig, index):
    """A stand-in for `train_run` (module level, so a spawned process can import it): the curve of
    `acc_curve`, epoch by epoch."""
    yield {"start_s": 0.5}
    for acc in acc_curve(cfg.batch_size, cfg.lr, cfg.seed)[:cfg.epochs]:
        yield {"val_acc": acc, "val_loss": 1 - acc, "train_s": 1.0, "eval_s": 0.2, "clips_per_s": 9.0}


def test_record_reuses_the_runs_of_an_earlier_grid(tmp_path):
    """A denser grid over the same data copies the runs it shares with the old table and trains
    only the new ones; a table with another epoch count is refused with its path named."""
    old_grid = Grid(batch_sizes=(4,), lrs=(1e-4, 1e-2), seeds=(0,), epochs=EPOCHS)
    old = tmp_path / "old.json"
    record(TrainConfig(), None, old_grid, old, trainer=curve_trainer, progress=False)
    trained: list[float] = []

    def counting_trainer(cfg: TrainConfig, index):
        trained.append(cfg.lr)
        yield from curve_trainer(cfg, index)

    new_grid = replace(old_grid, lrs=LRS)
    doc = record(TrainConfig(), None, new_grid, tmp_path / "new.json", trainer=counting_trainer,
                 progress=False, reuse=old)
    assert trained == [1e-3]                                     # only the lr the old grid lacks
    by_key = {r["key"]: r for r in json.loads((tmp_path / "new.json").read_text())["runs"]}
    assert set(by_key) == {run_key(*r) for r in new_grid.runs()} and doc["grid"]["lrs"] == list(LRS)
    assert by_key[run_key(4, 1e-4, 0)]["reused_from"] == str(old)
    assert "reused_from" not in by_key[run_key(4, 1e-3, 0)]
    assert Table(doc).final_mean(4, 1e-2) == pytest.approx(acc_curve(4, 1e-2, 0)[-1])
    with pytest.raises(SystemExit, match=r"--reuse .*old.json: recorded with another epochs"):
        record(TrainConfig(), None, replace(new_grid, epochs=2), tmp_path / "other.json",
               trainer=curve_trainer, progress=False, reuse=old)
    with pytest.raises(SystemExit, match="no such table"):
        record(TrainConfig(), None, new_grid, tmp_path / "x.json", trainer=curve_trainer,
               progress=False, reuse=tmp_path / "missing.json")


@pytest.mark.slow
def test_record_trains_runs_at_once_in_separate_processes(tmp_path):
    """--jobs 2: every run of the grid trained once, in spawned processes, into one table."""
    grid = Grid(batch_sizes=(4, 8), lrs=LRS, seeds=(0,), epochs=EPOCHS)
    doc = record(TrainConfig(), None, grid, tmp_path / "t.json", trainer=curve_trainer, progress=False,
                 jobs=2, threads=1)
    on_disk = json.loads((tmp_path / "t.json").read_text())
    assert sorted(r["key"] for r in on_disk["runs"]) == sorted(run_key(*r) for r in grid.runs())
    assert Table(doc).final_mean(8, 1e-3) == pytest.approx(acc_curve(8, 1e-3, 0)[-1])


def later_curve(batch: int, lr: float, seed: int) -> list[float]:
    """Another table: lr 1e-2 best, its curve flat until the last epoch (early ranks mislead)."""
    final = {1e-4: 0.6, 1e-3: 0.8, 1e-2: 0.9}[lr]
    return [0.55 if e < EPOCHS else final for e in range(1, EPOCHS + 1)]


def test_replay_cli_writes_per_table_ratios_the_worst_case_and_the_picture(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(make_doc()))
    b.write_text(json.dumps(make_doc(later_curve)))
    out, png = tmp_path / "replay.json", tmp_path / "replay.png"
    assert search_quality.main(["replay", str(a), str(b), "--seeds", "3", "--only",
                                "grid,random+asha,default", "--json", str(out), "--plot", str(png)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["ratios"]) == {"a", "b"} and set(doc["tables"]) == {"a", "b"}
    assert set(doc["ratios"]["a"]) == {"default_time_to_1pt_vs_grid", "default_beats_random_asha"}
    for name in ("a", "b"):        # the grid holds each table's best configuration
        assert doc["tables"][name]["strategies"]["grid"]["reached_share"] == 1.0
    times = {n: r["default_time_to_1pt_vs_grid"] or math.inf for n, r in doc["ratios"].items()}
    assert doc["worst"]["time_table"] == max(times, key=times.get)
    assert png.stat().st_size > 0 and "random+asha" in capsys.readouterr().out


def test_a_file_replay_or_choose_cannot_use_is_named_before_any_replay(tmp_path, capsys):
    """A wrong file among the inputs (a shell glob over bench/tables/ also matches choice.json) is
    refused by name, exit 2, before any replay starts; a `replay --json` output is what `choose`
    takes besides tables, and `replay` refuses it."""
    good = tmp_path / "good.json"
    good.write_text(json.dumps(make_doc()))
    partial = make_doc()
    partial["runs"] = partial["runs"][:-1]
    cases = {"missing.json": None, "notes.json": "not json {",
             "choice.json": {"candidates": {}, "tables": ["a"]}, "partial.json": partial}
    for name, content in cases.items():
        if content is not None:
            (tmp_path / name).write_text(content if isinstance(content, str) else json.dumps(content))
    expected = {"missing.json": "cannot read it", "notes.json": "not JSON",
                "choice.json": "a `choose --json` output", "partial.json": "lacks 1 run(s)"}
    for command in ("replay", "choose"):
        for name, says in expected.items():
            assert search_quality.main([command, str(good), str(tmp_path / name), "--seeds", "1"]) == 2
            err = capsys.readouterr().err
            assert f"{command}: error: {tmp_path / name}: " in err and says in err, err
    later, replayed = tmp_path / "later.json", tmp_path / "replayed.json"
    later.write_text(json.dumps(make_doc(later_curve)))
    assert search_quality.main(["replay", str(good), str(later), "--seeds", "1", "--only",
                                "grid,random+asha,default,share=.4", "--json", str(replayed)]) == 0
    capsys.readouterr()
    assert search_quality.main(["replay", str(replayed), "--seeds", "1"]) == 2
    assert "which only `choose` takes" in capsys.readouterr().err
    assert search_quality.main(["choose", str(good)]) == 2      # leave-one-out needs two tables
    assert "needs two or more" in capsys.readouterr().err
    assert search_quality.main(["choose", str(replayed)]) == 0
    assert "picked over all tables: share=.4" in capsys.readouterr().out


def state_and_parent(stat: Path) -> tuple[str, int] | None:
    """A process's state letter and parent pid from its /proc/PID/stat (None once it is gone)."""
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def children_of(pid: int) -> set[int]:
    """The running processes whose parent is `pid` (from /proc)."""
    return {int(stat.parent.name) for stat in Path("/proc").glob("[0-9]*/stat")
            if (found := state_and_parent(stat)) is not None and found[1] == pid and found[0] != "Z"}


def is_running(pid: int) -> bool:
    """Whether `pid` still runs (a zombie that no one has reaped yet has ended)."""
    found = state_and_parent(Path(f"/proc/{pid}/stat"))
    return found is not None and found[0] != "Z"


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("wait_s", [0.0, 12.0])
def test_killing_a_replay_ends_its_worker_processes(tmp_path, wait_s):
    """`kill -9` of a `replay --jobs 2` (no Ctrl-C to the process group), while its spawned workers
    still import (0 s) and once they replay (12 s): the workers end with it instead of replaying
    on for an hour. ~30 s."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps(make_doc()))
    proc = subprocess.Popen([sys.executable, "-m", "bench.search_quality", "replay", str(path), "--seeds",
                             "100000", "--jobs", "2"], cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        workers: set[int] = set()
        while len(workers) < 3 and time.monotonic() < deadline:   # 2 workers + the resource tracker
            time.sleep(0.2)
            workers = children_of(proc.pid)
        assert len(workers) == 3, "the replay never started its workers"
        time.sleep(wait_s)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(map(is_running, workers)):
        time.sleep(0.5)
    assert not [w for w in workers if is_running(w)], "replay workers outlived their parent"


def lucky_seed_curve(batch: int, lr: float, seed: int) -> list[float]:
    """`acc_curve`, except that three runs of training seed 1 at the lr grid's ends are lucky: 0.97
    from their first epoch, above every run of the best configuration (batch 8 at 1e-3, 0.92 and
    0.93), though their seed means (0.79-0.85) are far below its 0.925."""
    if seed == 1 and lr != 1e-3 and (batch, lr) != (4, 1e-2):
        return [0.97] * EPOCHS
    return acc_curve(batch, lr, seed)


def test_the_replay_says_when_a_verdict_rests_on_one_lucky_run():
    """Per training seed, the share of replays that got within the target: under seed 1 a search
    that meets a lucky run picks it and is judged below the target, so even the grid gets there
    only when batch 8 at 1e-3 comes before the three lucky ones; the console says so. A table
    without such a run gets no note."""
    lucky = Table(make_doc(lucky_seed_curve))
    traces = {"grid": [run_strategy(lucky, Strategy("grid", kind="grid"), seed, concurrency=1,
                                    start_cost_s=START_S) for seed in range(40)]}
    grid_s = lucky.grid_seconds(START_S)
    by_seed = summarise(lucky, traces, grid_s)["strategies"]["grid"]["by_training_seed"]
    assert by_seed["0"] == {"replays": 20, "reached_share": 1.0,
                            "time_to_1pt_vs_grid_median": by_seed["0"]["time_to_1pt_vs_grid_median"]}
    assert by_seed["1"]["replays"] == 20 and by_seed["1"]["reached_share"] < 0.5
    note = one_seed_warning(summarise(lucky, traces, grid_s))
    assert note is not None and "training seed 1 in only" in note and "training seed 0" not in note
    plain = Table(make_doc())
    traces = {"grid": [run_strategy(plain, Strategy("grid", kind="grid"), seed, concurrency=1,
                                    start_cost_s=START_S) for seed in range(4)]}
    assert one_seed_warning(summarise(plain, traces, plain.grid_seconds(START_S))) is None


def test_leave_one_table_out_judges_each_pick_on_the_table_it_was_not_chosen_on():
    """Three tables, three candidates: `steady` meets both goals everywhere, `lucky` is best on two
    tables and fails the third, `slow` never meets the time goal."""
    def entry(time: float, beats: float) -> dict:
        return {"time_to_1pt_vs_grid": {"median": time}, "beats_random_asha_at_30%": beats,
                "reached_share": 0.6}

    perf = {"steady": (0.25, 0.25, 0.25), "lucky": (0.10, 0.10, 0.90), "slow": (0.50, 0.50, 0.50)}
    summaries = {t: {"strategies": {"grid": entry(0.2, 0.5),
                                    **{n: entry(v[i], 0.9) for n, v in perf.items()}}}
                 for i, t in enumerate(("t1", "t2", "t3"))}
    result = choose(summaries)
    assert result["chosen"] == "steady" and result["chosen_meets_goals_everywhere"]
    loo = {r["held_out"]: r for r in result["leave_one_out"]}
    assert loo["t3"]["chosen"] == "lucky" and not loo["t3"]["met"]      # picked on t1, t2; fails t3
    assert loo["t1"]["chosen"] == loo["t2"]["chosen"] == "steady"        # lucky fails one of the others


@pytest.mark.parametrize("epochs,share,brackets,rungs", [
    (6, 0.2, 1, [[1, 2, 4]]),                  # grace round(1.2) = 1
    (8, 0.3, 1, [[2, 4, 8]]),                  # grace round(2.4) = 2
    (5, 0.5, 2, [[3]]),                        # grace 2.5 rounds half up to 3; bracket 2 would start at 6
    (4, 0.2, 3, [[1, 2, 4], [2, 4]]),          # a third bracket would start at max_t: dropped
])
def test_grace_share_and_brackets_give_asha_its_rungs(table, epochs, share, brackets, rungs):
    opts = replace(options_for(table, Strategy("x", changes={"grace_period": None, "grace_share": share,
                                                             "asha_brackets": brackets}), 0),
                   train=TrainConfig().with_overrides(epochs=epochs))
    sched = build_scheduler(opts)
    assert [sorted(m for m, _ in b._rungs) for b in sched._brackets] == rungs


def test_there_are_tables_of_several_kinds():
    """Issue 29: the defaults are judged on tables that differ in what shapes a learning curve."""
    docs = [json.loads(p.read_text()) for p in TABLES + UNJUDGED + MISSED]
    assert len(docs) >= 4
    assert len({d["model"] for d in docs}) >= 2 and len({d["grid"]["epochs"] for d in docs}) >= 3
    assert len({d["dataset"]["synthetic"]["seed"] for d in docs}) == len(docs)
    assert len({d["dataset"]["val_videos"] for d in docs}) >= 2
    assert len(TABLES) >= 1


@pytest.mark.parametrize("path", TABLES + MISSED, ids=[p.stem for p in TABLES + MISSED])
def test_the_checked_in_table_is_one_the_benchmark_can_judge_by(path):
    """The rules a table must follow for the goals to mean something (`Table.problems`): issue
    17's (at least 200 validation clips, both ends of the lr grid clearly worse than the best at
    every batch size, curves that still differ at the end) and issue 29's plateau (the lrs judged
    within 1 point of the best, interpolated as the replay reads them, span a quarter decade)."""
    assert Table.load(path).problems() == []


@pytest.mark.parametrize("path", UNJUDGED, ids=[p.stem for p in UNJUDGED])
def test_an_unjudged_table_breaks_a_rule(path):
    """bench/tables/unjudged holds recorded tables the goals are not checked on: each for a
    reason a rule names (docs/search-defaults.md says which), never only because the defaults miss there."""
    assert Table.load(path).problems() != []


# Replay seeds the goals are judged on, as the defaults were chosen (docs/search-defaults.md): with 20, the
# median time to within 1 point moved from 25 % to 36 % of the grid's on one table between seed
# counts (a median over few seeds of a two-humped distribution: seeds that find the top early and
# seeds that find it late), so 20 judged noise.
GOAL_SEEDS = 100


def replay_defaults(tables: list[Path], out: Path) -> dict:
    """`replay --json` of the defaults beside random + ASHA on `tables`, GOAL_SEEDS seeds: the JSON
    it writes (per-table `ratios`, `worst`)."""
    assert search_quality.main(["replay", *map(str, tables), "--seeds", str(GOAL_SEEDS), "--jobs", "2",
                                "--only", "default,random+asha", "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_the_default_search_meets_its_goals_on_every_checked_in_table(tmp_path, capsys):
    """The defaults were chosen by leave-one-table-out replays (docs/search-defaults.md): on
    every checked-in table the default comes within 1 point of the grid's best in <= 30 % of the
    grid's device time (median of GOAL_SEEDS seeds) and is at least as good as random + ASHA at
    30 % in >= 75 % of seeds. A change of defaults that breaks either on any table fails here.
    Slow: ~20 s per table on 2 cores."""
    doc = replay_defaults(TABLES, tmp_path / "replay.json")
    assert set(doc["ratios"]) == {p.stem for p in TABLES}
    for name, ratios in doc["ratios"].items():
        assert (ratios["default_time_to_1pt_vs_grid"] or math.inf) <= GOAL_TIME, (name, ratios)  # None: never
        assert ratios["default_beats_random_asha"] >= GOAL_BEATS, (name, ratios)
    worst, per_table = doc["worst"], doc["ratios"].values()
    slowest = max(r["default_time_to_1pt_vs_grid"] or math.inf for r in per_table)
    assert (worst["default_time_to_1pt_vs_grid"] or math.inf) == slowest
    assert worst["default_beats_random_asha"] == min(r["default_beats_random_asha"] for r in per_table)


# What the defaults get on each table of bench/tables/missed, 100 replay seeds (docs/search-defaults.md,
# "Where the defaults miss"): median time to within 1 point as a share of the grid's
# time, and the share of seeds at least as good as random + ASHA at 30 %. No candidate met both
# goals on the first; the second was recorded after that and judged the same defaults unseen.
KNOWN_MISSES = {"tiny-s6fps12px64-e7-lr11": {"time": 0.35, "beats": 0.71},
                "tiny-s8crf22px64fps10-val398-e5-lr11": {"time": 0.34, "beats": 0.85}}


@pytest.mark.slow
def test_where_the_defaults_miss_they_do_no_worse_than_recorded(tmp_path):
    """bench/tables/missed holds judgeable tables on which no candidate of the benchmark met both
    goals, the defaults included. docs/search.md quotes them. Each is replayed with the
    defaults: a change that does worse there fails, and so does one that meets both goals there
    (the table then belongs in bench/tables/, where the goals are enforced). ~15 s."""
    assert {p.stem for p in MISSED} == set(KNOWN_MISSES), "a table in missed/ needs its KNOWN_MISSES entry"
    for name, ratios in replay_defaults(MISSED, tmp_path / "replay.json")["ratios"].items():
        time, beats = ratios["default_time_to_1pt_vs_grid"] or math.inf, ratios["default_beats_random_asha"]
        recorded = KNOWN_MISSES[name]
        assert time <= recorded["time"] + 0.005 and beats >= recorded["beats"] - 0.005, (name, ratios)
        assert time > GOAL_TIME or beats < GOAL_BEATS, f"{name} meets both goals: move it to bench/tables/"
