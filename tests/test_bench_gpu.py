"""The GPU benchmarks' CPU-runnable parts: bench/gpu_check.py (arguments, its refusal without a GPU,
the search it would run, the MLflow checks on a store like the one the search writes) and
bench/gpu_precision.py (which peak a device name matches; a row's tensors are freed before the
next row, also after out of memory or an error)."""
from __future__ import annotations

import argparse
import gc
import json
import weakref
from pathlib import Path

import pytest
import torch
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from bench import gpu_check, gpu_check_results, gpu_check_steps, gpu_flops, gpu_precision
from bench.gpu_check_results import CheckFailed
from vidtune.trainer.models.registry import build_model, get_spec
from vidtune.trainer.training import precision
from vidtune.tune.config.options import parse_options
from vidtune.tune.tracking.schema import GPU_IDS_TAG

# -- bench/gpu_check.py -----------------------------------------------------------------------------


def test_refuses_in_one_line_with_exit_2_without_a_gpu(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--json", str(tmp_path / "out.json")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert "refused" in err and "needs one GPU" in err and f"torch {torch.__version__}" in err
    assert not (tmp_path / "out.json").exists()          # nothing was run


def test_arguments_and_their_bounds():
    args = gpu_check.build_parser().parse_args([])
    assert (args.num_samples, args.epochs, args.json) == (4, 2, None)
    with pytest.raises(SystemExit, match="--epochs 0: must be >= 1"):
        gpu_check.validate(gpu_check.build_parser().parse_args(["--epochs", "0"]))


def test_the_search_it_runs_is_one_the_search_cli_accepts(tmp_path):
    """The flags gpu_check passes parse into the search the issue asks for (no Ray, no GPU)."""
    data = tmp_path / "videos"
    data.mkdir()
    argv = gpu_check_steps.search_argv(gpu_check.build_parser().parse_args([]), data, tmp_path, "gpu-check-1")
    opts = parse_options(argv)
    assert (opts.train.model, opts.train.weights, opts.train.epochs,
            opts.num_samples) == ("mvit_v2_s", "none", 2, 4)
    assert opts.train.precision == "auto" and not opts.early_stop
    assert opts.tracking.mlflow_uri == f"sqlite:///{tmp_path / 'mlruns.db'}"
    assert (opts.train.data.clip_cache_dir == str(tmp_path / "clips")
            and opts.storage == str(tmp_path / "results"))


def _write_search_store(uri: str, trials: int = 4, epochs: int = 2, *, concurrent=None, gpu_ids=None,
                        status: str = "FINISHED", settings=None) -> None:
    """A store shaped like tune/tracking/tracker.py's: one parent run, one child run per trial (params,
    per-epoch metrics at step=epoch), the `gpu_ids` tag."""
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment(gpu_check_steps.EXPERIMENT)
    parent = client.create_run(exp, run_name="search").info.run_id
    for t in range(trials):
        tags = {gpu_check_results.PARENT_TAG: parent, "vidtune.precision_used": "bf16",
                "vidtune.tf32": "matmul=tf32,conv=tf32", "vidtune.cudnn_benchmark": "on",
                "vidtune.device": "NVIDIA H200",
                "vidtune.compute_capability": "9.0", "vidtune.cuda": "13.0", "vidtune.driver": "580.65.06",
                "vidtune.torch": "2.14.1", **(settings or {}).get(t, {})}
        ids = (gpu_ids or {}).get(t, "0")
        if ids is not None:
            tags[GPU_IDS_TAG] = ids
        run = client.create_run(exp, tags=tags, run_name=f"t{t:02d}").info.run_id
        client.log_param(run, "precision", "auto")
        metrics = []
        for epoch in range(1, epochs + 1):
            values = {"clips_per_s": 40.0 + epoch, "peak_mem_mb": 9000.0,
                      "concurrent_trainings": (concurrent or {}).get((t, epoch), 1.0)}
            metrics += [Metric(k, v, 1000 * epoch, epoch) for k, v in values.items()]
        client.log_batch(run, metrics=metrics)
        client.set_terminated(run, status=status if t == trials - 1 else "FINISHED")
    client.set_terminated(parent)


def _check(tmp_path: Path, **store) -> list:
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    _write_search_store(uri, **store)
    runs = gpu_check_results.load_trial_runs(uri, gpu_check_steps.EXPERIMENT)
    return gpu_check_results.run_checks(gpu_check_results.mlflow_steps(runs, 4, 2, capability=(9, 0)))


def test_mlflow_checks_pass_on_a_store_like_the_search_writes(tmp_path):
    checks = _check(tmp_path)
    assert [c.passed for c in checks] == [True] * 7, gpu_check_results.format_checks(checks)
    assert "concurrent_trainings == 1 in all 8 epochs" in gpu_check_results.format_checks(checks)


@pytest.mark.parametrize("store, failed, says", [
    ({"concurrent": {(2, 2): 2.0}}, "one training per GPU", "t02: [1.0, 2.0]"),
    ({"gpu_ids": {1: None}}, "gpu_ids tag", "missing or empty on: t01"),
    ({"status": "FAILED"}, "trials in MLflow", "not FINISHED: t03 FAILED"),
    # a worker that fell back to fp32 on an H200, or never turned cudnn.benchmark on
    ({"settings": {2: {"vidtune.precision_used": "fp32"}}}, "workers' settings",
     "t02: vidtune.precision_used='fp32', expected 'bf16'"),
    ({"settings": {0: {"vidtune.cudnn_benchmark": "off"}}}, "workers' settings",
     "t00: vidtune.cudnn_benchmark"),
    ({"settings": {1: {"vidtune.driver": ""}}}, "workers' settings", "t01: vidtune.driver missing"),
])
def test_mlflow_checks_stop_at_the_first_failure_and_say_what(tmp_path, store, failed, says):
    checks = _check(tmp_path, **store)
    assert checks[-1].name == failed and not checks[-1].passed and says in checks[-1].detail
    assert all(c.passed for c in checks[:-1])


def test_an_unexpected_error_is_the_failed_check_and_nothing_runs_after_it():
    def broken():
        raise ValueError("database is locked")

    checks = gpu_check_results.run_checks([("first", lambda: "ok"), ("second", broken),
                                           ("third", lambda: "never")])
    assert [(c.name, c.passed, c.detail) for c in checks] == [
        ("first", True, "ok"), ("second", False, "ValueError: database is locked")]


def test_device_checks_expect_bf16_from_sm80_and_cudnn_benchmark_on():
    assert "-> bf16" in gpu_check_results.check_auto_precision((9, 0), "bf16")
    assert "-> fp16" in gpu_check_results.check_auto_precision((7, 5), "fp16")     # T4
    with pytest.raises(CheckFailed, match="expected bf16"):
        gpu_check_results.check_auto_precision((8, 0), "fp16")
    with pytest.raises(CheckFailed, match="cudnn.benchmark is False"):
        gpu_check_results.check_cudnn_benchmark(False)


def test_precision_table_check_fails_on_an_errored_row():
    row = {"precision": "bf16", "batch_size": 8, "clips_per_s": 120.0, "peak_mib": 5000.0}
    assert "120 clips/s" in gpu_check_results.check_precision_table({"rows": [row], "device": "H200"})
    with pytest.raises(CheckFailed, match="bf16 batch 8: ERROR RuntimeError"):
        gpu_check_results.check_precision_table({"rows": [{**row, "error": "ERROR RuntimeError"}]})


# -- bench/gpu_precision.py -------------------------------------------------------------------------

@pytest.mark.parametrize("name, key, bf16", [
    ("NVIDIA H200 NVL", "H200 NVL", 835.0),     # its own entry, not the SXM's 989
    ("NVIDIA H200", "H200", 989.0),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756.0),
    ("NVIDIA H100 80GB HBM3", "H100", 989.0),
])
def test_peak_flops_matches_the_most_specific_device_name(monkeypatch, name, key, bf16):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    peak, source = gpu_flops.peak_flops(torch.device("cuda"), "bf16", None)
    assert peak == bf16 * 1e12 and source == f"PEAK_TFLOPS[{key!r}]['bf16']"


