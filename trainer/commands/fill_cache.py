"""`vidtune cache`: fill the clip cache at a model's input size.

The data layer's cache CLI (`vidtune.datasets.cache_cli`) takes the decode size from
--height/--width only, since the data layer does not import the trainer; this is the same CLI
with `--model NAME` looked up in `vidtune.trainer.models.registry`:

    vidtune cache /data/rwf2000 --model mvit_v2_s
"""
from __future__ import annotations

import argparse
import sys

from vidtune.datasets.cache_cli import MODEL_CLI
from vidtune.datasets.cache_cli import build_parser as cache_parser
from vidtune.datasets.cache_cli import main as cache_main


def clip_size(model: str) -> tuple[int, int]:
    """(height, width) of `model`'s input clips; ValueError naming the known models when unknown."""
    from vidtune.trainer.models.registry import (  # heavy (torch): only once --model is checked
        get_spec,
    )

    spec = get_spec(model)
    return spec.height, spec.width


def build_parser() -> argparse.ArgumentParser:
    """The data layer's cache CLI under this command's name (`--model` is looked up here)."""
    return cache_parser(prog=MODEL_CLI)


def main(argv: list[str] | None = None) -> int:
    return cache_main(argv, clip_size_of=clip_size, prog=MODEL_CLI)


if __name__ == "__main__":
    sys.exit(main())
