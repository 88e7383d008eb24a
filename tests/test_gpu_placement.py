"""Every GPU trains: lead and follower roles (trainer.lease, tune.trial), proven on GPUs that Ray
simulates (it places on declared resources, not on hardware)."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap

import pytest

from pathlib import Path
from trainer.lease import FOLLOW, LEAD, LeaseBook

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_roles_give_each_gpu_one_lead_before_any_trial_follows():
    book = LeaseBook(lead_slots=2)
    assert [book.take_role(t) for t in ("a", "b", "c", "d")] == [LEAD, LEAD, FOLLOW, FOLLOW]
    assert book.take_role("a") == LEAD                          # asked again (a reused driver): the same
    asyncio.run(book.end("a"))                                  # a's trial ended: its GPU has no lead
    assert book.take_role("e") == LEAD and book.take_role("f") == FOLLOW
    assert LeaseBook().take_role("x") == FOLLOW                 # no GPUs to lead on (a CPU search)


# Run in a fresh process: it needs a Ray with 4 (simulated) GPUs, the test session's has none.
PLACEMENT_SCRIPT = textwrap.dedent("""
    import json, ray
    from trainer.lease import LeaseBook
    from tune.trial import TrialResources

    ray.init(num_cpus=8, num_gpus=4, include_dashboard=False)

    @ray.remote(num_cpus=0)
    class Trial:
        def gpu(self):
            return ray.get_runtime_context().get_accelerator_ids()["GPU"]

    def place(shares):
        actors = []
        for share in shares:   # one at a time, as trials start
            actors.append(Trial.options(num_gpus=share).remote())
            ray.get(actors[-1].gpu.remote())
        return [ray.get(a.gpu.remote())[0] for a in actors]

    halves = place([0.5] * 8)
    book, resources = LeaseBook(lead_slots=4), TrialResources(workers=1, gpus_per_worker=1.0)
    roles = [book.take_role(f"t{i}") for i in range(8)]
    by_role = place([resources.per_worker(role)["GPU"] for role in roles])
    print(json.dumps({"halves": halves, "roles": roles, "by_role": by_role}))
""")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ray_packs_half_gpus_but_leads_spread_over_every_gpu():
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, "-c", PLACEMENT_SCRIPT], cwd=REPO_ROOT, env=env, capture_output=True,
                         text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # The defect: 4 trials of half a GPU each land on GPUs 0 and 1; 2 and 3 idle.
    assert sorted(got["halves"][:4]) == ["0", "0", "1", "1"]
    # The fix: the first 4 trials lead, each on its own GPU; the next 4 follow, one behind each lead.
    assert got["roles"] == ["lead"] * 4 + ["follow"] * 4
    assert sorted(got["by_role"][:4]) == ["0", "1", "2", "3"]
    assert sorted(got["by_role"][4:]) == ["0", "1", "2", "3"]
