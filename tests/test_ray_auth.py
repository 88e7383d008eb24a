"""Joining a Ray cluster with token authentication (Ray 2.60): a refusal for want of the token is
one line naming the variables to set (trainer/ray_setup/ray_auth.py), and a join with no token anywhere
gets a note first. The Jobs API path itself, token and all, is tests/test_jobs_api.py."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray
from ray.exceptions import AuthenticationError

from vidtune.flags import ConfigError
from vidtune.trainer.ray_setup import launch, ray_auth

VIDTUNE = str(Path(sys.executable).parent / "vidtune")


@pytest.fixture
def no_token(monkeypatch, tmp_path):
    """A home without ~/.ray/auth_token and none of Ray's token variables."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in (ray_auth.AUTH_MODE_ENV, ray_auth.TOKEN_ENV, ray_auth.TOKEN_PATH_ENV, "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def test_a_refused_join_is_one_line_naming_the_variables(monkeypatch, no_token, capsys):
    monkeypatch.setenv(ray_auth.AUTH_MODE_ENV, "token")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)

    def init(**kw):
        raise AuthenticationError("Token authentication is enabled but no authentication token was found")

    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(ConfigError) as caught:
        launch.init_ray(address="10.0.0.5:6379")
    message = str(caught.value)
    assert "\n" not in message and message.startswith("--address: the Ray cluster at 10.0.0.5:6379")
    assert "RAY_AUTH_TOKEN " in message and "RAY_AUTH_TOKEN_PATH" in message
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    assert "note:" not in capsys.readouterr().out        # the mode is set: no note before joining


def test_other_errors_of_the_join_pass_through(monkeypatch, no_token):
    monkeypatch.setenv(ray_auth.TOKEN_ENV, "x" * 32)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: (_ for _ in ()).throw(ConnectionError("no GCS")))
    with pytest.raises(ConnectionError, match="no GCS"):
        launch.init_ray(address="auto")


def _refusal_after_retries() -> ConnectionError:
    """What ray.init raises, after ~20 s of retries, when a cluster's GCS refuses this process's
    token or its lack of one (Ray 2.60: a RuntimeError holding the gRPC status, then this)."""
    try:
        try:
            raise RuntimeError("Failed to connect to GCS. Last connection error: Traceback ...\n"
                               "ray.exceptions.AuthenticationError: RPC error: InvalidAuthToken: "
                               "Authentication token is missing or incorrect.")
        except RuntimeError as cause:
            raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.5:6379") from cause
    except ConnectionError as error:
        return error


def test_a_join_refused_after_retries_is_one_line_saying_what_to_set(monkeypatch, no_token):
    """A token in ~/.ray (a local search wrote it) and RAY_AUTH_MODE unset: Ray sends no token to
    an address given explicitly, the cluster refuses, and the line says to set the mode."""
    (no_token / ".ray").mkdir()
    (no_token / ".ray" / "auth_token").write_text("t" * 32)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)

    def init(**kw):
        raise _refusal_after_retries()

    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(ConfigError) as caught:
        launch.init_ray(address="10.0.0.5:6379")
    message = str(caught.value)
    assert "\n" not in message and "Ray sent it no token" in message and "RAY_AUTH_MODE=token" in message
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    monkeypatch.setenv(ray_auth.AUTH_MODE_ENV, "token")      # sent, and refused: the token is the wrong one
    with pytest.raises(ConfigError, match="refused the token found here: set RAY_AUTH_TOKEN"):
        launch.init_ray(address="10.0.0.5:6379")


def test_only_a_refusal_is_recognised_in_rays_connection_errors():
    assert ray_auth.refused_for_token(_refusal_after_retries())
    assert not ray_auth.refused_for_token(ConnectionError("Failed to connect to Ray cluster at 10.0.0.5"))
    try:
        raise ConnectionError("Failed to connect") from RuntimeError("GCS is not reachable: timed out")
    except ConnectionError as error:
        assert not ray_auth.refused_for_token(error)


def test_no_token_anywhere_and_no_mode_gets_a_note_before_the_join(no_token, monkeypatch):
    note = ray_auth.no_token_note("auto")
    assert note and note.startswith("note: no Ray token here") and "RAY_AUTH_MODE=token" in note
    monkeypatch.setenv(ray_auth.AUTH_MODE_ENV, "disabled")        # said on purpose: no note
    assert ray_auth.no_token_note("auto") is None


@pytest.mark.parametrize("where", ["default file", "variable", "path variable"])
def test_a_token_is_found_where_ray_looks(no_token, monkeypatch, where):
    assert not ray_auth.token_found()
    if where == "default file":
        (no_token / ".ray").mkdir()
        (no_token / ".ray" / "auth_token").write_text("t" * 32)
    elif where == "variable":
        monkeypatch.setenv(ray_auth.TOKEN_ENV, "t" * 32)
    else:
        (no_token / "token").write_text("t" * 32)
        monkeypatch.setenv(ray_auth.TOKEN_PATH_ENV, str(no_token / "token"))
    assert ray_auth.token_found() and ray_auth.no_token_note("auto") is None


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_search_says_it_in_one_line_when_rays_own_check_refuses(tmp_path):
    """Ray's real check: RAY_AUTH_MODE=token with no token makes ray.init raise before it connects
    (no Ray is started, none is reached); the search ends with one line and exit 2."""
    from vidtune.datasets.synthetic import generate

    data = generate(tmp_path / "data", videos=8, seed=0)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", ray_auth.TOKEN_ENV, ray_auth.TOKEN_PATH_ENV)}
    env.update(HOME=str(tmp_path), RAY_AUTH_MODE="token")
    out = subprocess.run([VIDTUNE, "search", "--address", "127.0.0.1:9", "--data", str(data), "--smoke-test",
                          "--storage", str(tmp_path / "results"), "--mlflow-uri", f"sqlite:///{tmp_path}/m.db"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    (line,) = [x for x in out.stderr.splitlines() if x.strip()]
    assert line.startswith("vidtune search: error: --address: the Ray cluster at 127.0.0.1:9 uses token "
                           "authentication") and "set RAY_AUTH_TOKEN" in line
