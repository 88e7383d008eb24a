"""Write a trained Hugging Face model (`--model hf:...`) as `save_pretrained` does, for use outside vidtune.

    vidtune export-hf --checkpoint PATH OUT_FOLDER

`OUT_FOLDER` then loads with `AutoModelForVideoClassification.from_pretrained(OUT_FOLDER)` (and
its image processor with `AutoImageProcessor.from_pretrained`); the head's labels are
`non-violent` / `violent`. The checkpoint is a folder written by `vidtune train` or a search (or
its `checkpoint.pt`). The model's source (the hub id, in the Hugging Face cache, or the folder it
was trained from) must be readable: its image processor is copied from there. For a model
trained with `--weights-cache PATH`, run it with `HF_HUB_CACHE=PATH`.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vidtune export-hf", description=__doc__.split("\n\n")[0])
    p.add_argument("out", metavar="OUT_FOLDER", help="folder to write (created; must be empty if it exists)")
    p.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="checkpoint directory of an hf: model (printed by vidtune train / search), or its "
                   "checkpoint.pt")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"vidtune export-hf: error: {out} exists and is not an empty folder; name a new one",
              file=sys.stderr)
        return 2
    from vidtune.trainer.models import hf_models, registry  # heavy (torch, transformers)
    from vidtune.trainer.training import checkpointing  # heavy (torch)

    try:
        state = checkpointing.load_checkpoint(args.checkpoint)
        name = state["spec"]["name"]
        if not registry.is_hf_model(name):
            raise hf_models.HFModelError(f"checkpoint {args.checkpoint} is of model {name!r}, not a Hugging "
                                         "Face one (hf:...); only those are written with save_pretrained")
        folder = hf_models.export_pretrained(state["model"], name[len(registry.HF_PREFIX):], out)
    except (checkpointing.CheckpointError, hf_models.HFModelError, registry.WeightsError) as e:
        print(f"vidtune export-hf: error: --checkpoint: {e}", file=sys.stderr)
        return 2
    print(f"wrote {folder} (AutoModelForVideoClassification.from_pretrained({str(folder)!r}))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
