"""One fine-tuning run without a search, on Ray Train (one or more workers, GPUs when present).

    vidtune train --data DIR --model tiny --epochs 3 --batch-size 8 --lr 3e-4
    vidtune train --config best_config.json --epochs 10    # retrain a search's best trial

Prints one line per epoch as it ends and, at the end, the best checkpoint (by val_acc), which
`vidtune predict --checkpoint PATH VIDEO...` uses. Rerunning with the same --name and
--storage resumes after the last finished epoch. `--config` reads a search's best_config.json
(its "train_config") or a TOML/YAML file of options, keys as the flags; flags given override it.
Exit codes: 0 done, 1 training failed, ran out of memory or diverged (its loss became inf or
NaN: lower --lr), 2 bad input (reported before Ray starts; workers a cluster given by --address
cannot hold, once connected).
This module is the command (flags, config file, the checks before Ray); the run on Ray is
`trainer.commands.train_run`, imported once the inputs are checked.
"""
from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from vidtune.config_file import CONFIG_SUFFIXES, ConfigFile, read_config_file
from vidtune.datasets.config import DataConfig
from vidtune.datasets.index import VideoIndex
from vidtune.errors import DataError
from vidtune.flags import (
    ConfigError,
    FlagSpec,
    add_flags,
    build,
    check_bounds,
    check_folder_name,
    flag_of,
    join_negative_values,
)
from vidtune.trainer.cluster.capacity import check_gpus_per_worker, local_capacity
from vidtune.trainer.commands.train_options import PROG, RUN_FLAGS, RunOptions, check_capacity
from vidtune.trainer.ray_setup.launch import TRAIN_FLAGS, check_training_inputs, joins_cluster
from vidtune.trainer.ray_setup.ray_start import RayStartError, import_failure_message
from vidtune.trainer.training.config import TrainConfig
from vidtune.trainer.training.report_keys import Key

GROUPS = {TrainConfig: "model and training", DataConfig: "data"}


ALL_FLAGS = TRAIN_FLAGS + RUN_FLAGS

# The tables a config file may hold: a search's best_config.json keeps the trial's TrainConfig
# (to_dict() field names, the data's in a nested "data" table) in "train_config", the rest of it
# being the trial's row, which is described at start, not read.
DOCUMENT_TABLE = "train_config"
KNOWN_KEYS = ("known: the flags of `vidtune train --help` without their dashes (batch-size or "
              "batch_size, no-cache), or TrainConfig's fields as a search's best_config.json writes them in "
              "its train_config (the data's in a \"data\" table)")
BEST_CONFIG_HINT = ("a search's best_config.json needs its \"train_config\" (written by searches since it "
                    "was added): pass the trial's --batch-size and --lr as flags instead")
SEARCH_NAME_KEYS = ("search", "search_name", "experiment")   # best_config.json's key naming its search


def build_parser() -> argparse.ArgumentParser:
    """Every `TrainConfig` field's flag (the same names as the search's), plus `RunOptions`'. Flags
    not given are left out of the parsed namespace, so the config file can set them."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_flags(p, TRAIN_FLAGS, group_of=lambda s: GROUPS[s.owner])
    add_flags(p, RUN_FLAGS, group_of=lambda s: "where it runs")
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    return build_parser().parse_args(join_negative_values(argv, ALL_FLAGS))


def load_config_file(path: str) -> ConfigFile:
    """Read `--config` (`vidtune.config_file.read_config_file`): a search's best_config.json, whose
    "train_config" is read and the rest (the trial's row) kept as `about`; or a JSON/TOML/YAML
    file of options, keys as the flags (`batch-size`, `data` = the dataset path, `no-cache`) or
    as TrainConfig's fields (`grad_accum_steps`, a `data` table of DataConfig's). ConfigError
    naming the file and key; the bounds are checked later, with the flags (`check_inputs`)."""
    return read_config_file(
        path, [s for s in ALL_FLAGS if s.path != "config"], known=KNOWN_KEYS,
        flag=flag_of(RUN_FLAGS, "config"),
        document=DOCUMENT_TABLE, suffixes=(".json", *CONFIG_SUFFIXES),
        instead="a search's best_config.json (download it from the search's MLflow run or its experiment "
        "folder) or a .json/.toml/.yaml file of options",
        hints={"trial_id": BEST_CONFIG_HINT, "objective": BEST_CONFIG_HINT})


def describe(loaded: ConfigFile) -> str:
    """The line printed at start: the file and, for a search's best_config.json, which trial."""
    best = loaded.about
    if best is None:
        return f"config: {loaded.file}"
    trial = best.get("name") or best.get("trial_id")      # the row's name: the trial's
    search = next((best[k] for k in SEARCH_NAME_KEYS if best.get(k)), None)
    what = "the best trial" + (f" {trial}" if trial else "")
    what += f" of search {search}" if search else " of a search"
    acc = best.get(Key.BEST_VAL_ACC, best.get(Key.VAL_ACC))   # val_acc: an older search's file
    if isinstance(acc, (int, float)) and not isinstance(acc, bool) and math.isfinite(acc):
        what += f", val_acc {acc:.3f}"
    return f"config: {loaded.file} ({what})"


