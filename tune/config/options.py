"""The search's options: one typed configuration, the CLI generated from it, and the config file.

`SearchOptions` holds the training run every trial starts from (`train`, a `TrainConfig` with its
`DataConfig`), the search space, the resources, the tracking settings and the run switches. Each
field is declared once, with its flag (`vidtune.flags.option`); the flags, the config file's
keys and `--dry-run`'s printout all come from those declarations, so a new training option is
reachable from the search as soon as `TrainConfig` has it. The batch size and learning rate are
the search's to choose: their flags here are `--batch-sizes` and `--lr-min`/`--lr-max`.

Precedence, lowest first: the dataclass defaults < the `--smoke-test` preset (or the demo's,
without `--data`) < the config file (`--config FILE`, TOML or YAML, keys as the flags) < flags
given on the command line. `parse_options` also runs the checks that need neither Ray nor the
dataset (bounds, inverted ranges, paths); they raise `ConfigError` naming the flag, which
`tune.search.main` turns into exit code 2.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from vidtune.config_file import ConfigFile, read_config_file
from vidtune.datasets.config import DataConfig
from vidtune.flags import (
    ConfigError,
    FlagSpec,
    add_flags,
    build,
    check_bounds,
    check_folder_name,
    flag_of,
    flag_specs,
    join_negative_values,
    option,
)
from vidtune.trainer.training.config import TrainConfig
from vidtune.trainer.training.gpus import simulated_gpus
from vidtune.trainer.training.report_keys import Key
from vidtune.tune.config import searched
from vidtune.tune.config.layout import STATE_FOLDER
from vidtune.tune.config.option_groups import Resources, Tracking, check_resources, check_tracking

OBJECTIVES = (Key.VAL_ACC.value, Key.VAL_F1.value, "pareto")   # declared here only (tune.outputs.results
# reads it)
LR_SCALINGS = ("none", "linear", "sqrt")
TPE_KINDS = ("univariate", "multivariate")
SAMPLERS = ("tpe", "gp")
# The search's defaults (ASHA's grace 0.4 x --epochs, one bracket, TPE, at most 6 random starts)
# won leave-one-table-out replays of recorded learning curves: docs/search-defaults.md.
GRACE_SHARE = 0.4
ASHA_BRACKETS = 1
SAMPLER = "tpe"
RANDOM_START_CAP = 6
CPU_BATCH_SIZES = (4, 8)           # the tiny model at 64 px: larger batches gain nothing on 2 cores
GPU_BATCH_SIZES = (8, 16, 32)      # mvit_v2_s at 16 x 224 x 224 fits 32 in bf16 on a 40 GB card

# What every trial draws from the search space (`tune.config.searched`: batch size and lr), not set.
SEARCHED = tuple(f"train.{p.name}" for p in searched.PARAMS if p.switch is None)


@dataclass(frozen=True)
class SearchSpace:
    """What Optuna draws each trial's values from."""

    batch_sizes: tuple[int, ...] | None = option(
        None, flag="--batch-sizes", metavar="B,B,..", ge=1,
        help=f"batch sizes to try per worker (default {','.join(map(str, CPU_BATCH_SIZES))} on CPU, "
        f"{','.join(map(str, GPU_BATCH_SIZES))} with GPUs)")
    lr_min: float = option(1e-4, flag="--lr-min", metavar="LR", gt=0,
                           help="lower bound of the log-uniform learning rate")
    lr_max: float = option(3e-3, flag="--lr-max", metavar="LR", gt=0,
                           help="upper bound of the log-uniform learning rate")
    search_weight_decay: bool = option(False, flag="--search-weight-decay",
                                       help="also search weight decay (log-uniform)")
    weight_decay_min: float = option(1e-4, flag="--weight-decay-min", metavar="WD", gt=0,
                                     help="lower weight-decay bound")
    weight_decay_max: float = option(0.1, flag="--weight-decay-max", metavar="WD", gt=0,
                                     help="upper weight-decay bound")
    lr_scaling: str = option("none", flag="--lr-scaling", choices=LR_SCALINGS,
                             help="the searched lr is meant for --lr-reference-batch; a trial of batch B "
                             "trains with it x B/ref (linear), x sqrt(B/ref) (sqrt) or as drawn (none); the "
                             "trial's table, CSV and MLflow show the lr it trained with (default none)")
    lr_reference_batch: int | None = option(None, flag="--lr-reference-batch", metavar="B", ge=1,
                                            help="the batch size --lr-min/--lr-max are meant for under "
                                            "--lr-scaling (default the smallest of --batch-sizes)")
    probe_batch_size: bool = option(False, flag="--probe-batch-size", help="drop batch sizes above the "
                                    "largest that fits in GPU memory (measured once on a GPU before the "
                                    "search)")