@pytest.fixture
def row_setup():
    """The tiny model, a CPU row, and a spy on free_memory that records whether any parameter of
    the row's model copy was still alive when the clean-up ran."""
    alive_at_cleanup: list[bool] = []
    params: list[weakref.ref] = []

    def spy(device):
        gc.collect()
        alive_at_cleanup.append(any(ref() is not None for ref in params))

    return build_model("tiny"), get_spec("tiny"), params, alive_at_cleanup, spy


def _failing_step(params: list, error: type[BaseException], message: str):
    """A train_one_epoch that notes the model's parameters, then raises a new `error` (a new one
    each time: an instance kept here would keep its traceback, and the frames, alive)."""
    def train_one_epoch(model, batches, **run):
        params.extend(weakref.ref(p) for p in model.parameters())
        raise error(message)
    return train_one_epoch


def test_out_of_memory_frees_the_rows_model_and_optimizer_before_the_clean_up(monkeypatch, row_setup):
    model, spec, params, alive_at_cleanup, spy = row_setup
    monkeypatch.setattr(gpu_precision, "train_one_epoch",
                        _failing_step(params, torch.OutOfMemoryError, "CUDA out of memory"))
    monkeypatch.setattr(precision, "free_memory", spy)
    row = gpu_precision.Row("synthetic", "fp32", True, 2)
    with gpu_precision.batches(row, spec, torch.device("cpu"), None, 0, 4) as source:
        assert gpu_precision.measure(model, row, spec, torch.device("cpu"), source, 1, 1) == "OOM"
    assert params and alive_at_cleanup == [False]


