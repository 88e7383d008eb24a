"""`make gpu-check`: one check, under 5 minutes on one GPU, that the GPU path does what the design
says. It needs a CUDA device and refuses without one (exit 2).

  1. the precision table of bench/gpu_precision.py (mvit_v2_s, synthetic batches, batch 8,
     bf16 / fp16 / fp32 with cudnn.benchmark on and off; --bench-seconds budget);
  2. on this GPU, the two calls every Train worker makes before training: `choose_precision
     ("auto", device)` gives bf16 on sm 8.0+ (fp16 below) and `configure_backends(device)` turns
     cudnn.benchmark on (step 6 checks what the workers themselves reported);
  3. decoding (bench/gpu_decode.py): clip-cache JPEG entries decoded on the GPU against the same
     entries decoded on the CPU (each frame within JPEG tolerance), and seeded mvit_v2_s steps
     trained on each (model inputs and losses agree; the GPU side decodes inside the training
     loop while the previous step is queued, where nvJPEG once overwrote the step's memory);
  4. learning (bench/learning_check.py): the `tiny` model trained 8 epochs on 200 generated videos
     without Ray, once in fp16 with GradScaler and once in bf16 (where the GPU has it), each
     reaching val_acc 0.8 on 40 balanced validation clips (chance 0.5), as on the CPU in fp32
     (tests/test_learning.py); the steps GradScaler skipped are reported;
  5. a real 4-trial search on the GPU: `vidtune search --model mvit_v2_s --weights none
     --epochs 2 --num-samples 4` on videos generated here (datasets.synthetic), with its own
     MLflow store (SQLite), Ray storage and clip cache in the work folder;
  6. that store, read back with MlflowClient: every trial's child run FINISHED with all its
     epochs and param precision=auto; the workers' own record of what they trained with (tags:
     the precision auto became on this GPU, TF32 and cudnn.benchmark on, device, capability,
     CUDA, driver, torch); one training at a time on each GPU (`concurrent_trainings` == 1 in
     every epoch); tag `gpu_ids` on every child run; clips_per_s and peak_mem_mb > 0;
  7. the search's device lease record (device_lease.json): every trial waited for its GPU without
     a CUDA context there and gave it back having freed its memory (`check_hand_over`);
  8. one epoch of mvit_v2_s as a worker trains it (trainer.run) with --compile and
     --channels-last: Inductor lowers its attention matmuls, where a TF32 setting once crashed it;
  9. the batch probe against a known answer: in a slice of the GPU's memory (--probe-share), the
     size it finds fits, measured alone from a clean allocator, and one more clip does not;
 10. a hub architecture: a tiny random VideoMAE, written with save_pretrained and trained as
     `--model hf:FOLDER` on the learning videos in fp16 and bf16, each learning (val_acc 0.8) and
     reporting its clips/s and peak memory.

Prints a table of the checks; the first that fails ends the run with a line saying what failed
(exit 1); with --keep-going every check runs (a first run on a new GPU shows all that fails).

    make gpu-check                                     # or:
    python -m bench.gpu_check --json gpu-check.json    # --keep DIR keeps the search's files
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from mlflow.tracking import MlflowClient

from bench import gpu_decode, learning_check
from bench.common import write_json
from vidtune.datasets.cache import FrameCache
from vidtune.datasets.config import DataConfig
from vidtune.datasets.index import build_index
from vidtune.datasets.synthetic import generate
from vidtune.trainer.batch_probe import make_step_trial, probe_batch_size
from vidtune.trainer.config import TrainConfig
from vidtune.trainer.models import get_spec
from vidtune.trainer.precision import (
    choose_precision,
    configure_backends,
    default_device,
    free_memory,
    peak_reserved_mb,
    reset_peak_memory,
)
from vidtune.trainer.run import TRAINED, build_run, place_model, run_epoch

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL = "mvit_v2_s"
EXPERIMENT = "gpu-check"
PARENT_TAG = "mlflow.parentRunId"
EPOCH_METRICS = ("clips_per_s", "peak_mem_mb", "concurrent_trainings")
NO_GPU_EXIT = 2
PARTS = ("all", "local", "search")   # --part: which checks run
DECODE_VIDEOS = 32   # 4 batches of 8 clips (16 frames of 224 px): 512 frames, 4 seeded steps a side


class CheckFailed(AssertionError):
    """One check's assertion, with the line to print."""


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str