@dataclass(frozen=True)
class SearchOptions:
    """Everything `vidtune search` can be told."""

    train: TrainConfig = field(default_factory=TrainConfig)
    space: SearchSpace = field(default_factory=SearchSpace)
    # 20 trials: more reach a narrow top, and ASHA stops the weak ones (docs/search-defaults.md)
    num_samples: int = option(20, flag="--num-samples", metavar="N", ge=1, group="search",
                              help="number of trials")
    objective: str = option(Key.VAL_ACC.value, flag="--objective", choices=OBJECTIVES, group="search",
                            help="what to maximise: val_acc, val_f1, or pareto (accuracy and clips/s "
                            "together, reports the Pareto front) (default val_acc)")
    early_stop: bool = option(True, flag="--no-early-stop", group="search", help="never stop trials early "
                              "(ASHA is on by default when --epochs >= 3, off with pareto)")
    grace_period: int | None = option(None, flag="--grace-period", metavar="E", ge=1, group="search",
                                      help="epochs each trial runs before ASHA may stop it (default "
                                      "--grace-share of --epochs)")
    grace_share: float = option(GRACE_SHARE, flag="--grace-share", metavar="F", gt=0, group="search",
                                help="without --grace-period: ASHA's grace period as this share of --epochs, "
                                f"rounded, at least 1 epoch (default {GRACE_SHARE:g})")
    reduction_factor: int = option(2, flag="--reduction-factor", metavar="R", ge=2, group="search",
                                   help="ASHA keeps the best 1/R of the trials at each rung (epochs grace "
                                   "x R^k)")
    asha_brackets: int = option(ASHA_BRACKETS, flag="--asha-brackets", metavar="N", ge=1, group="search",
                                help="ASHA brackets (Hyperband's hedge against early ranks that mislead): "
                                "bracket k first compares trials at grace x R^k epochs; each trial joins one "
                                f"(default {ASHA_BRACKETS})")
    # multivariate: the best lr moves with the batch size, which univariate TPE cannot see
    tpe: str = option("multivariate", flag="--tpe", choices=TPE_KINDS, group="search",
                      help="Optuna TPE: multivariate (batch size and lr together) or univariate (each "
                      "parameter alone) (default multivariate)")
    sampler: str = option(SAMPLER, flag="--sampler", choices=SAMPLERS, group="search",
                          help="Optuna sampler after the random start: tpe (kind from --tpe) or gp (Gaussian "
                          f"process, Optuna's GPSampler) (default {SAMPLER})")
    random_start_trials: int | None = option(None, flag="--random-start-trials", metavar="N", ge=1,
                                             group="search", help="random trials before TPE takes over "
                                             f"(default min({RANDOM_START_CAP}, max(2, --num-samples / 2)))")
    optuna_storage: str | None = option(None, flag="--optuna-storage", metavar="URL", group="search",
                                        help="where the Optuna study is stored, to open it with "
                                        "optuna-dashboard (default: optuna.db beside a sqlite:/// MLflow "
                                        "store, else in a local --storage folder; in memory when both are "
                                        "remote)")
    study_name: str | None = option(None, flag="--study-name", metavar="NAME", group="search",
                                    help="Optuna study name (default: the search's --name)")
    time_budget: str | None = option(None, flag="--time-budget", metavar="T", group="search",
                                     help="start no new trial after this wall time (2h, 90m, 3600s, 1h30m; a "
                                     "plain number is seconds); the running trials finish")
    warm_start: str | None = option(None, flag="--warm-start", metavar="PATH", group="search",
                                    help="seed the study with an earlier search's finished trials: its "
                                    "folder (<storage>/<name>) or its Optuna storage "
                                    "(sqlite:///optuna.db#study); trials outside this space are left out")
    resources: Resources = field(default_factory=Resources)
    storage: str | None = option(None, flag="--storage", metavar="PATH", group="where it runs",
                                 help="results and checkpoints: a local folder, NFS or s3:// (shared on a "
                                 "cluster) (default ./vidtune-results)")
    name: str | None = option(None, flag="--name", metavar="NAME", group="where it runs",
                              help="the search's name, its folder under --storage (default "
                              "vidtune-<date-time>; with --resume, the latest in --storage)")
    resume: bool = option(False, flag="--resume", group="where it runs",
                          help="continue an interrupted search (--name, or the latest one in --storage)")
    trust_state: bool = option(False, flag="--trust-state", group="where it runs",
                               help="with --resume: load a saved state that your state key did not sign "
                               "(a search made by an older vidtune, or copied from elsewhere); loading it "
                               "runs any code inside, so only for a search you made")
    tracking: Tracking = field(default_factory=Tracking)
    config: str | None = option(None, flag="--config", metavar="FILE", group="run",
                                help="TOML or YAML file of these options (keys as the flags, e.g. lr-min or "
                                "lr_min); flags override it")
    smoke_test: bool = option(False, flag="--smoke-test", group="run", help="shrink everything for a first "
                              "run: 2 trials, 1 epoch, batch size 4, one loader process")
    dry_run: bool = option(False, flag="--dry-run", group="run",
                           help="validate everything, print the resolved configuration, run nothing")
    verbose: bool = option(False, flag="--verbose", group="run", help="also show Ray's own output (its "
                           "progress tables, the workers' logs) instead of writing it to the search's log "
                           "file")
    quiet: bool = option(False, flag="--quiet", group="run",
                         help="print only the summary at the end (and errors)")

    @property
    def demo(self) -> bool:
        """No dataset given: the search runs on the embedded generated dataset."""
        return not self.train.data.root

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["train"]["batch_size"], d["train"]["lr"]     # the search draws them
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, default=list)