def test_a_failed_row_is_freed_after_its_traceback_is_gone(monkeypatch, row_setup):
    model, spec, params, alive_at_cleanup, spy = row_setup
    monkeypatch.setattr(gpu_precision, "train_one_epoch", _failing_step(params, ValueError, "decoder broke"))
    monkeypatch.setattr(precision, "free_memory", spy)
    args = argparse.Namespace(warmup_steps=1, steps=1, loader_workers=0, max_seconds=1e9, peak_tflops=None)
    done, skipped = gpu_precision.run_rows([gpu_precision.Row("synthetic", "fp32", True, 2)], model, spec,
                                           torch.device("cpu"), None, 1e9, args)
    assert done[0][1] == "ERROR ValueError" and not skipped
    assert params and alive_at_cleanup == [False]


def test_the_hand_over_check_reads_the_lease_record():
    grant = {"event": "grant", "owner": "t1", "keys": ["n/gpu:0"], "device_mb": 0.0, "time": 1.0}
    release = {"event": "release", "owner": "t1", "keys": ["n/gpu:0"], "device_mb": 2.0, "time": 9.0}
    assert "1 grants at 0 MB" in gpu_check_results.check_hand_over([[grant, release]])
    with pytest.raises(CheckFailed, match="before its lease: t2: 512.0 MB"):
        gpu_check_results.check_hand_over([[grant, release, {**grant, "owner": "t2", "device_mb": 512.0}]])
    with pytest.raises(CheckFailed, match="or more than 2048 MB: t1: 9000 MB"):
        gpu_check_results.check_hand_over([[grant, {**release, "device_mb": 9000.0}]])
    # The release counts the trial's live context (NVML): 0 is the allocator's view, uncounted.
    with pytest.raises(CheckFailed, match=r"recording 0 \(its context uncounted\).*t1: 0 MB"):
        gpu_check_results.check_hand_over([[grant, {**release, "device_mb": 0.0}]])
    # Bounded by this check process's own footprint after freeing, plus HANDED_OVER_MB.
    assert "bound 956" in gpu_check_results.check_hand_over([[grant, {**release, "device_mb": 900.0}]], 700.0)
    with pytest.raises(CheckFailed, match="more than 956 MB: t1: 1300 MB"):
        gpu_check_results.check_hand_over([[grant, {**release, "device_mb": 1300.0}]], 700.0)


def test_the_process_record_is_checked_against_nvmls_used_memory():
    """gpu-check's own process after freeing: the lease's figure for it (NVML's count) must be
    above 0 and within NVML's used memory of the GPU; CUDA's used memory (the fallback) not below it."""
    assert "holds 700 MB after freeing" in gpu_check_results.check_process_record(700.0, 1200.0, 1150.0)
    with pytest.raises(CheckFailed, match="record 0 MB for this process"):
        gpu_check_results.check_process_record(0.0, 1200.0, 1150.0)
    with pytest.raises(CheckFailed, match="reads 600 MB, less than this process's 700 MB"):
        gpu_check_results.check_process_record(700.0, 1200.0, 600.0)
    with pytest.raises(CheckFailed, match="NVML cannot be asked"):
        gpu_check_results.check_process_record(700.0, None, 1150.0)


