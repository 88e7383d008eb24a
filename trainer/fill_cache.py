"""Fill the clip cache at a model's input size: `python -m datasets.cache` with --model.

The data layer does not import trainer, so `python -m datasets.cache` takes the decode size from
--height/--width only; this CLI is the same one with `--model NAME` looked up in
`trainer.models`:

    python -m trainer.fill_cache /data/rwf2000 --model mvit_v2_s
"""
from __future__ import annotations

import sys

from datasets.cache import MODEL_CLI
from datasets.cache import main as cache_main
from trainer.models import get_spec


def clip_size(model: str) -> tuple[int, int]:
    """(height, width) of `model`'s input clips; ValueError naming the known models when unknown."""
    spec = get_spec(model)
    return spec.height, spec.width


def main(argv: list[str] | None = None) -> int:
    return cache_main(argv, clip_size_of=clip_size, prog=MODEL_CLI)


if __name__ == "__main__":
    sys.exit(main())
