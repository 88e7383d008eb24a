"""bench.search_overhead's tables: the side-by-side wall time split, the stages before the first
trial, each trial, and who used the CPU (by process kind, and while the training epochs ran)."""
from __future__ import annotations

from bench.common import format_table
from bench.cpu_usage import CpuUsage
from bench.overhead_timeline import side_summary, stage_times

ROWS = (  # (key, label) of the side-by-side table, in print order
    ("wall_s", "wall time"),
    ("before_first_trial_s", "  before the first trial starts"),
    ("trials_running_s", "  trials running (any)"),
    ("between_trials_s", "  between trials (none running)"),
    ("after_last_trial_s", "  after the last trial ends"),
    ("training_s", "training epochs: sum of epoch_time_s"),
    ("evaluation_s", "evaluation: sum"),
    ("between_epochs_s", "between epochs (metrics, checkpoint, report): sum"),
    ("trial_start_to_first_epoch_s", "trial start -> first epoch, mean"),
    ("last_epoch_to_trial_end_s", "last epoch scored -> trial end, mean"),
    ("no_training_s", "wall time with no training epoch running"),
)


def report(plain: dict, search: dict | None, *, header: list[str],
           target: float | None) -> tuple[str, list[dict]]:
    """The printed tables and the JSON rows."""
    p = side_summary(plain["launch"], plain["exit"], plain["trials"])
    s = side_summary(search["launch"], search["exit"], search["trials"]) if search else {}
    estimated = search is not None and any(not e["exact"] for t in search["trials"] for e in t["epochs"])
    rows = [{"name": key, "plain_s": p[key], "search_s": s.get(key)} for key, _ in ROWS]
    table = [(label + (" (est.)" if estimated and key == "evaluation_s" else ""), p[key], s.get(key),
              s[key] - p[key] if s else None) for key, label in ROWS]
    stages = {"plain": stage_times(plain), "search": stage_times(search) if search else {}}
    for stage in dict.fromkeys([*stages["plain"], *stages["search"]]):
        a, b = stages["plain"].get(stage), stages["search"].get(stage)
        rows.append({"name": f"before_first_trial:{stage}", "plain_s": a, "search_s": b})
        table.append((f"    {stage}", a, b, b - a if a is not None and b is not None else None))
    if search:
        waits = [t["device_wait_s"] for t in search["trials"] if t["device_wait_s"] is not None]
        if waits:
            rows.append({"name": "device_wait_s", "plain_s": None, "search_s": sum(waits)})
            table.append(("search: waiting for the device (lease), sum", None, sum(waits), None))
    lines = [*header, "", format_table(("seconds", "plain", "search", "search-plain"), table)]
    if search:
        ratio = s["wall_s"] / p["wall_s"]
        verdict = ("" if target is None
                   else f" (target <= {target:g}: {'met' if ratio <= target else 'NOT met'})")
        lines += ["", f"ratio search / plain wall time: {ratio:.2f}{verdict}"]
        if estimated:
            lines.append("(est.): the search reported no epoch_start_ts / epoch_end_ts; its epochs are "
                         "placed from the report times less the plain side's mean evaluation and checkpoint "
                         "times")
    lines += ["", "per trial:", trial_table(plain, search)]
    if plain["cpu"].by_kind:
        lines += ["", cpu_table(plain["cpu"], search["cpu"] if search else None, trials=len(plain["trials"]))]
        lines += ["", training_cpu_table(*while_training(plain, search))]
    return "\n".join(lines), rows


