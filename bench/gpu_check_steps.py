"""bench.gpu_check's steps: `GpuCheck` runs each on this GPU (the precision table, decoding,
learning, the search in a subprocess, --compile, the batch probe, a hub architecture) in one work
folder, keeps their figures, and hands what each produced to its check (bench.gpu_check_results)."""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import torch

from bench import gpu_decode, learning_check
from bench.gpu_check_results import (
    TrialRun,
    check_auto_precision,
    check_cudnn_benchmark,
    check_hand_over,
    check_precision_table,
    check_process_record,
    load_trial_runs,
    mlflow_steps,
    require,
)
from vidtune.datasets.cache import FrameCache
from vidtune.datasets.config import DataConfig
from vidtune.datasets.index import build_index
from vidtune.datasets.synthetic import generate
from vidtune.trainer.models.registry import get_spec
from vidtune.trainer.training.batch_probe import make_step_trial, probe_batch_size
from vidtune.trainer.training.config import TrainConfig
from vidtune.trainer.training.device_memory import process_device_mb
from vidtune.trainer.training.gpus import nvml_device_used_mb
from vidtune.trainer.training.precision import (
    choose_precision,
    configure_backends,
    default_device,
    device_uuid,
    free_memory,
    peak_reserved_mb,
    reset_peak_memory,
)
from vidtune.trainer.training.run import TRAINED, build_run, place_model, run_epoch

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL = "mvit_v2_s"
EXPERIMENT = "gpu-check"
PARTS = ("all", "local", "search")   # --part: which checks run
DECODE_VIDEOS = 32   # 4 batches of 8 clips (16 frames of 224 px): 512 frames, 4 seeded steps a side


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



class GpuCheck:
    """The steps of one run, sharing the work folder and what earlier steps produced."""

    def __init__(self, args: argparse.Namespace, work: Path):
        self.args, self.work, self.figures = args, work, {}
        self.device = default_device()          # the first GPU (main refused to run without one)
        self.runs: list[TrialRun] = []
        self.lease_record: list[list[dict]] = []   # the search's device_lease.json (trainer.cluster.lease)
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
        """One epoch of MODEL trained as a Train worker trains it (`trainer.training.run`: build_run,
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

    def process_record(self) -> str:
        """The lease's record of a process (`process_device_mb`) for this one after it trained and
        decoded, against NVML's used memory of its GPU by UUID (run before the search: alone)."""
        free_memory(self.device)
        mine = process_device_mb(SimpleNamespace(device=self.device))
        free, total = torch.cuda.mem_get_info(self.device)
        used = nvml_device_used_mb(device_uuid(self.device))
        self.figures["process_record"] = {"process_mb": mine, "nvml_used_mb": used,
                                          "cuda_used_mb": (total - free) / 2**20}
        return check_process_record(mine, used, (total - free) / 2**20)

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
                 ("learns (fp16, bf16)", self.learns),
                 ("lease record vs NVML", self.process_record)]
        search = [(f"{a.num_samples}-trial search", self.search),
                  *mlflow_steps(self.runs, a.num_samples, a.epochs,   # self.runs: filled by the search step
                                capability=torch.cuda.get_device_capability(self.device)),
                  ("hand-over", lambda: check_hand_over(self.lease_record, self.figures.get(
                      "process_record", {}).get("process_mb")))]
        # after the search: a crash while compiling must not cost the search's checks
        later = [("batch probe", self.batch_probe), ("compiled, channels-last", self.compiled_epoch),
                 ("hub architecture (VideoMAE)", self.hub_architecture)]
        return {"all": local + search + later, "local": local + later, "search": search}[a.part]