def base_config(o: SearchOptions) -> TrainConfig:
    """The training run every trial starts from: `o.train` with a batch size and learning rate
    the search will replace (the first candidate, the middle of the log range)."""
    return o.train.with_overrides(batch_size=(o.space.batch_sizes or (8,))[0],
                                  lr=math.sqrt(o.space.lr_min * o.space.lr_max))


GROUPS = {DataConfig: "data", TrainConfig: "model and training", SearchSpace: "search space",
          Resources: "where it runs", Tracking: "tracking"}
SPECS: tuple[FlagSpec, ...] = tuple(flag_specs(SearchOptions, exclude=SEARCHED))

# The `--smoke-test` preset (Ray's examples style): a first run that finishes in a minute or two.
# Clip size stays the model's: torchvision's MViTs are built for one input size.
SMOKE_TEST: dict[str, Any] = {"num_samples": 2, "train.epochs": 1, "space.batch_sizes": (4,),
                              "train.data.loader_workers": 1, "early_stop": False}

# The embedded demo's preset (no --data, no --smoke-test): enough epochs, at learning rates that
# suit the `tiny` model, for the demo's trials to show real learning (val_acc well above 0.5)
# rather than four coin flips. The tiny model's accuracy leaves chance only from about epoch 3,
# so ASHA may stop trials from there on, not on epoch-1 noise; 4 trials keep it to ~2 minutes.
# Flags and a config file override it.
DEMO: dict[str, Any] = {"train.epochs": 6, "space.lr_min": 2e-4, "space.lr_max": 2e-3, "grace_period": 3,
                        "num_samples": 4}

EXAMPLES = """\
examples:
  vidtune search                                   # the demo: generated videos, CPU, ~2 minutes
  vidtune search --smoke-test --data ~/RWF-2000    # a first look at your own data
  vidtune search --data ~/RWF-2000 --model mvit_v2_s --weights kinetics \\
      --epochs 5 --num-samples 12 --batch-sizes 8,16,32   # a real search on one GPU
  vidtune search --config search.toml --dry-run    # check a config file, run nothing
  vidtune search --resume                          # continue the latest interrupted search

presets: without --data the demo runs --num-samples 4 --epochs 6 --lr-min 2e-4 --lr-max 2e-3
--grace-period 3; --smoke-test runs --num-samples 2 --epochs 1 --batch-sizes 4 --loader-workers 1
--no-early-stop.
Precedence: defaults < preset < --config FILE < flags."""