@dataclass(frozen=True)
class TrialRun:
    """One trial's MLflow child run, as read back from the store."""

    name: str
    status: str                                   # FINISHED | FAILED | KILLED | RUNNING
    params: dict[str, str]
    tags: dict[str, str]
    history: dict[str, list[float]] = field(default_factory=dict)   # metric -> value per epoch, in order


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-samples", type=int, default=4, help="trials of the search (default 4)")
    p.add_argument("--epochs", type=int, default=2, help="epochs per trial (default 2)")
    p.add_argument("--batch-sizes", default="8,16", help="the search's batch sizes (default 8,16)")
    p.add_argument("--videos", type=int, default=64, help="generated videos, 112 px, 3 s (default 64)")
    p.add_argument("--bench-seconds", type=float, default=60,
                   help="time budget of the precision table (its --max-seconds; default 60)")
    p.add_argument("--search-timeout-s", type=float, default=200,
                   help="the search is interrupted past this (default 200)")
    p.add_argument("--keep", metavar="DIR", default=None,
                   help="work folder to keep (videos, MLflow store, Ray results, logs); "
                        "default: a temporary one")
    p.add_argument("--json", metavar="FILE", default=None,
                   help="also write the checks and figures as JSON")
    p.add_argument("--probe-share", type=float, default=0.05,
                   help="the share of the GPU's memory the batch-probe check probes in (default 0.05: "
                        "a small known answer in seconds)")
    p.add_argument("--part", choices=PARTS, default="all",
                   help="all (default); local: the checks in this process, without Ray (precision, "
                        "decoding, learning, --compile, batch probe); search: the search and what it wrote")
    p.add_argument("--keep-going", action="store_true",
                   help="run every check even after one fails (default: stop at the first)")
    return p


def validate(args: argparse.Namespace) -> None:
    for flag, value, least in (("--num-samples", args.num_samples, 1), ("--epochs", args.epochs, 1),
                               ("--videos", args.videos, 8), ("--bench-seconds", args.bench_seconds, 1),
                               ("--search-timeout-s", args.search_timeout_s, 1)):
        if value < least:
            raise SystemExit(f"gpu-check: {flag} {value:g}: must be >= {least}")
    if not 0 < args.probe_share <= 1:
        raise SystemExit(f"gpu-check: --probe-share {args.probe_share:g}: must be in (0, 1]")


def no_gpu_reason() -> str | None:
    """One line saying why this machine cannot run the check; None when it has a CUDA device."""
    if torch.cuda.is_available():
        return None
    return (f"gpu-check: refused: torch {torch.__version__} "
            f"(CUDA {torch.version.cuda or 'none: a CPU-only build'}) "
            "sees no CUDA device here; this check needs one GPU (nothing was run)")


# -- running the steps ---------------------------------------------------------------------------

def run_logged(cmd: list[str], *, log_path: Path, timeout_s: float, env: dict[str, str],
               cwd: Path) -> int:
    """Run `cmd` with its output in `log_path`; past `timeout_s` interrupt it (SIGINT: the search
    closes its runs and Ray), kill it 30 s later. Returns the exit code."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            return -1


def tail(path: Path, lines: int = 25) -> str:
    text = path.read_text(errors="replace").splitlines() if path.is_file() else ["(no output)"]
    return "\n    ".join(text[-lines:])


def search_argv(args: argparse.Namespace, data: Path, work: Path, name: str = EXPERIMENT) -> list[str]:
    """The search's flags: mvit_v2_s at its own clip size (16 x 224 x 224: torchvision's MViT takes
    no other), random weights (the GPU machine has no internet), everything in `work`; `name`:
    the search's folder under `work`/results (a new one per run: a --keep folder may hold others)."""
    return ["--data", str(data), "--model", MODEL, "--weights", "none", "--epochs", str(args.epochs),
            "--num-samples", str(args.num_samples), "--batch-sizes", args.batch_sizes, "--no-early-stop",
            "--seed", "0", "--storage", str(work / "results"), "--name", name,
            "--mlflow-uri", mlflow_uri(work), "--experiment", EXPERIMENT,
            "--cache-dir", str(work / "clips")]


