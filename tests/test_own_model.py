"""Your own model, `--model package.module:function`: a factory in a module of the user's folder
is imported, its input spec read, built once and given a dummy clip on the driver; each way it can
be wrong is one line naming it, exit 2, before Ray (`vidtune search` and `vidtune train`); it
reaches the Ray workers (`py_modules`) and the registered MLflow model (`code_paths`). The slow
test searches one from a folder outside the repository, retrains it from best_config.json and
scores a video with its registered model in a process that cannot import its module."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

import vidtune
from vidtune.datasets.config import DataConfig
from vidtune.flags import ConfigError
from vidtune.own_model_spec import IMAGENET_MEAN, checked_input_spec, video_model
from vidtune.trainer.commands import train, train_run
from vidtune.trainer.models import own_models
from vidtune.trainer.models.registry import (
    build_model,
    classifier,
    get_spec,
    is_own_model,
    prepare_model_memory_format,
)
from vidtune.trainer.ray_setup.launch import (
    DEFAULT_HEALTH_CHECK_INTERVAL_S,
    HEALTH_CHECK_ENV,
    init_ray,
    validate_config,
    worker_runtime_env,
)
from vidtune.trainer.training import model_checks
from vidtune.trainer.training.config import TrainConfig
from vidtune.tune import search

REPO = Path(__file__).resolve().parents[1]
MODULE = "vt_own_models"    # the user's module: a name no installed package has

# What a user writes: one good factory, and one of each mistake (the test's name says which).
FACTORIES = '''
import torch
from torch import nn

from vidtune.own_model_spec import video_model


class SmallNet(nn.Module):
    """(B, 3, T, H, W) -> (B, num_classes): one strided Conv3d, a mean over space and time."""

    def __init__(self, num_classes=2, extra=0):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv3d(3, 8, 3, stride=2, padding=1), nn.ReLU())
        self.head = nn.Linear(8, num_classes + extra)

    def forward(self, x):
        return self.head(self.stem(x).mean(dim=(2, 3, 4)))


@video_model(num_frames=4, height=32, width=32)
def build(num_classes: int = 2) -> nn.Module:
    return SmallNet(num_classes)


NOT_CALLABLE = 3


def no_spec(num_classes=2):
    return SmallNet(num_classes)


def bad_spec(num_classes=2):
    return SmallNet(num_classes)


bad_spec.input_spec = {"num_frames": 4, "height": 0, "width": 32}


@video_model(num_frames=4, height=32, width=32)
def not_module(num_classes=2):
    return "a model"


@video_model(num_frames=4, height=32, width=32)
def wrong_shape(num_classes=2):
    return SmallNet(num_classes, extra=1)


@video_model(num_frames=4, height=32, width=32)
def raises(num_classes=2):
    raise RuntimeError("out of ideas")


@video_model(num_frames=4, height=32, width=32)
def forward_raises(num_classes=2):
    return nn.Sequential(nn.Flatten(), nn.Linear(5, num_classes))
'''
BROKEN = "import torch\nraise ImportError('cannot import name Missing from somewhere')\n"

# (--model, what its one line says)
BAD_FACTORIES = {
    "module not found": ("vt_no_such_module:build", "no module named vt_no_such_module in the current"),
    "module raises": ("vt_broken_module:build", "importing vt_broken_module failed (ImportError: cannot"),
    "attribute missing": (f"{MODULE}:nope", f"module {MODULE} ("),
    "not callable": (f"{MODULE}:NOT_CALLABLE", "NOT_CALLABLE is not callable (its type: int)"),
    "no input spec": (f"{MODULE}:no_spec", "has no input spec; decorate it with @vidtune.video_model"),
    "invalid input spec": (f"{MODULE}:bad_spec", "its input_spec height must be a whole number >= 1, not 0"),
    "returns no module": (f"{MODULE}:not_module", "returned a str, not a torch.nn.Module"),
    "wrong output shape": (f"{MODULE}:wrong_shape", "gave shape (1, 3), not logits of shape (1, 2)"),
    "factory raises": (f"{MODULE}:raises", "as raises(num_classes=2) raised RuntimeError: out of ideas"),
    "forward raises": (f"{MODULE}:forward_raises", "a float clip of shape (1, 3, 4, 32, 32) "
                       "(B x C x T x H x W) raised RuntimeError"),
    "not a name": ("my models:build", "write it as package.module:function"),
}


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    """The user's folder, the current one, holding their module of factories; sys.path, the
    modules imported and what Ray would ship are put back afterwards."""
    folder = tmp_path / "user"
    folder.mkdir()
    (folder / f"{MODULE}.py").write_text(FACTORIES)
    (folder / "vt_broken_module.py").write_text(BROKEN)
    (folder / "videos").mkdir()                 # --data exists: the model is checked before indexing
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(own_models, "_TO_SHIP", {})
    monkeypatch.setattr(own_models, "_SEEN", {})
    before = set(sys.modules)
    yield folder
    for name in set(sys.modules) - before:
        if name.split(".")[0].startswith(("vt_", "pkg_")):
            del sys.modules[name]


@pytest.fixture
def train_never_starts_ray(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("vidtune train started Ray")

    monkeypatch.setattr(train_run, "init_ray", refuse)


def _one_error_line(err: str, command: str, model: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"vidtune {command}: error: --model: own model "), lines[0]
    assert model in lines[0]
    return lines[0]


@pytest.mark.parametrize("case", sorted(BAD_FACTORIES))
def test_a_bad_factory_is_one_line_and_exit_2_before_ray_from_search_and_train(
        case, user_folder, capsys, no_ray, train_never_starts_ray):
    model, says = BAD_FACTORIES[case]
    assert search.main(["--data", "videos", "--storage", str(user_folder / "results"), "--model", model]) == 2
    assert says in _one_error_line(capsys.readouterr().err, "search", model)
    assert train.main(["--data", "videos", "--model", model]) == 2
    assert says in _one_error_line(capsys.readouterr().err, "train", model)


def test_the_good_factory_passes_the_checks_with_its_spec_and_will_be_shipped(user_folder):
    name = f"{MODULE}:build"
    validate_config(TrainConfig(model=name, data=DataConfig(root="videos")))
    spec = get_spec(name)
    assert (spec.name, spec.num_frames, spec.height, spec.width) == (name, 4, 32, 32)
    assert spec.mean == IMAGENET_MEAN and is_own_model(name) and not is_own_model("hf:org/model")
    # Ray's workers get its file (they may not see this folder); the registered model carries it too
    shipped = str((user_folder / f"{MODULE}.py").resolve())
    assert worker_runtime_env()["py_modules"] == [shipped]
    assert own_models.code_paths(name) == [shipped]
    model = build_model(name)
    assert model(torch.zeros(2, 3, 4, 32, 32)).shape == (2, 2)
    assert classifier(model) is model.head      # what --freeze-backbone-epochs keeps training


def test_a_cluster_joined_with_address_gets_the_module_with_the_job(user_folder, monkeypatch):
    import ray  # the real ray.init is replaced: nothing starts or connects

    get_spec(f"{MODULE}:build")            # the driver's check loads it
    joined = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: joined.update(kw))
    monkeypatch.setenv(HEALTH_CHECK_ENV, DEFAULT_HEALTH_CHECK_INTERVAL_S)    # init_ray sets it; undone after
    assert init_ray(address="ray://head:10001", runtime_env={"py_modules": ["/opt/other.whl"]})
    shipped = str((user_folder / f"{MODULE}.py").resolve())
    assert joined["address"] == "ray://head:10001"
    assert joined["runtime_env"]["py_modules"] == ["/opt/other.whl", shipped]


def test_a_module_edited_since_it_was_imported_is_read_again(user_folder):
    """A notebook's second search after mymodels.py changed checks the code Ray will ship."""
    name = f"{MODULE}:build"
    assert get_spec(name).num_frames == 4
    module = user_folder / f"{MODULE}.py"
    module.write_text(FACTORIES.replace("num_frames=4", "num_frames=6"))
    stat = module.stat()
    os.utime(module, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))    # a later edit
    assert get_spec(name).num_frames == 6


