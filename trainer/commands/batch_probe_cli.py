"""`vidtune batch-probe`: print the largest per-device batch size whose training step fits in
memory (`vidtune.trainer.training.batch_probe` measures it; imported once the flags are checked, since
it needs torch and the model).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from vidtune.datasets.cli import read_options
from vidtune.datasets.config import DataConfig
from vidtune.flags import add_flags, flag_specs, join_negative_values, option
from vidtune.trainer.training.config import TrainConfig

DEFAULT_HEADROOM = 0.10   # vidtune.trainer.training.batch_probe.HEADROOM (tests/test_batch_probe.py checks
# they agree)


@dataclass(frozen=True)
class ProbeOptions:
    """The probe CLI's own flags. Its --precision, --channels-last and --compile are
    `TrainConfig`'s (`TRAINING_FLAGS`: each changes what a step holds) and the clip size
    `DataConfig`'s (`CLIP_FLAGS`), as in training."""

    # No argparse choices: the registry imports torch, which --help does not wait for; an
    # unknown name is refused by get_spec, listing the known ones.
    model: str = option("mvit_v2_s", flag="--model", metavar="NAME",
                        help="model name, as `vidtune train --model` takes it")
    device: str | None = option(None, flag="--device", metavar="DEVICE",
                                help="torch device, e.g. cuda:1 or cpu (default: first GPU, else CPU)")
    start: int = option(2, flag="--start", metavar="B", ge=1, help="first batch size tried")
    limit: int = option(256, flag="--limit", metavar="B", ge=1, help="largest batch size tried")
    headroom: float = option(DEFAULT_HEADROOM, flag="--headroom", metavar="F", ge=0, lt=1,
                             help="share of the device's memory a step must leave free")


PROBE_FLAGS = tuple(flag_specs(ProbeOptions))
TRAINING_FLAGS = tuple(s for s in flag_specs(TrainConfig)
                       if s.path in ("precision", "channels_last", "compile"))
CLIP_FLAGS = tuple(s for s in flag_specs(DataConfig) if s.path in ("num_frames", "height", "width"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vidtune batch-probe",
                                description="Print the largest per-device batch size whose training step "
                                "fits in memory.")
    add_flags(p, PROBE_FLAGS + TRAINING_FLAGS, group_of=lambda s: "probe", suppress=False)
    add_flags(p, CLIP_FLAGS, group_of=lambda s: "clip size", suppress=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(join_negative_values(argv, PROBE_FLAGS + CLIP_FLAGS))
    try:
        opts = read_options(ProbeOptions, PROBE_FLAGS, args)
        clip = read_options(DataConfig, CLIP_FLAGS, args)
        from vidtune.trainer.training.batch_probe import (  # heavy (torch): once the flags are checked
            probe_batch_size,
        )

        probe = probe_batch_size(opts.model, precision=args.precision, device=opts.device,
                                 num_frames=clip.num_frames, height=clip.height, width=clip.width,
                                 start=opts.start, limit=opts.limit, headroom=opts.headroom,
                                 channels_last=args.channels_last, compile=args.compile)
    except ValueError as e:   # ConfigError (a flag's bounds) is one
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(probe.describe(), file=sys.stderr)   # stdout keeps the bare number, for scripts
    print(probe.batch_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
