"""Which failed trials a search runs again (tune/running/trial_retry.py): only those whose process or
node was lost; a trial that failed by itself fails at once when Tune retries it, until a
--resume (a new search process, with a new registry) gives it another go."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray.exceptions
from ray.train import ControllerError, WorkerGroupError

from vidtune.trainer.training.config import TrainConfig
from vidtune.tune.running import trial as trial_module
from vidtune.tune.running import trial_retry
from vidtune.tune.running.faults import exception_line
from vidtune.tune.running.trial import TrialResources, make_trial_driver
from vidtune.tune.running.trial_retry import TrialFailedBefore, is_lost_process


def _raised_from(error: BaseException, cause: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as inner:
            raise error from inner
    except BaseException as outer:
        return outer


@pytest.mark.parametrize("error, lost", [
    (ray.exceptions.ActorDiedError(), True),
    (ray.exceptions.NodeDiedError("node gone"), True),
    (ControllerError(ray.exceptions.ActorDiedError()), True),
    (_raised_from(RuntimeError("fit failed"), ray.exceptions.ActorDiedError()), True),
    (ValueError("broken video"), False),
    (WorkerGroupError("rank 0: ZeroDivisionError", {0: ZeroDivisionError()}), False),
    (ControllerError(ValueError("bad config")), False),
])
def test_only_lost_processes_and_nodes_count_as_lost(error, lost):
    assert is_lost_process(error) is lost


class _Method:
    def __init__(self, fn):
        self.remote = fn


class FakeRegistry:
    """tune.running.cleanup's registry actor without Ray: its two methods the retry rule uses, called
    through `.remote` as on the actor handle (`ray.get` patched to return the value)."""

    def __init__(self):
        self.errors: dict[str, str] = {}
        self.note_own_error = _Method(lambda trial_id, text: self.errors.setdefault(trial_id, text))
        self.own_error = _Method(self.errors.get)


@pytest.fixture
def registry(monkeypatch):
    """The search's registry, by name "reg" (another name: no such actor, as Ray would say)."""
    fake = FakeRegistry()

    def get_actor(name):
        if name != "reg":
            raise ValueError(f"Failed to look up actor with name '{name}'")
        return fake

    monkeypatch.setattr(trial_retry.ray, "get_actor", get_actor)
    monkeypatch.setattr(trial_retry.ray, "get", lambda value, timeout=None: value)
    monkeypatch.setattr(trial_module, "was_released", lambda name, trial_id: False)
    monkeypatch.setattr(trial_module, "PlacementGroupRecorder", lambda name, trial_id: None)
    return fake


def test_an_own_error_stops_a_retry_while_the_registry_lives(registry):
    trial_retry.raise_if_failed_before("reg", "t1")                       # nothing noted: no error
    try:
        raise ValueError("video x.mp4 does not decode")
    except ValueError as e:
        trial_retry.note_own_error("reg", "t1", e)
    with pytest.raises(TrialFailedBefore) as failed:
        trial_retry.raise_if_failed_before("reg", "t1")
    # What the console shows of a failed trial is the first error, not the refusal.
    assert exception_line(str(failed.value)) == "ValueError: video x.mp4 does not decode"
    trial_retry.raise_if_failed_before("reg", "t2")                       # another trial: tried
    # A --resume is a new search process with a new registry: nothing noted there.
    trial_retry.raise_if_failed_before("other-search", "t1")


def test_a_registry_that_cannot_be_asked_keeps_the_trial_error(registry):
    trial_retry.note_own_error("gone", "t1", ValueError("x"))             # no exception of its own


class _Context:
    def get_trial_id(self):
        return "abc_00000"

    def get_trial_name(self):
        return "t00-bs4-lr1e-3"


def _driver(tmp_path, monkeypatch, error: BaseException):
    """The trial driver of one search process, with a trainer whose fit() raises `error`; the
    list counts the trainers built (one per attempt that got past the retry check)."""
    monkeypatch.setattr(trial_module.tune, "get_context", lambda: _Context())
    monkeypatch.setattr(trial_module, "TuneReportCallback", lambda: None)   # no Tune session here
    built = []

    def factory(*args, **kwargs):
        built.append(kwargs["name"])
        return SimpleNamespace(fit=lambda: (_ for _ in ()).throw(error))

    resources = TrialResources(workers=1, cpus_per_worker=1.0, gpus_per_worker=0.0)
    driver = make_trial_driver(TrainConfig(), resources, train_storage=str(tmp_path / "train_runs"),
                               trainer_factory=factory, registry_name="reg")
    return driver, built