def merged(specs: Sequence[FlagSpec], given: Mapping[str, Any], loaded: ConfigFile | None) -> dict[str, Any]:
    """{path: value} of `specs`: the `--config` file's, then those `given` ({dotted path: value}:
    the flags set, whose dests are the fields' paths, or `vidtune.train`'s keywords)."""
    paths = {s.path for s in specs}
    values = {k: v for k, v in loaded.values.items() if k in paths} if loaded else {}
    values.update({k: v for k, v in given.items() if k in paths})
    return values


def config_from_args(args: argparse.Namespace, loaded: ConfigFile | None = None) -> TrainConfig:
    """The TrainConfig of the defaults, then the `--config` file (`loaded`, read here when not
    given), then the flags given."""
    if loaded is None and getattr(args, "config", None):
        loaded = load_config_file(args.config)
    return build(TrainConfig, merged(TRAIN_FLAGS, vars(args), loaded))


def run_options(args: argparse.Namespace, loaded: ConfigFile | None = None) -> RunOptions:
    """The RunOptions of the defaults, then the `--config` file, then the flags given."""
    return build(RunOptions, merged(RUN_FLAGS, vars(args), loaded))


def check_inputs(cfg: TrainConfig, where: RunOptions) -> VideoIndex:
    """Everything checkable before Ray starts; returns the dataset index (handed to the workers).
    Raises ConfigError / DataError naming the flag or file at fault."""
    check_bounds(where, RUN_FLAGS)   # first: validate_config may load torch to read --weights
    if where.name is not None:      # Ray Train puts the run in --storage/NAME: never outside it
        check_folder_name("--name", where.name, what="the run's folder", under="--storage",
                          example="rwf-best")
    check_gpus_per_worker(where.gpus_per_worker, where.workers, flag="--gpus-per-worker",
                          workers_flag="--workers", whole="--gpus-per-worker 1")
    index = check_training_inputs(cfg, batch_sizes=(cfg.batch_size,), workers=where.workers,
                                  batch_flag="--batch-size", workers_flag="--workers", storage=where.storage,
                                  show=lambda index: print(index.summary(), flush=True))
    if not joins_cluster(where.address):   # the machine a local Ray will have, read before it starts
        check_capacity(where, local_capacity(), place="this machine",
                       more="pass --address of a Ray cluster that has more")
    return index


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        loaded = load_config_file(args.config) if getattr(args, "config", None) else None
        if loaded:
            print(describe(loaded), flush=True)
        cfg, where = config_from_args(args, loaded), run_options(args, loaded)
        try:
            index = check_inputs(cfg, where)
        except ConfigError as e:
            raise (loaded.blame(e, ALL_FLAGS, vars(args)) if loaded else e) from None
    except (ConfigError, DataError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:      # torch or Ray cannot load: most often a memory limit (ulimit -v)
        print(f"{PROG}: error: {import_failure_message(e)}", file=sys.stderr)
        return 1
    try:
        from vidtune.trainer.commands.train_run import (  # heavy (Ray Train, torch): inputs checked first
            run,
        )

        return run(cfg, where, index)
    except ConfigError as e:      # the cluster cannot hold the run's workers (checked once Ray is up)
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except RayStartError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except ImportError as e:
        print(f"{PROG}: error: {import_failure_message(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
