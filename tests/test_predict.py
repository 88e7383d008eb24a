"""vidtune.trainer.serving.predict: per-video and per-window violence probabilities from a checkpoint; a
missing or damaged video is named, the others are still scored, the exit code says so."""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from vidtune.trainer.models.registry import build_model, get_spec
from vidtune.trainer.serving import predict, scoring
from vidtune.trainer.serving.scoring_rule import SCORING_RULE
from vidtune.trainer.training.checkpointing import save_checkpoint
from vidtune.trainer.training.config import TrainConfig


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory) -> Path:
    """A checkpoint of an (untrained) tiny model, as trainer.commands.train writes it."""
    out = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    model = build_model("tiny")
    optimizer = torch.optim.AdamW(model.parameters())
    save_checkpoint(out, model=model, optimizer=optimizer,
                    scaler=torch.amp.GradScaler("cpu", enabled=False),
                    scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), epoch=1,
                    config=TrainConfig().to_dict(), spec=get_spec("tiny"),
                    class_names={1: "Fight", 0: "NonFight"})
    return out


def _videos(root: Path, n: int) -> list[Path]:
    return sorted((root / "val").rglob("*.mp4"))[:n]


def test_window_starts_cover_the_whole_video():
    assert scoring.window_starts(45, 15, 15) == [0, 15, 30]
    assert scoring.window_starts(50, 15, 15) == [0, 15, 30, 35]  # the tail gets its own window
    assert scoring.window_starts(10, 15, 15) == [0]


def test_clip_windows_short_and_long_videos():
    long = scoring.clip_windows(45, num_frames=8, frame_stride=2, fps=15, window_stride_s=1.0)
    assert long.shape == (3, 8) and long[1, 0] == 15 and long.max() <= 44
    short = scoring.clip_windows(12, num_frames=8, frame_stride=2, fps=15, window_stride_s=1.0)
    assert short.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7], [4, 5, 6, 7, 8, 9, 10, 11]]  # stride shrunk to fit
    tiny = scoring.clip_windows(4, num_frames=8, frame_stride=2, fps=15, window_stride_s=1.0)
    assert tiny.shape == (1, 8) and tiny.max() == 3      # fewer frames than T: repeated


def test_predict_prints_probabilities_and_names_a_missing_video(synthetic_root, checkpoint_dir, capsys):
    videos = _videos(synthetic_root, 2)
    missing = synthetic_root / "val" / "no such clip.mp4"
    code = predict.main(["--checkpoint", str(checkpoint_dir), "--aggregation", "max", str(videos[0]),
                         str(missing), str(videos[1])])
    out, err = capsys.readouterr()
    assert code == 1
    assert "no such clip.mp4: no such file" in err and "1 of 3" in err
    for video in videos:
        line = next(ln for ln in out.splitlines() if ln.startswith(str(video)))
        assert re.fullmatch(rf"{re.escape(str(video))}: P\(Fight\) [0-9.]+ \(max over \d+ windows\)", line)
    # 3 s clips, 1 s windows: every video is scored window by window with start times
    windows = re.findall(r"^\s+([0-9.]+) s\s+([0-9.]+)$", out, flags=re.M)
    assert len(windows) >= 4
    assert all(0.0 <= float(p) <= 1.0 for _, p in windows)


def test_predict_names_a_damaged_video_and_scores_the_rest(synthetic_root, checkpoint_dir, tmp_path, capsys):
    damaged = tmp_path / "damaged.mp4"
    damaged.write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 2000)
    good = _videos(synthetic_root, 1)[0]
    code = predict.main(["--checkpoint", str(checkpoint_dir), "--aggregation", "mean",
                         "--window-stride", "10", str(damaged), str(good)])
    out, err = capsys.readouterr()
    assert code == 1 and f"{damaged}: does not decode as a video" in err
    # 3 s video, 1 s clip, windows 10 s apart: the first window and one flush with the end
    assert re.search(rf"^{re.escape(str(good))}: P\(Fight\) [0-9.]+ \(mean over 2 windows\)$", out,
                     flags=re.M), out


def test_by_default_a_video_is_scored_on_the_clip_validation_scores(synthetic_root, checkpoint_dir, capsys):
    """The default rule is validation's: the centred clip `VideoClipDataset(train=False)` reads,
    through the same transform and model; `max` and `mean` are the windows' max and mean."""
    from vidtune.datasets.config import DataConfig
    from vidtune.datasets.index import build_index
    from vidtune.datasets.video import VideoClipDataset

    p = scoring.Predictor.from_checkpoint(checkpoint_dir, torch.device("cpu"), "fp32")
    index = build_index(DataConfig(root=str(synthetic_root)))
    infos = index.val[:3]
    val_set = VideoClipDataset(infos, num_frames=p.num_frames, frame_stride=p.frame_stride, height=p.height,
                               width=p.width, train=False)
    clips = torch.stack([val_set[i][0] for i in range(len(infos))])
    expected = p.probabilities(clips)
    scored = [scoring.video_score(p, Path(v.path)) for v in infos]
    np.testing.assert_allclose(scored, expected, atol=1e-6)
    assert predict.main(["--checkpoint", str(checkpoint_dir), *(str(v.path) for v in infos)]) == 0
    out = capsys.readouterr().out
    assert [ln.split(": ", 1)[1] for ln in out.splitlines()] == \
        [f"P(Fight) {q:.3f} (centre clip)" for q in expected]
    windows = [q for _, q in scoring.score_video(p, Path(infos[0].path), 0.5)]
    assert len(windows) > 1
    assert scoring.video_score(p, Path(infos[0].path), "max", 0.5) == max(windows)
    assert scoring.video_score(p, Path(infos[0].path), "mean", 0.5) == pytest.approx(np.mean(windows))