def build_parser() -> argparse.ArgumentParser:
    """The CLI. Flags not given are left out of the parsed namespace (SUPPRESS), so the config
    file and the presets can fill them; the defaults shown are the fields'."""
    p = argparse.ArgumentParser(
        prog="vidtune search",
        description="Search batch size and learning rate (Ray Tune + Optuna) for fine-tuning a video\n"
        "transformer; every trial is a Ray Train run recorded in MLflow. With no arguments it runs\n"
        "a short demo on generated data on the CPU (see the presets at the end).",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, SPECS, group_of=lambda s: GROUPS.get(s.owner, "search"))
    return p


# Tables a search config file may hold beside its top-level keys (read like them): `[search]`,
# and one per nested part named by its field ([train], [train.data], [space], [resources],
# [tracking]), whose keys may also be the fields' names, as --dry-run prints them.
CONFIG_TABLES = ("search",)
KNOWN_KEYS = ("known options are the flags of `vidtune search --help` without the leading dashes "
              "(lr-min or lr_min), at the top level or in a [search] table, or the fields' names in a table "
              "per part as --dry-run prints them ([train], [train.data], [space], [resources], [tracking])")


def _bound_keys(p: searched.Param) -> str:
    """The config-file keys of a searched parameter's bound options: `lr-min and lr-max`."""
    flag = {f.name: f.metadata["flag"] for f in fields(SearchSpace)}
    return " and ".join(flag[b].removeprefix("--") for b in (p.low, p.high) if isinstance(b, str))


# Keys of trainer.commands.train's config that the search draws itself -> the keys that bound it instead.
SEARCHED_KEYS = {key: _bound_keys(p) for p in searched.PARAMS if p.switch is None
                 for key in (p.name, p.name.replace("_", "-"))}


def load_config_file(path: str) -> ConfigFile:
    """Read a `--config` file (TOML or YAML; `vidtune.config_file.read_config_file`, which says the
    keys and tables) of every option but `--config` itself. ConfigError naming the file and key."""
    return read_config_file(
        path, [s for s in SPECS if s.path != "config"], known=KNOWN_KEYS, flag=flag_of(SPECS, "config"),
        tables=CONFIG_TABLES, instead="a .toml or .yaml options file",
        hints={k: f"the search chooses it: set {v} instead" for k, v in SEARCHED_KEYS.items()})


def _read_given(argv: Sequence[str] | None) -> tuple[dict[str, Any], ConfigFile | None]:
    """The flags on the command line ({dotted path: value}) and the --config file they name."""
    argv = list(sys.argv[1:] if argv is None else argv)
    given = vars(build_parser().parse_args(join_negative_values(argv, SPECS)))
    return given, load_config_file(given["config"]) if given.get("config") else None


def given_options(argv: Sequence[str] | None) -> dict[str, Any]:
    """{dotted path: value} of every option set on the command line or by its --config file, no
    preset or default: what a --resume line asks for (`tune.state.saved_options.resumed_options`)."""
    given, loaded = _read_given(argv)
    return {**(loaded.values if loaded else {}), **given}


def parse_options(argv: Sequence[str] | None) -> SearchOptions:
    """Flags + config file + preset -> validated SearchOptions (ConfigError on bad input; a check
    failed by a value the file set names the file and key)."""
    given, loaded = _read_given(argv)
    return resolve(given, loaded)


def resolve(given: dict[str, Any], loaded: ConfigFile | None = None) -> SearchOptions:
    """{dotted path: value} set by the caller (flags, or `vidtune.search`'s keywords) + the config
    file they name + the preset -> validated SearchOptions. The one place the precedence is applied
    (defaults < preset < config file < given) and the checks run: the CLI and the Python API share it."""
    merged: dict[str, Any] = {}
    if given.get("smoke_test"):
        merged.update(SMOKE_TEST)
    if loaded:
        merged.update(loaded.values)
        if merged.get("smoke_test") and not given.get("smoke_test"):
            merged = {**SMOKE_TEST, **merged}
    merged.update(given)
    if not merged.get("train.data.root") and not merged.get("smoke_test"):
        epochs = merged.get("train.epochs", DEMO["train.epochs"])
        if "grace_period" not in merged and epochs < DEMO["grace_period"]:
            merged["grace_period"] = epochs   # the preset's grace period, not above --epochs
        merged = {**DEMO, **merged}
    opts = build(SearchOptions, merged)
    try:
        validate(opts)
    except ConfigError as e:
        raise (loaded.blame(e, SPECS, given) if loaded else e) from None
    return opts