def mlflow_uri(work: Path) -> str:
    return f"sqlite:///{work / 'mlruns.db'}"


def child_env(work: Path) -> dict[str, str]:
    # the real GPU, not simulated ones
    env = {k: v for k, v in os.environ.items() if k != "VIDTUNE_SIMULATE_GPUS"}
    return {**env, "XDG_CACHE_HOME": str(work / "xdg-cache"), "PYTHONUNBUFFERED": "1"}


def load_trial_runs(uri: str, experiment: str) -> list[TrialRun]:
    """The child runs (one per trial) of the newest search parent run in `experiment`."""
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise CheckFailed(f"no MLflow experiment {experiment!r} in {uri}")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = sorted((r for r in runs if PARENT_TAG not in r.data.tags), key=lambda r: r.info.start_time)
    if not parents:
        raise CheckFailed(f"no parent run in experiment {experiment!r} of {uri}")
    parent = parents[-1].info.run_id
    out = []
    for r in sorted((r for r in runs if r.data.tags.get(PARENT_TAG) == parent),
                    key=lambda r: r.info.start_time):
        history = {k: [m.value for m in sorted(client.get_metric_history(r.info.run_id, k),
                                               key=lambda m: m.step)]
                   for k in EPOCH_METRICS}
        out.append(TrialRun(r.info.run_name or r.info.run_id, r.info.status, dict(r.data.params),
                            dict(r.data.tags), history))
    return out


# -- the checks ----------------------------------------------------------------------------------