def test_a_trial_that_failed_by_itself_is_not_trained_again_on_retry(tmp_path, monkeypatch, registry):
    driver, built = _driver(tmp_path, monkeypatch, ValueError("broken video"))
    with pytest.raises(ValueError):
        driver({"batch_size": 4, "lr": 1e-3})
    with pytest.raises(TrialFailedBefore, match="broken video"):
        driver({"batch_size": 4, "lr": 1e-3})
    assert built == ["t00-bs4-lr1e-3"]          # the retry built no trainer


def test_a_trial_whose_controller_was_lost_is_trained_again_on_retry(tmp_path, monkeypatch, registry):
    driver, built = _driver(tmp_path, monkeypatch, ControllerError(ray.exceptions.ActorDiedError()))
    for _ in range(2):
        with pytest.raises(ControllerError):
            driver({"batch_size": 4, "lr": 1e-3})
    assert built == ["t00-bs4-lr1e-3"] * 2


def failing_worker(config: dict, *, claim: str) -> None:
    """A Train worker loop: the first trial to claim `claim` (an exclusive create) fails by
    itself at its second epoch; any other trial reports two good epochs."""
    import ray.train

    try:
        with open(claim, "x"):
            fails = True
    except FileExistsError:
        fails = False
    for epoch in (1, 2):
        if fails and epoch == 2:
            raise ValueError("video x.mp4 does not decode")
        ray.train.report({"epoch": epoch, "val_acc": 0.5, "val_f1": 0.5, "clips_per_s": 10.0,
                          "epoch_time_s": 0.5, "oom": 0, "batch_size": config["batch_size"]})


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_search_does_not_rerun_a_trial_that_failed_by_itself(ray_session, synthetic_root, tmp_path):
    """Tune may retry failed trials (for lost nodes), but a trial with its own error is built
    once, ends FAILED in MLflow with its own error line, and the other trial is unaffected."""
    import functools
    import sys

    import ray.cloudpickle
    import ray.train
    from mlflow.tracking import MlflowClient
    from ray.train.torch import TorchTrainer

    from vidtune.tune import preflight, runner
    from vidtune.tune.config.options import parse_options
    from vidtune.tune.tracking.schema import FAILURE_TAG, PARENT_TAG

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])   # workers cannot import tests/
    built = tmp_path / "built.txt"

    def factory(cfg, *, num_workers, use_gpu, resources_per_worker, name, storage_path, callbacks,
                device_lease=None, index=None, node_setup=None):
        with open(built, "a") as f:
            f.write(name + "\n")
        return TorchTrainer(functools.partial(failing_worker, claim=str(tmp_path / "claim")),
                            train_loop_config=cfg.to_dict(),
                            scaling_config=ray.train.ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                                                   resources_per_worker=resources_per_worker),
                            run_config=ray.train.RunConfig(name=name, storage_path=storage_path,
                                                           callbacks=callbacks,
                                                           failure_config=ray.train.FailureConfig(max_failures=0)))

    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    opts = parse_options(["--data", str(synthetic_root), "--num-samples", "2", "--epochs", "2",
                          "--batch-sizes", "4", "--no-early-stop", "--max-concurrent-trials", "1",
                          "--storage", str(tmp_path / "results"), "--mlflow-uri", uri, "--no-log-model"])
    runner.run_search(preflight.prepare(opts), trainer_factory=factory)

    names = built.read_text().split()
    assert len(names) == 2 and len(set(names)) == 2, names     # each trial built once, no rerun
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("vidtune").experiment_id])
    children = {r.info.status: r for r in runs if PARENT_TAG in r.data.tags}
    assert set(children) == {"FAILED", "FINISHED"}, [r.info.status for r in runs]
    assert "ValueError: video x.mp4 does not decode" in children["FAILED"].data.tags[FAILURE_TAG]
