"""vidtune: find the fastest and most accurate way to fine-tune a video transformer.

One namespace over the repository's three layers, each kept in its own top-level folder:

- `vidtune.datasets` (folder `datasets/`): find, probe, cache and read the videos;
- `vidtune.trainer` (folder `trainer/`): models, precision, the training loop, one Ray Train run;
- `vidtune.tune` (folder `tune/`): the search (Ray Tune + Optuna), its MLflow record and summary.

Beneath them, what every layer shares: `vidtune.flags` (a config field's flag, defined once),
`vidtune.config_file` (the one `--config` reader) and `vidtune.errors` (`DataError`). The
`vidtune` command is `vidtune.cli`. `vidtune/datasets`, `vidtune/trainer` and `vidtune/tune` are
links to the top-level folders (namespace packages: they have no `__init__.py`).
"""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("vidtune")
except PackageNotFoundError:   # a clone imported without being installed
    __version__ = "0+unknown"