def require(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def check_precision_table(doc: dict[str, Any]) -> str:
    rows = doc.get("rows") or []
    measured = [r for r in rows if "error" not in r]
    errors = [f"{r['precision']} batch {r['batch_size']}: {r['error']}" for r in rows
              if str(r.get("error", "")).startswith("ERROR")]
    require(not errors, f"rows failed: {'; '.join(errors)}")
    require(bool(measured), f"no row measured ({len(rows)} rows, {len(doc.get('skipped') or [])} skipped)")
    require(all(r["clips_per_s"] > 0 for r in measured), "a row measured 0 clips/s")
    best = max(measured, key=lambda r: r["clips_per_s"])
    return (f"{len(measured)} rows on {doc.get('device')}; fastest {best['precision']} "
            f"batch {best['batch_size']} {best['clips_per_s']:.0f} clips/s, peak {best['peak_mib']:.0f} MiB"
            + (f"; {len(doc['skipped'])} skipped (budget)" if doc.get("skipped") else ""))


def check_trials(runs: list[TrialRun], trials: int, epochs: int) -> str:
    require(len(runs) == trials, f"{len(runs)} child runs in MLflow, expected {trials} (one per trial)")
    why = lambda r: (r.tags.get("vidtune.failure_reason")  # noqa: E731
                     or r.tags.get("vidtune.stop_reason") or "")
    unfinished = [f"{r.name} {r.status}: {why(r)}" for r in runs if r.status != "FINISHED"]
    require(not unfinished, "not FINISHED: " + "; ".join(unfinished))
    short = [f"{r.name} ({len(r.history.get('clips_per_s', []))})" for r in runs
             if len(r.history.get("clips_per_s", [])) != epochs]
    require(not short, f"runs without {epochs} epochs of clips_per_s: {', '.join(short)}")
    return f"{trials} child runs FINISHED, {epochs} epochs each"


def check_auto_precision(capability: tuple[int, int], resolved: str) -> str:
    expected = "bf16" if tuple(capability) >= (8, 0) else "fp16"
    require(resolved == expected, f"choose_precision('auto') gave {resolved} on sm "
                                  f"{capability[0]}.{capability[1]}, expected {expected}")
    return (f"sm {capability[0]}.{capability[1]}: choose_precision('auto') -> {resolved}, as each worker "
            "calls it (no worker reports the precision it resolved)")


def check_precision_param(runs: list[TrialRun]) -> str:
    asked = sorted({r.params.get("precision", "(none)") for r in runs})
    require(asked == ["auto"], f"child runs' precision param {asked}, expected ['auto']")
    return "every child run's param precision = auto (resolved on its GPU as above)"


def check_cudnn_benchmark(benchmark_on: bool) -> str:
    require(benchmark_on, "torch.backends.cudnn.benchmark is False after configure_backends(cuda)")
    return "on after configure_backends(cuda), which every worker calls (no worker reports it)"


def check_one_training_per_gpu(runs: list[TrialRun]) -> str:
    bad = [f"{r.name}: {r.history.get('concurrent_trainings') or 'not logged'}" for r in runs
           if not r.history.get("concurrent_trainings")
           or any(v != 1 for v in r.history["concurrent_trainings"])]
    require(not bad, "concurrent_trainings != 1 in some epoch: " + "; ".join(map(str, bad)))
    epochs = sum(len(r.history["concurrent_trainings"]) for r in runs)
    return f"concurrent_trainings == 1 in all {epochs} epochs"


def check_gpu_ids(runs: list[TrialRun]) -> str:
    # the tag of the physical GPU id(s) a trial trained on; here, since the schema reads Ray's
    # result keys and only the search's part of the check needs Ray (--part local runs without it)
    from vidtune.tune.tracking.schema import GPU_IDS_TAG

    missing = [r.name for r in runs if not r.tags.get(GPU_IDS_TAG, "").strip()]
    require(not missing, f"tag {GPU_IDS_TAG!r} missing or empty on: {', '.join(missing)}")
    return f"tag {GPU_IDS_TAG} on every run: " + ", ".join(sorted({r.tags[GPU_IDS_TAG] for r in runs}))


def check_positive(runs: list[TrialRun], metric: str, unit: str) -> str:
    values = {r.name: r.history.get(metric) or [] for r in runs}
    bad = [f"{name}: {v or 'not logged'}" for name, v in values.items()
           if not v or not all(math.isfinite(x) and x > 0 for x in v)]
    require(not bad, f"{metric} not > 0 in every epoch: " + "; ".join(map(str, bad)))
    flat = [x for v in values.values() for x in v]
    return f"{metric} {min(flat):.0f}-{max(flat):.0f} {unit} over {len(flat)} epochs"


def check_worker_settings(runs: list[TrialRun], capability: tuple[int, int] | None) -> str:
    """What every trial's workers reported they trained with (`trainer.settings`, tags on its run):
    the precision `auto` must become on this GPU (bf16 from sm 8.0, fp16 with its scaler below),
    TF32 and cudnn.benchmark on, and the device, its capability, CUDA, driver and torch named.
    `capability`: this GPU's (the search's trials ran on it); None: not compared."""
    expected = None if capability is None else "bf16" if tuple(capability) >= (8, 0) else "fp16+scaler"
    want = {"vidtune.tf32": "matmul=tf32,conv=tf32", "vidtune.cudnn_benchmark": "on"}
    if expected:
        want["vidtune.precision_used"] = expected
    if capability is not None:
        want["vidtune.compute_capability"] = f"{capability[0]}.{capability[1]}"
    named = ("vidtune.device", "vidtune.cuda", "vidtune.driver", "vidtune.torch")
    bad = [f"{r.name}: {tag}={r.tags.get(tag, '(none)')!r}, expected {value!r}"
           for r in runs for tag, value in want.items() if r.tags.get(tag) != value]
    bad += [f"{r.name}: {tag} missing" for r in runs for tag in named if not r.tags.get(tag)]
    require(not bad, "the workers' own record: " + "; ".join(bad))
    first = runs[0].tags
    return (f"every worker: {first.get('vidtune.precision_used')}, tf32, cudnn.benchmark on, "
            f"{first.get('vidtune.device')} (sm {first.get('vidtune.compute_capability')}), CUDA "
            f"{first.get('vidtune.cuda')}, driver {first.get('vidtune.driver')}")


# A trial frees its GPU memory before it gives the GPU back: what torch's allocator still
# reserves then is a few blocks at most (the all-reduce that agrees on it allocates one).
HANDED_OVER_MB = 64.0


def check_hand_over(records: list[list[dict]]) -> str:
    """The device lease's record (device_lease.json): every trial was granted its GPU holding no
    GPU memory (NVML: no CUDA context, so it waited in host memory), and gave it back holding at
    most HANDED_OVER_MB in torch's allocator (it freed its weights and optimiser state first)."""
    require(len(records) == 1, f"{len(records)} device_lease.json files in the search's folder, expected 1")
    record = records[0]
    grants = [e for e in record if e["event"] == "grant"]
    releases = [e for e in record if e["event"] == "release"]
    require(grants and releases, f"the lease record has {len(grants)} grants and {len(releases)} releases")
    early = [f"{e['owner']}: {e['device_mb']} MB" for e in grants if (e["device_mb"] or 0) > 0]
    require(not early, "a trial held GPU memory (a CUDA context) before its lease: " + "; ".join(early))
    left = [f"{e['owner']}: {e['device_mb'] if e['device_mb'] is None else round(e['device_mb'])} MB"
            for e in releases if e["device_mb"] is None or e["device_mb"] > HANDED_OVER_MB]
    require(not left, f"a trial gave its GPU back holding more than {HANDED_OVER_MB:g} MB: "
            + "; ".join(left))
    most = max(e["device_mb"] for e in releases)
    return (f"{len(grants)} grants at 0 MB (no CUDA context before the lease), {len(releases)} releases "
            f"<= {most:.0f} MB")


def mlflow_steps(runs: list[TrialRun], trials: int, epochs: int,
                 capability: tuple[int, int] | None = None) -> list[tuple[str, Callable[[], str]]]:
    """The checks of what the search wrote to MLflow, in order (`capability`: this GPU's)."""
    return [("trials in MLflow", lambda: check_trials(runs, trials, epochs)),
            ("precision param", lambda: check_precision_param(runs)),
            ("workers' settings", lambda: check_worker_settings(runs, capability)),
            ("one training per GPU", lambda: check_one_training_per_gpu(runs)),
            ("gpu_ids tag", lambda: check_gpu_ids(runs)),
            ("clips/s", lambda: check_positive(runs, "clips_per_s", "clips/s")),
            ("peak memory", lambda: check_positive(runs, "peak_mem_mb", "MB"))]


def run_checks(steps: Iterable[tuple[str, Callable[[], str]]], *, keep_going: bool = False) -> list[Check]:
    """Run `steps` in order until one fails (every one with `keep_going`): raises CheckFailed, or
    anything else (a store that cannot be read, a JSON file cut short), which is reported as the
    failure with its type."""
    done: list[Check] = []
    for name, step in steps:
        try:
            detail = step()
        except Exception as e:  # noqa: BLE001 - the table and the one line must still come out
            done.append(Check(name, False,
                              str(e) if isinstance(e, CheckFailed) else f"{type(e).__name__}: {e}"))
            print(f"gpu-check: {name}: FAIL", flush=True)
            if not keep_going:
                break
            continue
        done.append(Check(name, True, detail))
        print(f"gpu-check: {name}: PASS: {detail.splitlines()[0] if detail else ''}", flush=True)
    return done


def format_checks(checks: list[Check]) -> str:
    """One line per check (the first line of its detail), left-aligned."""
    width = max((len(c.name) for c in checks), default=5)
    lines = [f"{'check':<{width}}  result  detail", f"{'-' * width}  ------  ------"]
    lines += [f"{c.name:<{width}}  {'PASS' if c.passed else 'FAIL':<6}  "
              f"{c.detail.splitlines()[0] if c.detail else ''}" for c in checks]
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------------

class GpuCheck:
    """The steps of one run, sharing the work folder and what earlier steps produced."""

    def __init__(self, args: argparse.Namespace, work: Path):
        self.args, self.work, self.figures = args, work, {}
        self.device = default_device()          # the first GPU (main refused to run without one)
        self.runs: list[TrialRun] = []
        self.lease_record: list[list[dict]] = []   # the search's device_lease.json (trainer.lease)
        self._videos: Path | None = None

    def precision_table(self) -> str:
        out, log = self.work / "precision.json", self.work / "precision.log"
        cmd = [sys.executable, "-m", "bench.gpu_precision", "--model", MODEL, "--batch-sizes", "8",
               "--no-data", "--warmup-steps", "3", "--steps", "5",
               "--max-seconds", f"{self.args.bench_seconds:g}", "--json", str(out)]
        code = run_logged(cmd, log_path=log, timeout_s=self.args.bench_seconds + 120,
                          env=child_env(self.work), cwd=REPO_ROOT)
        require(code == 0 and out.is_file(), f"bench.gpu_precision exited {code}:\n    {tail(log)}")
        print(log.read_text(errors="replace"), flush=True)
        self.figures["precision_table"] = doc = json.loads(out.read_text())
        return check_precision_table(doc)

    def videos(self) -> Path:
        """The generated videos (112 px, 3 s) the search and the compiled epoch train on, made once."""
        if self._videos is None:
            t0 = time.perf_counter()
            self._videos = generate(self.work / "videos", videos=self.args.videos, size=112, seed=0,
                                    workers=min(os.cpu_count() or 1, 16), overwrite=True)
            self.figures["videos_s"] = time.perf_counter() - t0
        return self._videos

    def search(self) -> str:
        data = self.videos()
        made = self.figures["videos_s"]
        log = self.work / "search.log"
        name = f"{EXPERIMENT}-{time.strftime('%Y%m%d-%H%M%S')}"
        cmd = [sys.executable, str(REPO_ROOT / "tune" / "search.py"),
               *search_argv(self.args, data, self.work, name)]
        print("$ " + " ".join(cmd[1:]), flush=True)
        t1 = time.perf_counter()
        code = run_logged(cmd, log_path=log, timeout_s=self.args.search_timeout_s, env=child_env(self.work),
                          cwd=self.work)
        took = time.perf_counter() - t1
        self.figures["search"] = {"exit": code, "seconds": took, "videos_s": made, "argv": cmd[2:]}
        require(code == 0, (f"interrupted after {self.args.search_timeout_s:g} s" if code == -1
                            else f"exited {code}")
                + f"; the end of its output ({log}):\n    {tail(log)}")
        print(log.read_text(errors="replace"), flush=True)
        self.runs.extend(load_trial_runs(mlflow_uri(self.work), EXPERIMENT))
        self.figures["trials"] = [asdict(r) for r in self.runs]
        self.lease_record.extend(json.loads(f.read_text()) for f in self.work.glob("**/device_lease.json"))
        self.figures["device_lease"] = self.lease_record
        return (f"{self.args.num_samples} trials in {took:.0f} s "
                f"({self.args.videos} videos made in {made:.0f} s)")

    def auto_precision(self) -> str:
        capability = torch.cuda.get_device_capability(self.device)
        return check_auto_precision(capability, choose_precision("auto", self.device).name)

    def cudnn_benchmark(self) -> str:
        torch.backends.cudnn.benchmark = False
        configure_backends(self.device)
        return check_cudnn_benchmark(torch.backends.cudnn.benchmark)

    def device_decoding(self) -> str:
        if not torch.cuda.is_available():   # main refuses first today; kept for a CPU-side run
            return "skipped: torch sees no CUDA device, and GPU decoding needs one"
        batches = gpu_decode.cache_batches(self.work / "decoding", videos=DECODE_VIDEOS, batch_size=8,
                                           model=MODEL)
        self.figures["decoding"] = figures = gpu_decode.compare_decoding(batches, self.device, model=MODEL)
        found = gpu_decode.problems(figures)
        require(not found, "GPU-decoded and CPU-decoded clips disagree: " + "; ".join(found))
        return gpu_decode.summary(figures)

    def learns(self) -> str:
        # Without emulation: a T4 (sm 7.5) "supports" bf16 only by emulating it, and choose_precision
        # refuses bf16 there.
        precisions = ["fp16"] + (["bf16"] if torch.cuda.is_bf16_supported(including_emulation=False) else [])
        workers = min(os.cpu_count() or 1, 16)
        index = learning_check.learning_index(self.work / "learning", workers=workers)
        cache = FrameCache(self.work / "learning-clips")     # epoch 1 fills it: later epochs read it
        curves = [learning_check.fit_tiny(index.train, index.val, device=self.device, precision=p,
                                          cache=cache, loader_workers=min(workers, 4)) for p in precisions]
        self.figures["learning"] = [asdict(c) for c in curves]
        require([c.precision for c in curves] == precisions,
                f"asked {precisions}, trained {[c.precision for c in curves]}")
        found = [problem for c in curves for problem in learning_check.problems(c)]
        require(not found, "the tiny model did not learn: " + "; ".join(found))
        return learning_check.summary(curves)

    def hub_architecture(self) -> str:
        """A hub architecture trained as `--model hf:FOLDER` trains it: a tiny random VideoMAE
        (bench/learning_check.TINY_VIDEOMAE, written with save_pretrained) on the learning videos,
        in fp16 with GradScaler and in bf16 (where the GPU has it). Each must learn (the CPU's
        bar, tests/test_hf_learning.py) and report its speed and peak memory."""
        precisions = ["fp16"] + (["bf16"] if torch.cuda.is_bf16_supported(including_emulation=False) else [])
        workers = min(os.cpu_count() or 1, 16)
        index = learning_check.learning_index(self.work / "learning-hf", workers=workers)
        folder = learning_check.save_tiny_videomae(self.work / "tiny-videomae")
        cache = FrameCache(self.work / "learning-hf-clips")
        curves, rows = [], []
        for p in precisions:
            reset_peak_memory(self.device)
            curve = learning_check.fit_tiny(
                index.train, index.val, device=self.device, precision=p, cache=cache,
                loader_workers=min(workers, 4), model=f"hf:{folder}", lr=learning_check.HF_LR,
                epochs=learning_check.HF_EPOCHS)
            clips = (len(index.train) + len(index.val)) * len(curve.accuracies)   # trained + scored
            curves.append(curve)
            rows.append({**asdict(curve), "clips_per_s": clips / curve.seconds if curve.seconds else 0.0,
                         "peak_reserved_mib": peak_reserved_mb(self.device) or 0.0})
        self.figures["hub_architecture"] = rows
        require([c.precision for c in curves] == precisions,
                f"asked {precisions}, trained {[c.precision for c in curves]}")
        found = [problem for c in curves for problem in learning_check.problems(c)]
        require(not found, "the tiny VideoMAE did not learn: " + "; ".join(found))
        silent = [r["precision"] for r in rows if not (r["clips_per_s"] > 0 and r["peak_reserved_mib"] > 0)]
        require(not silent, f"no speed or peak memory reported for {silent}")
        return "; ".join(f"{r['precision']} val_acc {r['accuracies'][-1]:.3f}, {r['clips_per_s']:.0f} "
                         f"clips/s (train + val), peak {r['peak_reserved_mib']:.0f} MiB" for r in rows)

    def compiled_epoch(self) -> str:
        """One epoch of MODEL trained as a Train worker trains it (`trainer.run`: build_run,
        place_model, run_epoch) with --compile and --channels-last, at batch 8."""
        data = DataConfig(root=str(self.videos()), loader_workers=4, cache_dir=str(self.work / "index"),
                          clip_cache_dir=str(self.work / "clips-compiled"))
        cfg = TrainConfig(data=data, model=MODEL, weights="none", epochs=1, batch_size=8, compile=True,
                          channels_last=True)
        run = build_run(cfg, build_index(data), device=self.device)
        place_model(run)
        t0 = time.perf_counter()
        result = run_epoch(run, 1)
        took = time.perf_counter() - t0
        stats = result.stats
        loss = stats.loss_sum / stats.clips if stats is not None and stats.clips else math.nan
        self.figures["compiled_epoch"] = {
            "outcome": result.outcome, "seconds": took, "train_loss": loss,
            "steps": stats.steps if stats else 0, "precision": run.policy.name,
            "peak_reserved_mib": peak_reserved_mb(self.device)}
        require(result.outcome == TRAINED, f"the compiled, channels-last epoch ended: {result.outcome}")
        require(math.isfinite(loss), f"the compiled epoch's train_loss is {loss}")
        return (f"{MODEL} --compile --channels-last ({run.policy.name}): {stats.steps} steps, train_loss "
                f"{loss:.3f}, epoch {took:.0f} s with compiling")

    def batch_probe(self) -> str:
        """`probe_batch_size` in a slice of the GPU's memory, against what each size takes alone."""
        share = self.args.probe_share
        t0 = time.perf_counter()
        probe = probe_batch_size(MODEL, device=self.device, share=share, limit=256)
        took = time.perf_counter() - t0
        spec = get_spec(MODEL)
        step = make_step_trial(MODEL, policy=choose_precision("auto", self.device), device=self.device,
                               num_frames=spec.num_frames, height=spec.height, width=spec.width)
        bound = share * (1.0 - probe.headroom)

        def alone(batch_size: int) -> float:
            """The peak share a step of `batch_size` takes from a clean allocator (inf: out of memory)."""
            free_memory(self.device)
            try:
                return step(batch_size) or math.nan
            except torch.OutOfMemoryError:
                return math.inf

        fits, next_one = alone(probe.batch_size), alone(probe.batch_size + 1)
        self.figures["batch_probe"] = {"share": share, "batch_size": probe.batch_size, "seconds": took,
                                       "peak_share": fits, "next_peak_share": next_one, "bound": bound}
        require(fits <= bound < next_one,
                f"the probe found {probe.batch_size}, but alone it peaks at {fits:.4f} and "
                f"{probe.batch_size + 1} at {next_one:.4f} of the GPU (the bound: {bound:.4f})")
        gib = torch.cuda.get_device_properties(self.device).total_memory / 2**30
        return (f"{probe.batch_size} clips fit in {share:g} of {gib:.0f} GiB ({took:.0f} s): alone "
                f"{fits * gib:.2f} GiB, {probe.batch_size + 1} {next_one * gib:.2f} GiB, "
                f"bound {bound * gib:.2f}")

    def steps(self) -> list[tuple[str, Callable[[], str]]]:
        """The checks of `--part`, in order."""
        a = self.args
        local = [("precision table", self.precision_table),
                 ("precision auto", self.auto_precision),
                 ("cudnn.benchmark", self.cudnn_benchmark),
                 ("GPU decoding", self.device_decoding),
                 ("learns (fp16, bf16)", self.learns)]
        search = [(f"{a.num_samples}-trial search", self.search),
                  *mlflow_steps(self.runs, a.num_samples, a.epochs,   # self.runs: filled by the search step
                                capability=torch.cuda.get_device_capability(self.device)),
                  ("hand-over", lambda: check_hand_over(self.lease_record))]
        # after the search: a crash while compiling must not cost the search's checks
        later = [("batch probe", self.batch_probe), ("compiled, channels-last", self.compiled_epoch),
                 ("hub architecture (VideoMAE)", self.hub_architecture)]
        return {"all": local + search + later, "local": local + later, "search": search}[a.part]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    validate(args)
    reason = no_gpu_reason()
    if reason:
        print(reason, file=sys.stderr)
        return NO_GPU_EXIT
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vidtune-gpu-check-") as tmp:
        work = Path(args.keep).resolve() if args.keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        check = GpuCheck(args, work)
        checks = run_checks(check.steps(), keep_going=args.keep_going)
        elapsed = time.perf_counter() - started
        major, minor = torch.cuda.get_device_capability(check.device)
        gpu = f"{torch.cuda.get_device_name(check.device)} (sm {major}.{minor})"
        print(f"\ngpu-check on {gpu}, torch {torch.__version__} (CUDA {torch.version.cuda}), {elapsed:.0f} s")
        print(format_checks(checks))
        failed = next((c for c in checks if not c.passed), None)
        if failed and "\n" in failed.detail:
            print("\n" + failed.detail)
        if args.json:
            write_json(args.json, {"gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda,
                                   "elapsed_s": elapsed, "passed": failed is None,
                                   "checks": [asdict(c) for c in checks], **check.figures})
    if failed:
        print(f"gpu-check FAILED: {failed.name}: {failed.detail.splitlines()[0]}", file=sys.stderr)
        return 1
    print("gpu-check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
