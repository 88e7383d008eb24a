"""Fill the clip cache at a model's input size: `python -m vidtune.datasets.cache` with --model.

The data layer does not import trainer, so `python -m vidtune.datasets.cache` takes the decode size from
--height/--width only; this CLI is the same one with `--model NAME` looked up in
`trainer.models`:

    vidtune cache /data/rwf2000 --model mvit_v2_s
"""
from __future__ import annotations

import sys

from vidtune.datasets.cache import MODEL_CLI
from vidtune.datasets.cache import build_parser as cache_parser
from vidtune.datasets.cache import main as cache_main
from vidtune.trainer.models import get_spec


def clip_size(model: str) -> tuple[int, int]:
    """(height, width) of `model`'s input clips; ValueError naming the known models when unknown."""
    spec = get_spec(model)
    return spec.height, spec.width


def build_parser():
    """The data layer's cache CLI under this command's name (`--model` is looked up here)."""
    return cache_parser(prog=MODEL_CLI)


def main(argv: list[str] | None = None) -> int:
    return cache_main(argv, clip_size_of=clip_size, prog=MODEL_CLI)


if __name__ == "__main__":
    sys.exit(main())