def test_kinetics_weights_are_refused_and_a_state_dict_loads(user_folder, tmp_path):
    name = f"{MODULE}:build"
    cfg = TrainConfig(model=name, data=DataConfig(root="videos"))
    with pytest.raises(ConfigError, match=r"--weights: own model .*:build has no Kinetics weights"):
        validate_config(cfg.with_overrides(weights="kinetics"))
    trained = build_model(name)
    torch.save(trained.state_dict(), tmp_path / "mine.pth")
    validate_config(cfg.with_overrides(weights=str(tmp_path / "mine.pth")))
    loaded = build_model(name, weights=str(tmp_path / "mine.pth"))
    torch.testing.assert_close(loaded.head.weight, trained.head.weight)
    torch.save(nn.Linear(3, 3).state_dict(), tmp_path / "other.pth")
    with pytest.raises(ConfigError, match="--weights: .*does not fit model"):
        validate_config(cfg.with_overrides(weights=str(tmp_path / "other.pth")))


def test_a_file_path_names_the_module_from_any_folder(user_folder, tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    name = f"{user_folder / MODULE}.py:build"
    validate_config(TrainConfig(model=name, data=DataConfig(root=str(user_folder / "videos"))))
    assert get_spec(name).num_frames == 4
    assert own_models.code_paths(name) == [str((user_folder / f"{MODULE}.py").resolve())]
    with pytest.raises(ValueError, match=r"no file .*nowhere\.py"):
        get_spec(f"{tmp_path / 'nowhere.py'}:build")


def test_a_package_ships_its_top_folder_and_an_installed_module_nothing(user_folder):
    package = user_folder / "pkg_video" / "nets"
    package.mkdir(parents=True)
    (user_folder / "pkg_video" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "small.py").write_text(FACTORIES)
    name = "pkg_video.nets.small:build"
    assert get_spec(name).height == 32
    assert own_models.code_paths(name) == [str((user_folder / "pkg_video").resolve())]
    assert own_models.code_location(torchvision, "torchvision:x") is None     # site-packages
    assert own_models.code_location(vidtune, "vidtune:x") is None             # on every node already
    assert own_models.code_location(json, "json:x") is None                   # the standard library


def test_freeze_backbone_needs_a_linear_head(user_folder):
    (user_folder / "vt_headless.py").write_text(textwrap.dedent("""
        from torch import nn
        from vidtune.own_model_spec import video_model

        @video_model(num_frames=2, height=8, width=8)
        def build(num_classes=2):
            return nn.Sequential(nn.Conv3d(3, num_classes, (2, 8, 8)), nn.Flatten())
        """))
    cfg = TrainConfig(model="vt_headless:build", data=DataConfig(root="videos"))
    validate_config(cfg)
    with pytest.raises(ConfigError, match="--freeze-backbone-epochs: own model vt_headless:build has no"):
        model_checks.check_model(cfg.with_overrides(freeze_backbone_epochs=1))


def test_channels_last_converts_the_conv3d_layers_and_leaves_a_conv2d_alone():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv3d(3, 4, 3))
    prepare_model_memory_format(model, channels_last=True)     # model.to(...) raised on the Conv2d
    assert model[1].weight.is_contiguous(memory_format=torch.channels_last_3d)
    assert model[0].weight.is_contiguous()


