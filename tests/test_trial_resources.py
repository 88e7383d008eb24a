"""tune.trial.TrialResources: what a trial asks Ray for, so that the next trial can start beside a
training one while the device lease keeps the trainings apart."""
from __future__ import annotations

from tune.trial import TrialResources


def test_one_worker_gpu_trial_asks_ray_for_half_its_share():
    whole = TrialResources(workers=1, cpus_per_worker=2, gpus_per_worker=1.0)
    assert whole.per_worker() == {"CPU": 2, "GPU": 0.5}        # two such trials fit on one GPU
    assert whole.trainings_per_gpu == 1                          # but the lease lets one train
    packed = TrialResources(workers=1, cpus_per_worker=2, gpus_per_worker=0.5)   # --gpus-per-trial 0.5
    assert packed.per_worker()["GPU"] == 0.25 and packed.trainings_per_gpu == 2


def test_multi_worker_and_cpu_trials_ask_for_what_they_train_on():
    ddp = TrialResources(workers=2, cpus_per_worker=2, gpus_per_worker=1.0)
    assert ddp.per_worker() == {"CPU": 2, "GPU": 1.0}          # two ranks must never share one GPU
    assert TrialResources(workers=1, cpus_per_worker=0.9).per_worker() == {"CPU": 0.9}
    no_overlap = TrialResources(workers=1, cpus_per_worker=1, gpus_per_worker=1.0, overlap=False)
    assert no_overlap.per_worker()["GPU"] == 1.0
    assert TrialResources(workers=1, gpus_per_worker=2.0).per_worker()["GPU"] == 2.0   # whole GPUs stay whole
