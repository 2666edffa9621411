"""A local run's Ray (moerl/local_ray.py): 127.0.0.1 as its node address, and a token of the run's own in a 0600
file (Ray writes ~/.ray/auth_token world-readable and shares it between every run of the user)."""

from __future__ import annotations

import os
import stat
import sys

from moerl import local_ray


def test_the_run_token_is_private_and_removed_at_the_end(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    token = local_ray.RunToken()
    token.open()
    path = os.environ["RAY_AUTH_TOKEN_PATH"]
    try:
        assert path == token.path and not path.startswith(os.path.expanduser("~/.ray"))
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        text = open(path).read()
        assert len(text) == 64 and int(text, 16) >= 0
        token.open()  # again: the same file
        assert os.environ["RAY_AUTH_TOKEN_PATH"] == path
    finally:
        token.close()
    assert "RAY_AUTH_TOKEN_PATH" not in os.environ and not os.path.exists(os.path.dirname(path))
    token.close()


def test_a_token_the_environment_names_or_no_token_mode_is_left_alone(monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "mine"))
    token = local_ray.RunToken()
    token.open()
    assert token.path is None and os.environ["RAY_AUTH_TOKEN_PATH"] == str(tmp_path / "mine")
    token.close()
    assert os.environ["RAY_AUTH_TOKEN_PATH"] == str(tmp_path / "mine")
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    token.open()
    assert token.path is None and "RAY_AUTH_TOKEN_PATH" not in os.environ


def test_loopback_env_before_ray_is_imported_only(monkeypatch):
    for name in ("RAY_AUTH_MODE", local_ray.LOOPBACK):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setitem(sys.modules, "ray", sys.modules.get("ray", object()))
    local_ray.loopback_env(local=True)  # Ray imported: the caller's settings stand
    assert local_ray.LOOPBACK not in os.environ
    monkeypatch.delitem(sys.modules, "ray")
    local_ray.loopback_env(local=False)  # joining a cluster: nothing here
    assert local_ray.LOOPBACK not in os.environ
    local_ray.loopback_env(local=True)
    assert os.environ[local_ray.LOOPBACK] == "0" and os.environ["RAY_AUTH_MODE"] == "token"
