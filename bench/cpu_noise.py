"""How much other processes' CPU use slows a training that uses every core: prints a table.

A search runs, beside each training, Ray's daemons, Train's controller and helper actors and
the search's own driver; each wakes up now and then for a few milliseconds (polls, heartbeats,
metrics). bench/search_overhead.py shows how many cores they take while epochs run. This script
shows what such a load costs: the same training steps of a model (random clips, the project's
`trainer.training.loop.train_one_epoch`, no data loading) timed alone and beside background processes
that each spin `--burst-ms` out of every `--period-ms` (together `--noise-cores` cores), at each
torch thread count of `--threads`. Rounds interleave the cases; the table gives medians.

With torch on all the cores, a thread that loses its core for a burst holds up the others at the
next parallel step, so the training slows by more than the share of CPU the background takes.

    python -m bench.cpu_noise                                  # tiny, 1 and 2 threads, 0 / 0.1 / 0.2 cores
    python -m bench.cpu_noise --threads 2 --noise-cores 0 0.05 0.1 0.2 0.4 --json noise.json
    python -m bench.cpu_noise --quick                          # 1 round of 4 steps, 1 thread: checks it runs
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from bench.common import format_table, write_json

# One background process: spin `burst` seconds, sleep the rest of `period`, until killed.
NOISE = ("import sys, time\n"
         "burst, period = float(sys.argv[1]), float(sys.argv[2])\n"
         "while True:\n"
         "    t = time.perf_counter()\n"
         "    while time.perf_counter() - t < burst: pass\n"
         "    time.sleep(max(0.0, period - burst))\n")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="model from trainer/models/registry.py (default tiny)")
    p.add_argument("--batch-size", type=int, default=8, help="clips per step (default 8)")
    p.add_argument("--steps", type=int, default=30, help="training steps per timing (default 30)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every case (default 3)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, os.cpu_count() or 1],
                   help="torch thread counts to time (default: 1 and this machine's cores)")
    p.add_argument("--noise-cores", type=float, nargs="+", default=[0.0, 0.1, 0.2],
                   help="background load in cores, spread over --noise-processes (default 0 0.1 0.2)")
    p.add_argument("--noise-processes", type=int, default=2, help="background processes (default 2)")
    p.add_argument("--burst-ms", type=float, default=2.0, help="each background burst, ms (default 2)")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the rows as JSON")
    p.add_argument("--quick", action="store_true",
                   help="a few seconds, to check the script runs: 4 steps, 1 round, 1 thread, "
                   "0 and 0.2 cores")
    return p


def apply_quick(args: argparse.Namespace) -> None:
    """--quick: shrink the run to one short timing per case (its figures are too noisy to quote)."""
    if args.quick:
        args.steps, args.rounds, args.threads, args.noise_cores = 4, 1, [1], [0.0, 0.2]


def check_args(args: argparse.Namespace) -> None:
    for flag, value in (("--batch-size", args.batch_size), ("--steps", args.steps), ("--rounds", args.rounds),
                        ("--noise-processes", args.noise_processes)):
        if value < 1:
            raise SystemExit(f"{flag} {value}: must be >= 1")
    if min(args.threads) < 1:
        raise SystemExit(f"--threads {min(args.threads)}: must be >= 1")
    if not args.burst_ms > 0:
        raise SystemExit(f"--burst-ms {args.burst_ms}: must be > 0")
    for cores in args.noise_cores:
        if not 0 <= cores / args.noise_processes < 1:
            raise SystemExit(f"--noise-cores {cores:g}: must be >= 0 and below --noise-processes "
                             f"({args.noise_processes}); each process can take at most one core")


class Background:
    """`processes` spinning background processes taking `cores` cores in all (none for 0)."""

    def __init__(self, cores: float, processes: int, burst_ms: float):
        duty = cores / processes
        self.args = (burst_ms / 1000, burst_ms / 1000 / duty) if duty > 0 else None
        self.processes = processes
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Background:
        if self.args:
            self.procs = [subprocess.Popen([sys.executable, "-c", NOISE, *map(str, self.args)])
                          for _ in range(self.processes)]
            time.sleep(0.2)      # running before the timing starts
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


class Training:
    """The model, optimiser and a fixed set of random clips (uint8 B x T x H x W x C, as the
    DataLoader gives them), trained with the project's epoch function."""

    def __init__(self, model: str, batch_size: int, steps: int):
        import torch  # heavy (seconds): --help and argument errors answer without torch

        from vidtune.datasets.transforms import ClipTransform  # imports torch: as above
        from vidtune.trainer.models.registry import build_model, get_spec  # imports torch: as above
        from vidtune.trainer.training.loop import make_optimizer, make_scheduler  # imports torch: as above
        from vidtune.trainer.training.precision import choose_precision  # imports torch: as above

        spec = get_spec(model)
        g = torch.Generator().manual_seed(0)
        self.batches = [(torch.randint(0, 256, (batch_size, spec.num_frames, spec.height, spec.width, 3),
                                       dtype=torch.uint8, generator=g),
                         torch.randint(0, 2, (batch_size,), generator=g)) for _ in range(steps)]
        torch.manual_seed(0)
        self.model = build_model(model, weights="none")
        self.optimizer = make_optimizer(self.model, 1e-4, 0.05, "cpu")
        self.scheduler = make_scheduler(self.optimizer, 10 ** 6, 0.0)
        self.policy = choose_precision("fp32", torch.device("cpu"))
        self.scaler = self.policy.make_scaler()
        self.transform = ClipTransform(spec.mean, spec.std, train=True)

    def epoch(self) -> tuple[float, float]:
        """(wall s, this process's CPU s) of one pass over the clips."""
        from vidtune.trainer.training.loop import train_one_epoch  # imports torch (see Training.__init__)

        wall, cpu = time.perf_counter(), time.process_time()
        train_one_epoch(self.model, self.batches, transform=self.transform, optimizer=self.optimizer,
                        scheduler=self.scheduler, scaler=self.scaler, policy=self.policy, device="cpu")
        return time.perf_counter() - wall, time.process_time() - cpu