def test_the_decorator_sets_a_checked_spec():
    @video_model(num_frames=8, height=64, width=48, mean=(0.5, 0.5, 0.5), std=[0.2, 0.2, 0.2])
    def build(num_classes=2):
        return nn.Identity()

    assert build.input_spec == {"num_frames": 8, "height": 64, "width": 48, "mean": (0.5, 0.5, 0.5),
                                "std": (0.2, 0.2, 0.2)}
    with pytest.raises(ValueError, match="std must be above 0"):
        video_model(num_frames=8, height=64, width=64, std=(0.2, 0.0, 0.2))
    with pytest.raises(ValueError, match=r"mean must be three numbers"):
        checked_input_spec({"num_frames": 8, "height": 8, "width": 8, "mean": (0.5, 0.5)})
    with pytest.raises(ValueError, match="has unknown key"):
        checked_input_spec({"num_frames": 8, "height": 8, "width": 8, "frames": 8})


# -- through Ray: a search, a retraining, the registered model --------------------------------

OWN_NET = textwrap.dedent('''
    """A researcher's own video model, kept outside vidtune's repository."""
    import torch
    from torch import nn

    from vidtune import video_model


    class OwnNet(nn.Module):
        def __init__(self, num_classes=2):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv3d(3, 8, 3, stride=2, padding=1), nn.ReLU())
            self.head = nn.Linear(8, num_classes)

        def forward(self, x):
            return self.head(self.stem(x).mean(dim=(2, 3, 4)))


    @video_model(num_frames=4, height=32, width=32)
    def build(num_classes: int = 2) -> nn.Module:
        return OwnNet(num_classes)


    @video_model(num_frames=4, height=32, width=32)
    def wrong(num_classes: int = 2) -> nn.Module:
        return OwnNet(num_classes + 1)
    ''')
