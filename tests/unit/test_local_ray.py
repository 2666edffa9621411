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
    token = local_ray.RunToken(base=str(tmp_path))
    token.open()
    assert token.path is None and os.environ["RAY_AUTH_TOKEN_PATH"] == str(tmp_path / "mine")
    token.close()
    assert os.environ["RAY_AUTH_TOKEN_PATH"] == str(tmp_path / "mine")
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    token = local_ray.RunToken(base=str(tmp_path))
    token.open()
    assert token.path is None and "RAY_AUTH_TOKEN_PATH" not in os.environ
    token.close()


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


def test_rays_temp_dir_is_inside_the_runs_private_directory(monkeypatch, tmp_path):
    """Ray's session directories under the system temp dir were 0777 (issue 37 item 10): a local run gives Ray a temp
    dir inside its own 0700 directory, removed with it."""
    import ray

    from moerl import run
    from moerl.config import load_config

    seen = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    token = local_ray.RunToken(base=str(tmp_path))
    try:
        assert run._init_ray(load_config(None, []), token)
        assert seen["_temp_dir"] == token.ray_temp_dir and seen["_temp_dir"].startswith(token.directory + os.sep)
        assert stat.S_IMODE(os.stat(token.directory).st_mode) == 0o700
    finally:
        token.close()
    assert os.listdir(tmp_path) == []


def test_stale_private_directories_go_at_the_next_start_only_when_their_owner_is_gone(monkeypatch, tmp_path):
    """A SIGKILL of the driver left its token directory behind (issue 37 item 10)."""
    import json
    import subprocess

    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()

    def leave(name: str, owner: dict | None) -> str:
        path = tmp_path / f"{local_ray.PREFIX}{name}"
        (path / "ray").mkdir(parents=True)
        (path / "auth_token").write_text("x")
        if owner is not None:
            (path / local_ray.OWNER_FILE).write_text(json.dumps(owner))
        return path.name
    dead = leave("dead", {"pid": gone.pid, "proc_start": None})
    recycled = leave("recycled", {"pid": os.getpid(), "proc_start": "1"})  # this pid, another process's start
    live = leave("live", {"pid": os.getpid(), "proc_start": None})
    unknown = leave("unknown", None)
    (tmp_path / "unrelated").mkdir()
    token = local_ray.RunToken(base=str(tmp_path))
    token.open()
    try:
        left = sorted(os.listdir(tmp_path))
        assert dead not in left and recycled not in left
        assert {live, unknown, "unrelated", os.path.basename(token.directory)} == set(left)
        owner = json.loads(open(os.path.join(token.directory, local_ray.OWNER_FILE)).read())
        assert owner["pid"] == os.getpid()
    finally:
        token.close()


def test_a_local_rays_processes_inherit_the_run_env_and_this_process_gets_its_own_back(monkeypatch):
    """The raylet (and so every worker) inherits what `inherited_env` sets while Ray starts; after, this process's
    environment is as it was (a key that was unset is unset again)."""
    import os
    import subprocess
    import sys

    from moerl.local_ray import inherited_env

    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    with inherited_env({"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}):
        child = subprocess.run([sys.executable, "-c", "import os; print(os.environ['OMP_NUM_THREADS'], "
                                "os.environ['GLOO_SOCKET_IFNAME'])"], capture_output=True, text=True, check=True)
    assert child.stdout.split() == ["1", "lo"]
    assert os.environ["OMP_NUM_THREADS"] == "7" and "GLOO_SOCKET_IFNAME" not in os.environ
