"""Every GPU trains: lead and follower roles (trainer.cluster.lease, tune.running.trial), proven on GPUs that
Ray
simulates (it places on declared resources, not on hardware)."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vidtune.trainer.cluster.lease import FOLLOW, LEAD, LeaseBook

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_roles_give_each_gpu_one_lead_before_any_trial_follows():
    book = LeaseBook(lead_slots=2)
    assert [book.take_role(t) for t in ("a", "b", "c", "d")] == [LEAD, LEAD, FOLLOW, FOLLOW]
    assert book.take_role("a") == LEAD                          # asked again (a reused driver): the same
    asyncio.run(book.end("a"))                                  # a's trial ended: its GPU has no lead
    assert book.take_role("e") == LEAD and book.take_role("f") == FOLLOW
    assert LeaseBook().take_role("x") == FOLLOW                 # no GPUs to lead on (a CPU search)


# Run in a fresh process: it needs a Ray with 4 (simulated) GPUs, the test session's has none. One
# Ray for both tests below (a Ray and the imports cost ~10 s here): first where Ray places actors
# of half a GPU and of each trial role, one at a time as trials start; then a real 2-worker run,
# built as a search's trials are (trainer.cluster.build_trainer.build_torch_trainer, gloo under
# simulation), has each rank report its GPU.
SIMULATED_GPUS_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import ray, torch.distributed as dist
    from vidtune.trainer.cluster.build_trainer import build_torch_trainer
    from vidtune.trainer.training.config import TrainConfig
    from vidtune.trainer.cluster.devices import train_device
    from vidtune.trainer.ray_setup.launch import init_ray
    from vidtune.trainer.cluster.lease import LeaseBook, device_keys, physical_gpu_ids
    from vidtune.tune.running.trial import TrialResources

    OUT = sys.argv[1]   # captured with `loop` (pickled by value: it is defined in __main__)
    init_ray(num_cpus=8, include_dashboard=False)      # VIDTUNE_SIMULATE_GPUS=4: 4 GPUs

    @ray.remote(num_cpus=0)
    class Trial:
        def gpu(self):
            return ray.get_runtime_context().get_accelerator_ids()["GPU"]

    def place(shares):    # its actors end when it returns (their handles go): the next call starts afresh
        actors = []
        for share in shares:   # one at a time, as trials start
            actors.append(Trial.options(num_gpus=share).remote())
            ray.get(actors[-1].gpu.remote())
        return [ray.get(a.gpu.remote())[0] for a in actors]

    halves = place([0.5] * 4)
    book, resources = LeaseBook(lead_slots=4), TrialResources(workers=1, gpus_per_worker=1.0)
    roles = [book.take_role(f"t{i}") for i in range(8)]
    by_role = place([resources.per_worker(role)["GPU"] for role in roles])
    packed_book, packed = LeaseBook(lead_slots=4), TrialResources(workers=1, gpus_per_worker=0.5)
    packed_roles = [packed_book.take_role(f"p{i}") for i in range(8)]
    packed_by_role = place([packed.per_worker(role)["GPU"] for role in packed_roles])
    with open(os.path.join(OUT, "placement.json"), "w") as f:
        json.dump({"halves": halves, "roles": roles, "by_role": by_role, "packed": packed_by_role}, f)

    def loop(config):
        mine = {"gpus": physical_gpu_ids(), "keys": device_keys(train_device()),
                "device": str(train_device())}
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        if dist.get_rank() == 0:   # Train V2 keeps no metrics without a checkpoint: a file instead
            with open(os.path.join(OUT, "ranks.json"), "w") as f:
                json.dump(ranks, f)

    trainer = build_torch_trainer(TrainConfig(), num_workers=2, use_gpu=True, train_loop=loop,
                                  resources_per_worker={"CPU": 1, "GPU": 1}, name="two",
                                  storage_path=OUT)
    trainer.fit()
""")


@pytest.fixture(scope="module")
def on_simulated_gpus(tmp_path_factory) -> Path:
    """The folder SIMULATED_GPUS_SCRIPT wrote placement.json and ranks.json to."""
    out = tmp_path_factory.mktemp("simulated-gpus")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "VIDTUNE_SIMULATE_GPUS": "4"}
    env.pop("RAY_ADDRESS", None)
    run = subprocess.run([sys.executable, "-c", SIMULATED_GPUS_SCRIPT, str(out)], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=230)
    assert run.returncode == 0, run.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ray_packs_half_gpus_but_leads_spread_over_every_gpu(on_simulated_gpus):
    got = json.loads((on_simulated_gpus / "placement.json").read_text())
    # The defect: 4 trials of half a GPU each land on GPUs 0 and 1; 2 and 3 idle.
    assert sorted(got["halves"]) == ["0", "0", "1", "1"]
    # The fix: the first 4 trials lead, each on its own GPU; the next 4 follow, one behind each lead.
    assert got["roles"] == ["lead"] * 4 + ["follow"] * 4
    assert sorted(got["by_role"][:4]) == ["0", "1", "2", "3"]
    assert sorted(got["by_role"][4:]) == ["0", "1", "2", "3"]
    # --gpus-per-trial 0.5 (packed, two train side by side per GPU) spreads the same way
    assert sorted(got["packed"][:4]) == sorted(got["packed"][4:]) == ["0", "1", "2", "3"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_two_worker_trial_gets_two_gpus_and_a_lease_key_for_each(on_simulated_gpus):
    ranks = json.loads((on_simulated_gpus / "ranks.json").read_text())
    gpus = [gpu for rank in ranks for gpu in rank["gpus"]]
    assert len(ranks) == 2 and len(gpus) == 2 and len(set(gpus)) == 2, ranks     # distinct GPUs
    keys = {rank["keys"][0].split("/")[-1] for rank in ranks}
    assert keys == {f"gpu:{gpu}" for gpu in gpus}                                 # keyed by physical id
    assert all(rank["device"] == "cpu" for rank in ranks)                         # simulated: CPU training