def cpu_table(plain: CpuUsage, search: CpuUsage | None, *, trials: int, top: int = 14) -> str:
    """CPU seconds of each side: the whole machine's, and per process kind (processes started,
    CPU seconds), the kinds that used the most first; `trials`: how many each side ran (the note)."""
    sides = [plain, search] if search else [plain]
    kinds = sorted({k for side in sides for k in side.by_kind},
                   key=lambda k: -max(side.by_kind.get(k, (0, 0.0))[1] for side in sides))
    shown, rest = kinds[:top], kinds[top:]

    def cells(side: CpuUsage | None, names: list[str]) -> list:
        if side is None:
            return [None, None]
        n = sum(side.by_kind.get(k, (0, 0.0))[0] for k in names)
        return [n, sum(side.by_kind.get(k, (0, 0.0))[1] for k in names)]

    rows = [(k, *cells(plain, [k]), *cells(search, [k])) for k in shown]
    if rest:
        rows.append((f"{len(rest)} other kinds", *cells(plain, rest), *cells(search, rest)))
    rows.append(("not sampled (short-lived, other load)", None, plain.machine_busy_s - plain.sampled_s,
                 None, search.machine_busy_s - search.sampled_s if search else None))
    rows.append(("whole machine, busy", None, plain.machine_busy_s, None,
                 search.machine_busy_s if search else None))
    rows.append(("  = cores busy on average", None, plain.machine_busy_s / max(plain.wall_s, 1e-9), None,
                 search.machine_busy_s / max(search.wall_s, 1e-9) if search else None))
    table = format_table(("CPU seconds by process kind", "plain n", "plain cpu_s", "search n",
                          "search cpu_s"), rows)
    note = (f"(n: processes of that kind started; {trials} trials on each side. Every Ray Train run starts "
            "its controller, its workers and helper actors in fresh processes; a worker's DataLoader "
            "processes carry its title, ray::RayTrainWorker.)")
    return table + "\n" + note


# The processes that train: on the plain side its one process (its DataLoader processes are forks
# with the same title), in the search the Ray Train workers (their loader processes likewise).
PLAIN_TRAINING_KIND = "python -m bench.search_overhead"
SEARCH_TRAINING_KIND = "ray::RayTrainWorker"


def training_cpu(side: dict, training_kind: str) -> dict:
    """Cores used on average while the side's training epochs ran (each epoch's
    start .. start + epoch_time_s): by the training processes, by every other process the side
    started, and by the whole machine (which adds anything else running)."""
    windows = [(e["start"], e["start"] + e["train_s"]) for t in side["trials"] for e in t["epochs"]]
    covered, busy, by_kind = side["cpu"].within(windows)
    if covered <= 0:
        return {"seconds": 0.0, "training": None, "others": None, "machine": None, "others_by_kind": {}}
    others = {k: cpu / covered for k, cpu in sorted(by_kind.items(), key=lambda kv: -kv[1])
              if k != training_kind}
    return {"seconds": covered, "training": by_kind.get(training_kind, 0.0) / covered,
            "others": sum(others.values(), 0.0), "machine": busy / covered, "others_by_kind": others}


def while_training(plain: dict, search: dict | None) -> tuple[dict, dict | None]:
    """`training_cpu` of each side."""
    return (training_cpu(plain, PLAIN_TRAINING_KIND),
            training_cpu(search, SEARCH_TRAINING_KIND) if search else None)


def training_cpu_table(plain: dict, search: dict | None, top: int = 6) -> str:
    """Who used the cores while the training epochs ran, each side: training processes, the rest."""
    sides = [plain, search] if search else [plain]
    rows = [("the training processes (with their loader processes)", *(s["training"] for s in sides)),
            ("every other process the run started", *(s["others"] for s in sides)),
            ("the whole machine, busy", *(s["machine"] for s in sides))]
    if search and search["others_by_kind"]:
        rows += [(f"  search: {k}", *([None] if len(sides) == 2 else []), cores)
                 for k, cores in list(search["others_by_kind"].items())[:top]]
    head = ("cores used while training epochs ran (average)", "plain", *(["search"] if search else []))
    note = ("(A training that uses every core slows by more than the share the other processes take: its "
            "threads wait for each other at every parallel step. python -m bench.cpu_noise measures it.)")
    return format_table(head, rows, digits=2) + "\n" + note


def trial_table(plain: dict, search: dict | None) -> str:
    rows = []
    for side in (plain, search) if search else (plain,):
        for t in side["trials"]:
            ep = t["epochs"]
            rows.append((t["trial_id"], t["batch_size"], f"{t['lr']:.2e}", len(ep),
                         sum(e["train_s"] for e in ep), sum(e["end"] - e["start"] - e["train_s"] for e in ep),
                         ep[0]["start"] - t["start"] if ep else None, t.get("device_wait_s"),
                         t["end"] - ep[-1]["end"] if ep else None, t["end"] - t["start"],
                         t.get("cache_hit_frac"), t.get("concurrent")))
    return format_table(("trial", "batch", "lr", "epochs", "train_s", "eval_s", "start_s", "wait_s", "end_s",
                         "total_s", "cache_hit", "concurrent"), rows, digits=2)
