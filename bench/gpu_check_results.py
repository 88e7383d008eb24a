"""bench.gpu_check's checks: each a function of what a step produced (a table, the search's MLflow
store read back, the device lease's record) that returns its one-line detail or raises
CheckFailed naming what is wrong; `run_checks` runs them in order and `format_checks` prints them."""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from mlflow.tracking import MlflowClient

PARENT_TAG = "mlflow.parentRunId"
EPOCH_METRICS = ("clips_per_s", "peak_mem_mb", "concurrent_trainings")


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
    """What every trial's workers reported they trained with (`trainer.training.settings`, tags on its run):
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


# A trial frees its GPU memory and its process group before it gives the GPU back: what its
# process still holds then (NVML) is its CUDA context and libraries, about what this check's own
# process holds after the same kinds of work (`check_process_record`), give or take this much
# (an allowance, not a measurement; a trial's mvit_v2_s weights with AdamW's state are ~560 MB).
HANDED_OVER_MB = 256.0
# Without that figure (--part search), only a bound a leak of any weights would cross.
HANDED_OVER_UNKNOWN_MB = 2048.0
NVML_CUDA_SLACK_MB = 512.0   # NVML's and CUDA's "used" may differ by the driver's reservation


def check_hand_over(records: list[list[dict]], context_mb: float | None = None) -> str:
    """The device lease's record (device_lease.json): every trial was granted its GPU holding no
    GPU memory (NVML: no CUDA context, so it waited in host memory), and gave it back holding its
    live context (more than 0: what NVML counts for the process) but at most `context_mb` (this
    process's own footprint after freeing, `check_process_record`) + HANDED_OVER_MB."""
    require(len(records) == 1, f"{len(records)} device_lease.json files in the search's folder, expected 1")
    record = records[0]
    grants = [e for e in record if e["event"] == "grant"]
    releases = [e for e in record if e["event"] == "release"]
    require(grants and releases, f"the lease record has {len(grants)} grants and {len(releases)} releases")
    early = [f"{e['owner']}: {e['device_mb']} MB" for e in grants if (e["device_mb"] or 0) > 0]
    require(not early, "a trial held GPU memory (a CUDA context) before its lease: " + "; ".join(early))
    bound = context_mb + HANDED_OVER_MB if context_mb is not None else HANDED_OVER_UNKNOWN_MB
    left = [f"{e['owner']}: {e['device_mb'] if e['device_mb'] is None else round(e['device_mb'])} MB"
            for e in releases if e["device_mb"] is None or not 0 < e["device_mb"] <= bound]
    require(not left, f"a trial gave its GPU back recording 0 (its context uncounted) or more than "
            f"{bound:.0f} MB: " + "; ".join(left))
    most = max(e["device_mb"] for e in releases)
    return (f"{len(grants)} grants at 0 MB (no CUDA context before the lease), {len(releases)} releases "
            f"<= {most:.0f} MB (bound {bound:.0f})")


def check_process_record(process_mb: float, nvml_used_mb: float | None, cuda_used_mb: float) -> str:
    """What the lease records for a process with a context (`process_device_mb`), here this one,
    alone on its GPU, after freeing, against NVML's used memory of the GPU by UUID: more than 0,
    at most NVML's figure; and the fallback (CUDA's used memory of the device) at least as much.
    Where NVML does not list this process (a container) the record is that fallback, which may
    count the driver's own reservation differently from NVML: NVML_CUDA_SLACK_MB either way."""
    require(nvml_used_mb is not None, "NVML cannot be asked here (pynvml, the driver's libnvidia-ml)")
    require(0 < process_mb <= nvml_used_mb + NVML_CUDA_SLACK_MB, f"the lease would record {process_mb:.0f} "
            f"MB for this process; NVML says {nvml_used_mb:.0f} MB are used on its GPU")
    require(cuda_used_mb >= process_mb - 1, f"the fallback (CUDA's used memory) reads {cuda_used_mb:.0f} MB, "
            f"less than this process's {process_mb:.0f} MB")
    return (f"this process holds {process_mb:.0f} MB after freeing (NVML: {nvml_used_mb:.0f} MB used on "
            f"the GPU; the fallback reads {cuda_used_mb:.0f})")


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
