"""Server-form environments (OpenEnv's usual form) behind the SkyRL-gym text interface of moerl/tasks/env.py.

An OpenEnv environment is a server: `reset` gives the first observation, `step(action)` the next observation with
its reward and done flag; actions and observations are per-environment JSON objects. The adapter maps the model's
turn to an action (`{action_key: text}`) and an observation to one chat message (`observation_key`'s value, in the
role `observation_role`), so every OpenEnv environment whose action takes one text field works unchanged.

Two transports, one adapter:
- `HTTPSession` (standard library, no extra package): OpenEnv's HTTP shapes, `POST /reset` with
  `{"episode_id", "seed"}` and `POST /step` with `{"action": {...}, "episode_id"}`, each answering
  `{"observation": {...}, "reward": r, "done": b}`. For servers that keep an episode per `episode_id` (the test's
  server, or any OpenEnv server configured so); OpenEnv's own HTTP routes build a fresh environment per request.
- `OpenEnvSession`: OpenEnv's own client (`openenv.core.generic_client.GenericEnvClient`, a WebSocket session per
  episode), imported only here (`pip install openenv-core`).

Replay (docs/environments.md) holds as for any environment: a continued episode resets a new session and replays
the model turns, so the server must answer them deterministically (reset with the same seed).
The URL is configured (trusted); answers are untrusted JSON, checked by `check_step`. Nothing is unpickled.
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from typing import Any, Protocol

from moerl.tasks.base import TaskError
from moerl.tasks.env import EnvError, Message

_MAX_ANSWER = 1 << 20  # bytes of one server answer: an observation, not a file


class Session(Protocol):
    def reset(self, seed: int | None) -> dict[str, Any]: ...

    def step(self, action: dict[str, Any]) -> dict[str, Any]: ...

    def close(self) -> None: ...


class HTTPSession:
    """OpenEnv's HTTP request and answer shapes, one episode keyed by a fresh `episode_id`."""

    def __init__(self, base_url: str, timeout_s: float = 30.0) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise TaskError(f"environment url {base_url!r} must start with http:// or https://")
        self.base_url, self.timeout_s, self.episode_id = base_url.rstrip("/"), timeout_s, uuid.uuid4().hex

    def _post(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(self.base_url + route, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:  # noqa: S310 - configured URL
                raw = resp.read(_MAX_ANSWER + 1)
        except OSError as exc:
            raise EnvError(f"environment server {self.base_url}{route}: {exc}") from None
        if len(raw) > _MAX_ANSWER:
            raise EnvError(f"environment server {self.base_url}{route} answered more than {_MAX_ANSWER} bytes")
        try:
            out = json.loads(raw)
        except ValueError:
            raise EnvError(f"environment server {self.base_url}{route} answered no JSON: {raw[:80]!r}") from None
        if not isinstance(out, dict):
            raise EnvError(f"environment server {self.base_url}{route} answered {type(out).__name__}, not an object")
        return out

    def reset(self, seed: int | None) -> dict[str, Any]:
        return self._post("/reset", {"episode_id": self.episode_id, **({} if seed is None else {"seed": seed})})

    def step(self, action: dict[str, Any]) -> dict[str, Any]:
        return self._post("/step", {"action": action, "episode_id": self.episode_id})

    def close(self) -> None:
        pass


class OpenEnvSession:
    """OpenEnv's own synchronous client over its WebSocket session (needs `openenv-core`)."""

    def __init__(self, base_url: str) -> None:
        try:
            from openenv.core.generic_client import GenericEnvClient  # noqa: PLC0415 - optional dependency
        except ImportError as exc:
            raise TaskError(f"OpenEnvSession needs openenv-core: pip install openenv-core ({exc})") from exc
        self.client = GenericEnvClient(base_url=base_url).sync()

    @staticmethod
    def _plain(result: Any) -> dict[str, Any]:
        return {"observation": result.observation, "reward": result.reward, "done": result.done}

    def reset(self, seed: int | None) -> dict[str, Any]:
        return self._plain(self.client.reset(**({} if seed is None else {"seed": seed})))

    def step(self, action: dict[str, Any]) -> dict[str, Any]:
        return self._plain(self.client.step(action))

    def close(self) -> None:
        self.client.close()


class OpenEnvHTTPEnv:
    """A server-form environment as a SkyRL-gym text environment. env_config keys: `url`, `transport` ("http" or
    "openenv"), `action_key` ("message"), `observation_key` ("text"), `observation_role` ("tool"), `timeout_s`;
    extras: `seed` (the reset seed: replay needs the same one)."""

    def __init__(self, env_config: dict[str, Any] | None = None, extras: dict[str, Any] | None = None) -> None:
        cfg, self.extras = dict(env_config or {}), dict(extras or {})
        url = cfg.get("url")
        if not isinstance(url, str):
            raise TaskError("OpenEnvHTTPEnv needs env_config.url, e.g. 'http://127.0.0.1:8000'")
        transport = cfg.get("transport", "http")
        if transport not in ("http", "openenv"):
            raise TaskError(f"OpenEnvHTTPEnv transport must be 'http' or 'openenv', got {transport!r}")
        self.session: Session = (HTTPSession(url, float(cfg.get("timeout_s", 30.0))) if transport == "http"
                                 else OpenEnvSession(url))
        self.action_key = str(cfg.get("action_key", "message"))
        self.observation_key = str(cfg.get("observation_key", "text"))
        self.role = str(cfg.get("observation_role", "tool"))

    def _message(self, observation: Any) -> list[Message]:
        if not isinstance(observation, dict):
            raise EnvError(f"environment server observation is {type(observation).__name__}, not an object")
        value = observation.get(self.observation_key)
        if value is None:
            return []
        return [{"role": self.role, "content": value if isinstance(value, str) else json.dumps(value)}]

    def init(self, prompt: list[Message]) -> tuple[list[Message], dict[str, Any]]:
        out = self.session.reset(self.extras.get("seed"))
        return list(prompt) + self._message(out.get("observation") or {}), {}

    def step(self, action: str) -> dict[str, Any]:
        out = self.session.step({self.action_key: action})
        done = out.get("done")
        return {"observations": [] if done else self._message(out.get("observation")), "reward": out.get("reward"),
                "done": done, "metadata": {}}

    def close(self) -> None:
        self.session.close()


__all__ = ["HTTPSession", "OpenEnvHTTPEnv", "OpenEnvSession"]