def measure(args: argparse.Namespace) -> list[dict]:
    import torch  # heavy (see Training.__init__)

    training = Training(args.model, args.batch_size, args.steps)
    cases = [(threads, cores) for threads in args.threads for cores in args.noise_cores]
    times: dict[tuple[int, float], list[tuple[float, float]]] = {case: [] for case in cases}
    for threads in args.threads:            # warm-up: allocator, kernels, thread pool
        torch.set_num_threads(threads)
        training.epoch()
    for r in range(args.rounds):
        for threads, cores in cases:
            torch.set_num_threads(threads)
            with Background(cores, args.noise_processes, args.burst_ms):
                times[(threads, cores)].append(training.epoch())
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    rows = []
    for threads, cores in cases:
        wall = statistics.median(w for w, _ in times[(threads, cores)])
        cpu = statistics.median(c for _, c in times[(threads, cores)])
        alone = statistics.median(w for w, _ in times[(threads, args.noise_cores[0])])
        rows.append({"threads": threads, "noise_cores": cores, "wall_s": wall, "cpu_s": cpu,
                     "clips_per_s": args.steps * args.batch_size / wall, "x_first": wall / alone})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    apply_quick(args)
    check_args(args)
    rows = measure(args)
    first = args.noise_cores[0]
    print(f"\n{args.model}, batch {args.batch_size}, {args.steps} steps a timing, median of {args.rounds} "
          f"rounds; background: {args.noise_processes} processes, {args.burst_ms:g} ms bursts; "
          f"{os.cpu_count()} cores")
    print(format_table(("threads", "background cores", "wall s", "clips/s", f"x time at {first:g} cores",
                        "CPU s"),
                       [(r["threads"], r["noise_cores"], r["wall_s"], r["clips_per_s"], r["x_first"],
                         r["cpu_s"]) for r in rows], digits=2))
    if args.json:
        write_json(args.json, {"model": args.model, "batch_size": args.batch_size, "steps": args.steps,
                               "rounds": args.rounds, "noise_processes": args.noise_processes,
                               "burst_ms": args.burst_ms, "quick": args.quick, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
