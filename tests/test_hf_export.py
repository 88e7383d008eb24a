"""A trained hf: model leaves vidtune like a torchvision one: logged in MLflow, its python_function
model scoring videos as `vidtune predict` does, and as `save_pretrained` output
(`vidtune export-hf`) that transformers loads without vidtune. No network: a tiny VideoMAE folder."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient

from tests.test_hf_models import save_tiny
from vidtune.trainer.models.registry import build_model, get_spec
from vidtune.trainer.serving import mlflow_model, scoring
from vidtune.trainer.serving.hf_export import main as export_hf
from vidtune.trainer.training.checkpointing import save_checkpoint
from vidtune.trainer.training.config import TrainConfig

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train_checkpoint(tmp_path_factory.mktemp("hf-export"))


def train_checkpoint(tmp: Path) -> tuple[str, Path, torch.nn.Module]:
    """(model name, checkpoint folder, the network): a tiny VideoMAE (from `tmp/source`) with a
    2-way head whose weights differ from the folder's (as training leaves them), saved as a
    trial saves them into `tmp/ckpt`."""
    name = f"hf:{save_tiny('videomae', tmp / 'source')}"
    torch.manual_seed(0)
    network = build_model(name)
    with torch.no_grad():
        for p in network.parameters():
            p.add_(0.05 * torch.randn_like(p))
    optimizer = torch.optim.AdamW(network.parameters())
    save_checkpoint(tmp / "ckpt", model=network, optimizer=optimizer,
                    scaler=torch.amp.GradScaler("cpu", enabled=False),
                    scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), epoch=1,
                    config=TrainConfig(model=name).to_dict(), spec=get_spec(name),
                    class_names={1: "Fight", 0: "NonFight"})
    return name, tmp / "ckpt", network.eval()


def test_export_hf_writes_what_transformers_loads_with_the_trained_weights(trained, tmp_path, capsys):
    name, ckpt, network = trained
    assert export_hf(["--checkpoint", str(ckpt), str(tmp_path / "out")]) == 0
    assert "from_pretrained" in capsys.readouterr().out
    loaded = transformers.AutoModelForVideoClassification.from_pretrained(tmp_path / "out").eval()
    assert loaded.config.id2label == {0: "non-violent", 1: "violent"}
    x = torch.randn(2, 3, 8, 32, 32)                                   # B x C x T x H x W
    with torch.no_grad():
        torch.testing.assert_close(loaded(pixel_values=x.transpose(1, 2)).logits, network(x))
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path / "out")
    assert list(processor.image_mean) == [0.4, 0.5, 0.6]              # the source's, copied


def test_export_hf_refuses_a_torchvision_checkpoint_and_a_used_folder_in_one_line(trained, tmp_path, capsys):
    network = build_model("tiny")
    optimizer = torch.optim.AdamW(network.parameters())
    save_checkpoint(tmp_path / "tiny", model=network, optimizer=optimizer,
                    scaler=torch.amp.GradScaler("cpu", enabled=False),
                    scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), epoch=1,
                    config=TrainConfig().to_dict(), spec=get_spec("tiny"),
                    class_names={1: "Fight", 0: "NonFight"})
    assert export_hf(["--checkpoint", str(tmp_path / "tiny"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--checkpoint" in err and "'tiny', not a Hugging Face one" in err
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("x")
    assert export_hf(["--checkpoint", str(trained[1]), str(tmp_path / "used")]) == 2
    assert "not an empty folder" in capsys.readouterr().err


def _log_in_a_new_store(tmp_path: Path, ckpt: Path, example_video: str, registered_name: str):
    """(store URI, `mlflow_model.Logged`): `ckpt` logged in a run of a new SQLite store under
    `tmp_path`, its artifacts in `tmp_path / "artifacts"`, registered as `registered_name`."""
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("search", artifact_location=(tmp_path / "artifacts").as_uri())
    run = client.create_run(experiment, run_name="t01")
    return uri, mlflow_model.log_model(uri, run.info.run_id, ckpt, example_video=example_video,
                                       registered_name=registered_name)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_logged_hf_model_scores_videos_as_predict_does(trained, synthetic_root, tmp_path):
    """The generic path: `mlflow_model.log_model` of an hf: checkpoint, loaded back as a
    python_function model, gives each video the probability `vidtune predict`'s code gives it."""
    _, ckpt, _ = trained
    videos = sorted(str(p) for p in (synthetic_root / "val").rglob("*.mp4"))[:2]
    uri, logged = _log_in_a_new_store(tmp_path, ckpt, videos[0], "hf-tiny")
    assert logged.uri == "models:/hf-tiny/1"
    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        scored = mlflow.pyfunc.load_model(logged.uri).predict(videos)
    finally:
        mlflow.set_tracking_uri(before)
    predictor = scoring.Predictor.from_checkpoint(ckpt, torch.device("cpu"))
    assert (predictor.num_frames, predictor.height, predictor.width) == (8, 32, 32)
    expected = [mlflow_model.video_probability(predictor, Path(v), 1.0, 8) for v in videos]
    assert scored == pytest.approx(expected, abs=1e-6)
    assert len(set(round(s, 6) for s in scored)) == 2 and all(0 < s < 1 for s in scored)