LOAD_AND_SCORE = ("import json, sys, mlflow, mlflow.pyfunc\n"
                  "mlflow.set_tracking_uri(sys.argv[1])\n"
                  "assert 'ownnet' not in sys.modules\n"
                  "try:\n    import ownnet\n    print('IMPORTABLE')\nexcept ImportError:\n    pass\n"
                  "scores = mlflow.pyfunc.load_model(sys.argv[2]).predict(sys.argv[3:])\n"
                  "print('SCORES', json.dumps(scores))\n")


def _run(argv: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
    return subprocess.run([sys.executable, *argv], cwd=cwd, env={**clean, **env}, capture_output=True,
                          text=True, timeout=400)


@pytest.mark.slow
def test_an_own_model_outside_the_repository_is_searched_retrained_and_served(
        shared_ray, synthetic_root, tmp_path):
    models, run_here, elsewhere = (tmp_path / name for name in ("models", "run", "elsewhere"))
    for folder in (models, run_here, elsewhere):
        folder.mkdir()
    (models / "ownnet.py").write_text(OWN_NET)
    assert REPO not in models.parents

    # refused before Ray: one line, no Ray connection
    wrong = _run([str(REPO / "tune" / "search.py"), "--smoke-test", "--data", str(synthetic_root),
                  "--address", shared_ray, "--model", "ownnet:wrong"], cwd=models)
    assert wrong.returncode == 2, wrong.stderr[-3000:]
    says = "--model: own model ownnet:wrong: a clip of shape (1, 3, 4, 32, 32) gave shape (1, 3)"
    assert says in wrong.stderr
    assert "Ray" not in wrong.stdout + wrong.stderr

    # The search's driver imports it through PYTHONPATH from another folder, so Ray's workers (whose
    # sys.path holds neither) can only have it from the driver's py_modules.
    found = _run([str(REPO / "tune" / "search.py"), "--smoke-test", "--data", str(synthetic_root),
                  "--address", shared_ray, "--model", "ownnet:build", "--register-model", "own-net"],
                 cwd=run_here, PYTHONPATH=str(models))
    assert found.returncode == 0, found.stdout[-3000:] + found.stderr[-3000:]
    best_config = next((run_here / "vidtune-results").glob("*/best_config.json"))
    assert json.loads(best_config.read_text())["train_config"]["model"] == "ownnet:build"

    # retrained from best_config.json, beside the module (the current folder is searched first)
    again = _run([str(REPO / "trainer" / "commands" / "train.py"), "--config", str(best_config),
                  "--address", shared_ray, "--storage", str(tmp_path / "train")], cwd=models)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "training ownnet:build on 1 worker(s)" in again.stdout and "best checkpoint" in again.stdout

    # the registered model, where `ownnet` cannot be imported: it carries its module
    store = f"sqlite:///{run_here / 'mlruns.db'}"
    videos = [str(v) for v in sorted((synthetic_root / "val").rglob("*.mp4"))[:2]]
    scored = _run(["-c", LOAD_AND_SCORE, store, "models:/own-net/1", *videos], cwd=elsewhere)
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert "IMPORTABLE" not in scored.stdout
    scores = json.loads(scored.stdout.split("SCORES ", 1)[1])
    assert len(scores) == 2 and all(0.0 <= p <= 1.0 for p in scores)
