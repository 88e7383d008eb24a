"""Violence probability of videos with a trained checkpoint, on the CPU or a GPU, without Ray.

    vidtune predict --checkpoint PATH VIDEO [VIDEO ...]
    vidtune predict --checkpoint models:/NAME/VERSION [--mlflow-uri URI] VIDEO [VIDEO ...]

The checkpoint is a folder written by `vidtune train` or a search, or a model a search registered
in MLflow (`models:/NAME/VERSION` or `models:/NAME@ALIAS`, looked up in --mlflow-uri's registry).

The model sees fixed-length clips (`num_frames` frames, every `frame_stride`-th). By default a
video's score is that of the one clip validation scored, centred in the video
(`trainer.serving.scoring_rule`, the rule the registered MLflow model follows too); with `--aggregation
max` or `mean` the clip window slides over the video every `--window-stride` seconds, each
window's start time and probability are printed, and the video's score is their max or mean.
A video that is missing or cannot be decoded is named on stderr; the others are still scored;
the exit code is then 1 (2 for a bad checkpoint or flag).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from vidtune.datasets.cli import read_options
from vidtune.flags import ConfigError, add_flags, flag_specs, join_negative_values, option
from vidtune.trainer.serving.scoring_rule import AGGREGATIONS, CENTRE, SCORING_RULE
from vidtune.trainer.training.config import TrainConfig


@dataclass(frozen=True)
class PredictOptions:
    """The prediction CLI's flags; its --precision is `TrainConfig.precision`'s (`PRECISION_FLAG`)."""

    checkpoint: str | None = option(None, flag="--checkpoint", metavar="PATH",
                                    help="checkpoint directory (printed by trainer.commands.train) or its "
                                    "checkpoint.pt, or a registered model models:/NAME/VERSION (printed by a "
                                    "search); required")
    mlflow_uri: str | None = option(None, flag="--mlflow-uri", metavar="URI",
                                    help="the MLflow store whose registry holds a models:/ checkpoint "
                                    "(default $MLFLOW_TRACKING_URI, else sqlite:///mlruns.db, a search's "
                                    "default)")
    aggregation: str = option(CENTRE, flag="--aggregation", choices=AGGREGATIONS,
                              help="a video's score: centre (the centred clip validation scored; the "
                              "registered model's default) | max | mean (over clip windows every "
                              "--window-stride seconds)")
    window_stride: float = option(1.0, flag="--window-stride", metavar="S", gt=0,
                                  help="seconds between window starts (--aggregation max or mean)")
    batch_size: int = option(8, flag="--batch-size", metavar="N", ge=1,
                             help="windows scored per forward pass")
    device: str = option("auto", flag="--device", metavar="DEVICE",
                         help="auto (the GPU when present) | cpu | cuda | cuda:N")


PREDICT_FLAGS = tuple(flag_specs(PredictOptions))
PRECISION_FLAG = tuple(s for s in flag_specs(TrainConfig) if s.path == "precision")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vidtune predict", description=__doc__.split("\n\n")[0],
                                epilog=f"Scoring rule: {SCORING_RULE}")
    p.add_argument("videos", nargs="+", metavar="VIDEO", help="video files to score")
    add_flags(p, PREDICT_FLAGS + PRECISION_FLAG, group_of=lambda s: "prediction", suppress=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(join_negative_values(argv, PREDICT_FLAGS))
    try:
        opts = read_options(PredictOptions, PREDICT_FLAGS, args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if opts.checkpoint is None:
        p.error("the following arguments are required: --checkpoint")
    from vidtune.trainer.serving import scoring  # heavy (torch, the model): flags first
    from vidtune.trainer.training import checkpointing  # heavy (torch): flags first

    try:
        device = scoring.device_named(opts.device)
        with tempfile.TemporaryDirectory(prefix="vidtune-predict-") as tmp:
            registered = opts.checkpoint.startswith("models:/")
            path = registered_checkpoint(opts, tmp) if registered else opts.checkpoint
            predictor = scoring.Predictor.from_checkpoint(path, device, args.precision)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (checkpointing.CheckpointError, RuntimeError, ValueError) as e:
        where = f"--checkpoint {opts.checkpoint}: " if isinstance(e, checkpointing.CheckpointError) else ""
        print(f"error: {where}{e}", file=sys.stderr)
        return 2
    failed = 0
    name = predictor.positive_name
    for video in args.videos:
        try:
            if opts.aggregation == CENTRE:
                score = scoring.video_score(predictor, Path(video))
                print(f"{video}: P({name}) {score:.3f} (centre clip)", flush=True)
                continue
            windows = scoring.score_video(predictor, Path(video), opts.window_stride, opts.batch_size)
        except scoring.VideoReadError as e:
            print(f"error: {e}", file=sys.stderr)
            failed += 1
            continue
        probs = [q for _, q in windows]
        score = max(probs) if opts.aggregation == "max" else sum(probs) / len(probs)
        print(f"{video}: P({name}) {score:.3f} ({opts.aggregation} over {len(windows)} "
              f"window{'s' if len(windows) > 1 else ''})")
        for start, q in windows:
            print(f"  {start:8.2f} s  {q:.3f}")
        sys.stdout.flush()
    if failed:
        print(f"{failed} of {len(args.videos)} video(s) could not be read", file=sys.stderr)
    return 1 if failed else 0


DEFAULT_STORE = "sqlite:///mlruns.db"   # a search's default --mlflow-uri


def registered_checkpoint(opts: PredictOptions, folder: str) -> Path:
    """The checkpoint file of the registered model `opts.checkpoint` (models:/...), downloaded
    into `folder`. ConfigError naming --checkpoint or --mlflow-uri when either names nothing."""
    from vidtune.trainer.serving import mlflow_model  # heavy (MLflow, ~2 s): only for a models:/ checkpoint

    uri = opts.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_STORE
    flag = "--mlflow-uri" if opts.mlflow_uri else "$MLFLOW_TRACKING_URI" if uri != DEFAULT_STORE else \
        "--mlflow-uri (default)"
    missing = mlflow_model.missing_store(uri)
    if missing:
        raise ConfigError(flag, f"{uri}: {missing}; pass the --mlflow-uri the search wrote to, to find "
                          f"{opts.checkpoint}")
    try:
        return mlflow_model.download_checkpoint(opts.checkpoint, uri, folder)
    except mlflow_model.ModelURIError as e:
        raise ConfigError("--checkpoint", str(e)) from None


if __name__ == "__main__":
    sys.exit(main())