def validate(o: SearchOptions) -> None:
    """Checks that need neither Ray nor the dataset: every declared bound, then the rules that
    tie two options together, then paths. Raises ConfigError naming the flag."""
    check_bounds(o, SPECS)
    s, r = o.space, o.resources
    for d in searched.domains(s).values():
        if d.low > d.high:
            low, _, high = d.flags.partition("/")
            raise ConfigError(d.flags, f"the bounds are inverted: {low} {d.low:g} is above {high} "
                              f"{d.high:g}; pass the smaller value as {low}")
    if r.gpus_per_worker is not None and r.gpus_per_trial is not None and \
            abs(r.gpus_per_worker * r.workers_per_trial - r.gpus_per_trial) > 1e-9:
        raise ConfigError("--gpus-per-trial", f"{r.gpus_per_trial:g} disagrees with --gpus-per-worker "
                          f"{r.gpus_per_worker:g} x --workers-per-trial {r.workers_per_trial}; give only one "
                          "of the two")
    check_resources(r)
    simulated_gpus()   # VIDTUNE_SIMULATE_GPUS, when set, is a number of GPUs (ConfigError naming it)
    if o.name is not None:
        _check_name(o.name)
    if o.grace_share > 1:
        raise ConfigError("--grace-share", f"{o.grace_share:g} is above 1: the grace period is a share of "
                          "--epochs; pass a number in (0, 1], e.g. 0.3")
    if o.grace_period is not None and o.grace_period > o.train.epochs:
        raise ConfigError("--grace-period", f"{o.grace_period} is above --epochs {o.train.epochs}: a trial "
                          f"ends before ASHA may stop it; pass --grace-period {o.train.epochs} or less, or "
                          "more --epochs")
    if o.resume and (o.time_budget or o.warm_start):
        raise ConfigError("--time-budget/--warm-start" if o.time_budget and o.warm_start else
                          "--time-budget" if o.time_budget else "--warm-start",
                          "not with --resume: a resumed search keeps the budget and the study it "
                          "started with")
    if o.trust_state and not o.resume:
        raise ConfigError("--trust-state", "only with --resume (it lets a resume load a state your key did "
                          "not sign)")
    check_tracking(o.tracking)
    if o.verbose and o.quiet:
        raise ConfigError("--verbose/--quiet", "give one of them, not both")
    if o.optuna_storage and not o.optuna_storage.startswith(("sqlite:", "postgresql", "mysql")):
        raise ConfigError("--optuna-storage", f"{o.optuna_storage}: give a database URL such as "
                          "sqlite:///optuna.db")
    if not o.demo and not Path(o.train.data.root).expanduser().exists():
        raise ConfigError("--data", f"{o.train.data.root} does not exist; pass the folder of videos (or a "
                          "CSV manifest), or leave --data out to run the demo")


def _check_name(name: str) -> None:
    """--name is one folder under --storage: never a path that leaves it (`../x`, `/etc`)."""
    check_folder_name("--name", name, what="the search's folder", under="--storage", example="rwf-mvit")
    if name == STATE_FOLDER:   # a search's Ray state is its subfolder of this name (tune.config.layout)
        raise ConfigError("--name", f"{name!r} is the name of the subfolder that keeps a search's Ray state; "
                          "pick another name (e.g. rwf-mvit)")


def with_defaults_for_hardware(o: SearchOptions, *, cluster_gpus: float) -> SearchOptions:
    """Fill the hardware-dependent options (batch sizes, GPUs per worker) from what Ray offers."""
    space, res = o.space, o.resources
    has_gpu = cluster_gpus > 0
    if space.batch_sizes is None:
        space = replace(space, batch_sizes=GPU_BATCH_SIZES if has_gpu else CPU_BATCH_SIZES)
    if res.gpus_per_worker is None:
        if res.gpus_per_trial is not None:
            res = replace(res, gpus_per_worker=res.gpus_per_trial / res.workers_per_trial)
        else:
            res = replace(res, gpus_per_worker=1.0 if has_gpu else 0.0)
    return replace(o, space=space, resources=res)


def gpus_per_trial(o: SearchOptions) -> float:
    """GPUs one trial holds (its workers together)."""
    r = o.resources
    if r.gpus_per_trial is not None:
        return r.gpus_per_trial
    return (r.gpus_per_worker or 0.0) * r.workers_per_trial