def test_the_learning_step_needs_every_precision_to_learn(monkeypatch, tmp_path):
    """gpu-check's learning step on curves faked where the GPU would train them: fp16 and bf16
    must each end at val_acc >= 0.8; the line names each with its figures; a curve below the
    bar fails the step naming the precision and its accuracies."""
    from bench import learning_check

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(learning_check, "learning_index",
                        lambda folder, workers=None: argparse.Namespace(train=["t"], val=["v"]))
    finals = {"fp16": 0.9, "bf16": 0.85}

    def fit(train, val, *, precision, **kw):
        return learning_check.Curve(precision, [0.5, finals[precision]], 2 if precision == "fp16" else 0, 3.0)

    monkeypatch.setattr(learning_check, "fit_tiny", fit)
    check = gpu_check_steps.GpuCheck(gpu_check.build_parser().parse_args([]), tmp_path)
    line = check.learns()
    assert line == "fp16 val_acc 0.900 in 3 s (2 steps skipped by GradScaler); bf16 val_acc 0.850 in 3 s"
    assert [c["precision"] for c in check.figures["learning"]] == ["fp16", "bf16"]

    finals["bf16"] = 0.55
    with pytest.raises(CheckFailed, match=r"did not learn: bf16: val_acc 0.550 after 2 epochs"):
        check.learns()
    # a GPU without bf16 (before sm 8.0) is asked for fp16 only, though torch counts a T4's
    # emulated bf16 as supported unless told not to
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert check.learns().startswith("fp16 val_acc 0.900") and "bf16" not in check.learns()


def test_keep_going_runs_every_check_and_part_picks_the_checks(tmp_path, capsys, monkeypatch):
    """--keep-going: a first run on a new GPU shows every check that fails, not the first only;
    --part local runs the checks that need no Ray (a machine without it), --part search the rest."""
    def fail() -> str:
        raise CheckFailed("no")

    steps = [("a", fail), ("b", lambda: "fine"), ("c", fail)]
    assert [c.name for c in gpu_check_results.run_checks(steps)] == ["a"]
    checks = gpu_check_results.run_checks(steps, keep_going=True)
    assert [(c.name, c.passed) for c in checks] == [("a", False), ("b", True), ("c", False)]
    assert "gpu-check: b: PASS: fine" in capsys.readouterr().out      # each as it ends
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    names = {part: [name for name, _ in gpu_check_steps.GpuCheck(
        gpu_check.build_parser().parse_args(["--part", part]), tmp_path).steps()]
        for part in gpu_check_steps.PARTS}
    assert names["all"] == names["local"][:6] + names["search"] + names["local"][6:]
    assert {"batch probe", "compiled, channels-last", "lease record vs NVML"} <= set(names["local"])
    assert names["all"].index("lease record vs NVML") < names["all"].index("hand-over")   # its bound
    assert "hand-over" in names["search"] and "hand-over" not in names["local"]


# -- run as a user runs them (fresh interpreters): the refusal without a GPU, and the CPU modes ---

@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the refusal on a machine without a GPU")
@pytest.mark.parametrize("name, says", [("gpu_check", "gpu-check: refused:"),
                                        ("gpu_precision", "gpu_precision: refused:")])
def test_gpu_benchmarks_refuse_with_exit_2_without_a_gpu(name, says, tmp_path):
    from tests.test_bench_runs import run_bench

    extra = ["--quick"] if name == "gpu_precision" else []
    proc = run_bench(name, *extra, "--json", str(tmp_path / "out.json"), timeout_s=110)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(says) and "needs one GPU" in lines[0], proc.stderr
    assert "nothing was run" in lines[0] and proc.stdout == ""
    assert not (tmp_path / "out.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_gpu_precision_cpu_smoke_quick_prints_its_rows(tmp_path):
    from tests.test_bench_runs import ok, run_bench, table_rows

    out = ok(run_bench("gpu_precision", "--cpu-smoke", "--quick", "--json", str(tmp_path / "p.json"),
                       timeout_s=380))
    rows = table_rows(out, "source", "precision", "cudnn.bench", "batch", "clips/s", "ms/step", "MFU_%")
    assert [r.split()[:2] for r in rows] == [["synthetic", "fp32"], ["decord", "fp32"],
                                             ["cache-jpeg", "fp32"]]
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["model"] == "tiny" and doc["device"].startswith("CPU") and not doc["skipped"]
    assert [r["source"] for r in doc["rows"]] == ["synthetic", "decord", "cache-jpeg"]
    assert all("error" not in r for r in doc["rows"]), doc["rows"]
