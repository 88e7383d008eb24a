"""vidtune: find the fastest and most accurate way to fine-tune a video transformer.

From Python (`vidtune.api`, the layer above the search; docs/python.md):

    import vidtune
    result = vidtune.search(data="/data/rwf2000", model="mvit_v2_s", num_samples=12, epochs=5)
    result.best, result.trials                    # the best trial; every trial (a pandas DataFrame)
    vidtune.predict(result, ["clip.mp4"])         # P(violent) per video
    vidtune.load("vidtune-results/NAME")          # a search read back from its folder
    vidtune.ui(result)                            # MLflow's UI on the search's store

One namespace over the repository's three layers, each kept in its own top-level folder:

- `vidtune.datasets` (folder `datasets/`): find, probe, cache and read the videos;
- `vidtune.trainer` (folder `trainer/`): models, precision, the training loop, one Ray Train run;
- `vidtune.tune` (folder `tune/`): the search (Ray Tune + Optuna), its MLflow record and summary.

Beneath them, what every layer shares: `vidtune.flags` (a config field's flag, defined once),
`vidtune.config_file` (the one `--config` reader) and `vidtune.errors` (every error a user can act
on). The
`vidtune` command is `vidtune.cli`. `vidtune/datasets`, `vidtune/trainer` and `vidtune/tune` are
links to the top-level folders (namespace packages: they have no `__init__.py`).
"""
import importlib
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("vidtune")
except PackageNotFoundError:   # a clone imported without being installed
    __version__ = "0+unknown"


# The API's names, imported on first use: `import vidtune` (and so `vidtune --help`) loads no torch,
# Ray or pandas. name -> "module:attribute"
_API = {
    "search": "vidtune.api.calls:search",
    "train": "vidtune.api.calls:train",
    "predict": "vidtune.api.calls:predict",
    "load": "vidtune.api.result:load",
    "SearchResult": "vidtune.api.result:SearchResult",
    "TrainResult": "vidtune.api.result:TrainResult",
    "TrialResult": "vidtune.tune.outputs.results:TrialResult",
    "ui": "vidtune.mlflow_ui:ui",
    "video_model": "vidtune.own_model_spec:video_model",
    "synth": "vidtune.datasets.synthetic:generate",
    "errors": "vidtune.errors",        # a module: vidtune.errors.ConfigError, ...
}
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    target = _API.get(name)
    if target is None:
        raise AttributeError(f"module 'vidtune' has no attribute {name!r}")
    module, _, attribute = target.partition(":")
    value = importlib.import_module(module)
    value = getattr(value, attribute) if attribute else value
    globals()[name] = value     # once: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})