def test_predict_help_states_the_scoring_rule(capsys):
    with pytest.raises(SystemExit):
        predict.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert " ".join(SCORING_RULE.split()) in out
    assert "--aggregation {centre,max,mean}" in out


@pytest.mark.parametrize("make, said", [
    (lambda d: d / "gone.mp4", "no such file"),
    (lambda d: d, "a folder, not a video file"),
    (lambda d: os.mkfifo(d / "pipe.mp4") or d / "pipe.mp4", "not a regular file"),
    (lambda d: (d / "notes.mp4").write_text("not a video") and d / "notes.mp4", "does not decode as a video"),
    (lambda d: "", "'': an empty path"),
    (lambda d: " ", "' ': an empty path"),
])
def test_a_path_that_cannot_be_scored_is_named_with_why(tmp_path, make, said):
    path = make(tmp_path)
    with pytest.raises(scoring.VideoReadError) as e:
        scoring.open_video(path)
    assert said in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)


def test_predict_bad_checkpoint_exits_2(tmp_path, synthetic_root, capsys):
    code = predict.main(["--checkpoint", str(tmp_path / "nowhere"), str(_videos(synthetic_root, 1)[0])])
    assert code == 2
    assert "--checkpoint" in capsys.readouterr().err


def test_probabilities_match_the_model(synthetic_root, checkpoint_dir):
    """The printed number is softmax(model(clip))[violent] of the decoded, normalised clip."""
    p = scoring.Predictor.from_checkpoint(checkpoint_dir, torch.device("cpu"), "fp32")
    clips = torch.randint(0, 256, (2, 8, 64, 64, 3), dtype=torch.uint8)
    expected = torch.softmax(p.model(p.transform(clips)), 1)[:, 1].detach().double().numpy()
    np.testing.assert_allclose(p.probabilities(clips), expected, rtol=1e-5)


@pytest.mark.parametrize("flag, value", [("--window-stride", "0"), ("--batch-size", "0")])
def test_predict_bad_flag_exits_2_naming_it(tmp_path, capsys, flag, value):
    assert predict.main(["--checkpoint", str(tmp_path / "nowhere"), flag, value, "v.mp4"]) == 2
    assert f"{flag}: got" in capsys.readouterr().err


# -- a registered model as the checkpoint (models:/NAME/VERSION): each wrong part named ----------
# (Scoring with a registered model: tests/test_model_registry.py, on a real search's store.)

@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> str:
    """A SQLite store whose registry holds the model `vidtune` without versions and `other`, whose
    version 1 is not a vidtune model."""
    from mlflow.tracking import MlflowClient

    folder = tmp_path_factory.mktemp("registry")
    uri = f"sqlite:///{folder / 'mlruns.db'}"
    client = MlflowClient(uri)
    client.create_registered_model("vidtune")
    (folder / "other").mkdir()
    (folder / "other" / "MLmodel").write_text("flavors: {}\n")
    client.create_registered_model("other")
    client.create_model_version("other", source=(folder / "other").as_uri())
    return uri


@pytest.mark.parametrize("checkpoint, said", [
    ("models:/nope/1", "no registered model 'nope' in {uri} (it has other, vidtune)"),
    ("models:/other/1", "the registered model models:/other/1 holds no checkpoint.pt: it was not logged"),
    ("models:/vidtune/3", "model 'vidtune' has no version 3 in {uri} (its versions: none)"),
    ("models:/vidtune@best", "model 'vidtune' has no alias 'best'"),
    ("models:/vidtune", "models:/vidtune: write it as models:/NAME/VERSION (a number) or models:/NAME@ALIAS"),
])
def test_a_registered_model_that_is_not_there_is_named(registry, capsys, checkpoint, said):
    code = predict.main(["--checkpoint", checkpoint, "--mlflow-uri", registry, "v.mp4"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: --checkpoint: ") and said.format(uri=registry) in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_a_registry_store_that_does_not_exist_is_named_not_created(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    code = predict.main(["--checkpoint", "models:/vidtune/1", "v.mp4"])     # the default store, absent
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: --mlflow-uri (default): sqlite:///mlruns.db: no such store"), err
    assert not (tmp_path / "mlruns.db").exists()
    missing = tmp_path / "elsewhere.db"
    code = predict.main(["--checkpoint", "models:/x/1", "--mlflow-uri", f"sqlite:///{missing}", "v.mp4"])
    assert code == 2
    assert f"error: --mlflow-uri: sqlite:///{missing}: no such store" in capsys.readouterr().err
    assert not missing.exists()