# Run in a fresh interpreter, with the hub offline and an empty HF_HOME: the logged model
# `argv[1]` (store $MLFLOW_TRACKING_URI) loaded as a python_function model scoring videos
# `argv[2:]`, and its checkpoint downloaded and scored as `vidtune predict --checkpoint
# models:/...` does. Prints {"pyfunc": [...], "predict": [...]}.
SCORE_OFFLINE = """
import json, os, sys, tempfile
from pathlib import Path
import mlflow, torch
from vidtune.trainer.serving import mlflow_model, scoring
uri, videos = sys.argv[1], sys.argv[2:]
pyfunc = mlflow.pyfunc.load_model(uri).predict(videos)
with tempfile.TemporaryDirectory() as tmp:
    ckpt = mlflow_model.download_checkpoint(uri, os.environ["MLFLOW_TRACKING_URI"], tmp)
    p = scoring.Predictor.from_checkpoint(ckpt, torch.device("cpu"))
    predict = [mlflow_model.video_probability(p, Path(v), 1.0, 8) for v in videos]
print(json.dumps({"pyfunc": pyfunc, "predict": predict}))
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_logged_hf_model_scores_without_its_source_folder_or_the_hub(synthetic_root, tmp_path):
    """The model carries its config and image processor (`scoring.HF_CONFIG_FOLDER`) beside its
    checkpoint: with the folder it was trained from gone, HF_HUB_OFFLINE=1 and an empty HF_HOME,
    another process loads it and scores as vidtune's Predictor did with the folder there."""
    name, ckpt, _ = train_checkpoint(tmp_path)
    videos = sorted(str(p) for p in (synthetic_root / "val").rglob("*.mp4"))[:3]
    uri, logged = _log_in_a_new_store(tmp_path, ckpt, videos[0], "hf-alone")
    predictor = scoring.Predictor.from_checkpoint(ckpt, torch.device("cpu"))
    expected = [mlflow_model.video_probability(predictor, Path(v), 1.0, 8) for v in videos]
    saved = next((tmp_path / "artifacts").rglob(scoring.HF_CONFIG_FOLDER))   # no weights beside the ckpt
    assert sorted(f.name for f in saved.iterdir()) == ["config.json", "preprocessor_config.json",
                                                         "vidtune_weights_elsewhere.txt"]

    (tmp_path / "source").rename(tmp_path / "gone")
    hf_home = tmp_path / "empty-hf-home"
    hf_home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HF_TOKEN")}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(hf_home), MLFLOW_TRACKING_URI=uri)
    out = subprocess.run([sys.executable, "-c", SCORE_OFFLINE, logged.uri, *videos], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stderr[-3000:]
    scored = json.loads(out.stdout.strip().splitlines()[-1])
    assert scored["pyfunc"] == pytest.approx(expected, abs=1e-6)
    assert scored["predict"] == pytest.approx(expected, abs=1e-6)
    assert len(set(round(s, 6) for s in expected)) == 3 and not any(hf_home.iterdir())
