"""Where checkpoints live: a local directory or `s3://bucket/prefix`, through fsspec (s3fs for S3).

Layout under the root, one directory per step:

    <root>/step-00000012/trainer/...       torch.distributed.checkpoint files (every trainer rank writes)
    <root>/step-00000012/controller.pt     the controller's state (see controller_state.py)
    <root>/step-00000012/arch.json         the model architecture (HF config.json dict), for export
    <root>/step-00000012/COMMIT            JSON manifest, written LAST: the step exists only once it does
    <root>/latest                          text "step-00000012", written after the COMMIT

A crash anywhere before the COMMIT leaves a directory that every reader ignores, so the previous committed
step stays the one resumed from. The S3 endpoint comes from the standard AWS variables (`AWS_ENDPOINT_URL`,
honoured by botocore >= 1.31, which s3fs uses), so any S3-compatible store works. Messages never include
the filesystem object or its options: they may hold credentials.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from moerl.model.config import CheckpointError

COMMIT = "COMMIT"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_RESERVED = ("step", "files", "created")


def step_name(step: int) -> str:
    return f"step-{step:08d}"


class CheckpointStore:
    def __init__(self, root: str) -> None:
        self._fs, path = url_to_fs(root)
        self.root = root.rstrip("/")
        self._path = path.rstrip("/")  # root without the protocol, as fs methods take it
        self._local = "file" in _protocols(self._fs)

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        return self._fs

    def step_path(self, step: int) -> str:
        """The step directory as a URL (s3://... or a local path): what torch.distributed.checkpoint takes."""
        return f"{self.root}/{step_name(step)}"

    def _p(self, *parts: str) -> str:
        return "/".join((self._path, *parts))

    # ------------------------------------------------------------------ files of one step
    def begin(self, step: int) -> None:
        """Clear what an earlier attempt left under this step (COMMIT first), before writing it again.

        Needed after resuming from an older step: the step directory may hold a COMMIT of the abandoned
        timeline, and new files written under it must never look committed before the new COMMIT."""
        self._remove_step(step)

    def write_bytes(self, step: int, name: str, data: bytes) -> None:
        self._put(self._p(step_name(step), name), data)

    def read_bytes(self, step: int, name: str) -> bytes:
        path = self._p(step_name(step), name)
        try:
            return self._fs.cat_file(path)
        except FileNotFoundError:
            raise CheckpointError(f"{self.root}/{step_name(step)}: missing file {name!r}") from None

    def _put(self, path: str, data: bytes) -> None:
        if self._local:  # a crash mid-write must not leave a truncated COMMIT/latest: write, then rename
            self._fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            self._fs.pipe_file(path + ".tmp", data)
            self._fs.mv(path + ".tmp", path)
        else:  # an S3 PUT is atomic: the object appears whole or not at all
            self._fs.pipe_file(path, data)

    def _files(self, step: int) -> dict[str, int]:
        """Relative path -> size of every file under the step directory (fresh listing, no cache)."""
        base = self._p(step_name(step))
        self._fs.invalidate_cache()  # another process (another rank, DCP's own fs instance) wrote here
        found = self._fs.find(base, detail=True)
        out = {}
        for path, info in found.items():
            rel = path[len(base):].strip("/") if path.startswith(base) else ""
            if info.get("type") == "file" and rel:
                out[rel] = int(info["size"])
        return out

    # ------------------------------------------------------------------ commit and discovery
    def commit(self, step: int, manifest_extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """List the files present (with sizes) into the manifest, write COMMIT, then `latest`."""
        extra = dict(manifest_extra or {})
        clash = [k for k in extra if k in _RESERVED]
        if clash:
            raise ValueError(f"manifest_extra may not set reserved key(s) {clash}")
        files = {k: v for k, v in self._files(step).items() if k != COMMIT and not k.endswith(".tmp")}
        if not files:
            raise CheckpointError(f"{self.step_path(step)}: nothing to commit (no files written)")
        manifest = {"step": step, "files": files, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    **extra}
        self._put(self._p(step_name(step), COMMIT), json.dumps(manifest, indent=1, sort_keys=True).encode())
        self._put(self._p(LATEST), step_name(step).encode())
        return manifest

    def read_manifest(self, step: int) -> dict[str, Any]:
        try:
            raw = self._fs.cat_file(self._p(step_name(step), COMMIT))
        except FileNotFoundError:
            raise CheckpointError(f"{self.step_path(step)}: not committed (no {COMMIT} marker)") from None
        try:
            manifest = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.step_path(step)}/{COMMIT}: not valid JSON ({e})") from None
        if not isinstance(manifest, dict) or manifest.get("step") != step or not isinstance(manifest.get("files"), dict):
            raise CheckpointError(f"{self.step_path(step)}/{COMMIT}: not a manifest of step {step}")
        return manifest

    def _step_dirs(self) -> list[int]:
        self._fs.invalidate_cache()
        try:
            entries = self._fs.ls(self._path, detail=False)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for e in entries if (m := _STEP_DIR.match(e.rstrip("/").rsplit("/", 1)[-1])))

    def _is_committed(self, step: int) -> bool:
        try:
            self.read_manifest(step)
            return True
        except CheckpointError:
            return False

    def committed_steps(self) -> list[int]:
        return [s for s in self._step_dirs() if self._is_committed(s)]

    def _latest_named(self) -> int | None:
        """The step `latest` names, if it reads as a step name at all."""
        try:
            text = self._fs.cat_file(self._p(LATEST)).decode("utf-8", "replace").strip()
        except FileNotFoundError:
            return None
        m = _STEP_DIR.match(text)
        return int(m.group(1)) if m else None

    def latest_step(self) -> int | None:
        """The step `latest` names when it is committed; else (missing, garbled, names an uncommitted
        step) the highest committed step; None when nothing is committed."""
        named = self._latest_named()
        if named is not None and self._is_committed(named):
            return named
        committed = self.committed_steps()
        return committed[-1] if committed else None

    def verify(self, step: int) -> dict[str, Any]:
        """Raise CheckpointError naming every file missing or of another size than the manifest says."""
        manifest = self.read_manifest(step)
        present = self._files(step)
        problems = []
        for name, size in sorted(manifest["files"].items()):
            if name not in present:
                problems.append(f"missing {name}")
            elif present[name] != size:
                problems.append(f"{name} has {present[name]} bytes, the manifest says {size}")
        if problems:
            raise CheckpointError(f"{self.step_path(step)}: incomplete checkpoint: " + "; ".join(problems))
        return manifest

    # ------------------------------------------------------------------ retention
    def prune(self, keep: int) -> list[int]:
        """Delete all but the newest `keep` committed steps (never the one `latest` names) and the
        uncommitted directories older than the newest committed step (abandoned uploads). Newer
        uncommitted directories may be uploads in progress: they stay. Returns the steps deleted."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        dirs = self._step_dirs()
        committed = [s for s in dirs if self._is_committed(s)]
        if not committed:
            return []
        protected = set(committed[-keep:]) | {self._latest_named()}
        doomed = [s for s in committed if s not in protected]
        doomed += [s for s in dirs if s not in committed and s < committed[-1] and s not in protected]
        for s in sorted(doomed):
            self._remove_step(s)
        return sorted(doomed)

    def _remove_step(self, step: int) -> None:
        base = self._p(step_name(step))
        try:  # the COMMIT goes first, so a crash while deleting never leaves a committed-looking partial
            self._fs.rm_file(f"{base}/{COMMIT}")
        except FileNotFoundError:
            pass
        self._fs.invalidate_cache()
        if self._fs.exists(base):
            self._fs.rm(base, recursive=True)
        self._fs.invalidate_cache()


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)
