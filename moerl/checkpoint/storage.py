"""Where checkpoints live: a local directory or `s3://bucket/prefix`, through fsspec (s3fs for S3).

Layout under the root, one directory per step:

    <root>/step-00000012/trainer/...       torch.distributed.checkpoint files (every trainer rank writes)
    <root>/step-00000012/controller.pt     the controller's state (see controller_state.py)
    <root>/step-00000012/arch.json         the model architecture (HF config.json dict), for export
    <root>/step-00000012/COMMIT            JSON manifest, written LAST: the step exists only once it does;
                                           every file's size and checksum (checksum.py)
    <root>/latest                          text "step-00000012", written after the COMMIT

A crash anywhere before the COMMIT leaves a directory that every reader ignores, so the previous committed
step stays the one resumed from. The S3 endpoint comes from the standard AWS variables (`AWS_ENDPOINT_URL`,
honoured by botocore >= 1.31, which s3fs uses), so any S3-compatible store works. Messages never include
the filesystem object or its options: they may hold credentials.

Checksums are taken from the bytes as they are written (`write_bytes` here, DCP's writer threads in
trainer_state.py, passed to `commit`) and checked by `verify`, which resume and export call. A manifest
written before checksums existed has none: its steps are checked by size only.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import fsspec
from fsspec.core import url_to_fs

from moerl.checkpoint.checksum import PREFIX, checksum, fmt
from moerl.model.config import CheckpointError

log = logging.getLogger(__name__)

COMMIT = "COMMIT"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
CHECKSUMS = "checksums"
_RESERVED = ("step", "files", "created", CHECKSUMS)
_READ_BLOCK = 16 << 20  # verify streams each file in blocks of this size: never a whole file in memory
_VERIFY_THREADS = 8  # files are hashed in parallel (zlib releases the GIL; S3 reads overlap)


def step_name(step: int) -> str:
    return f"step-{step:08d}"


# Every S3 call is bounded: a black-hole endpoint stalled one call for 420 s with botocore's defaults.
_S3_OPTIONS = {"config_kwargs": {"connect_timeout": 10, "read_timeout": 120, "retries": {"max_attempts": 3}}}


class CheckpointStore:
    def __init__(self, root: str) -> None:
        self._fs, path = url_to_fs(root, **(_S3_OPTIONS if root.startswith(("s3://", "s3a://")) else {}))
        self.root = root.rstrip("/")
        self._path = path.rstrip("/")  # root without the protocol, as fs methods take it
        self._local = "file" in _protocols(self._fs)
        self._written: dict[int, dict[str, str]] = {}  # step -> name -> checksum of what write_bytes wrote

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        return self._fs

    def probe(self, timeout_s: float = 60.0) -> None:
        """Write and delete a small object under the root, within `timeout_s`: a run finds out that it cannot
        save before it trains, not at its first checkpoint. Raises CheckpointError naming the root and the
        cause in one line (never a credential: values of the environment's secret-looking variables are
        masked). On S3 a missing bucket is an error, not created (s3fs's makedirs would create it)."""
        name = self._p(f".moerl-probe-{uuid.uuid4().hex}")

        def write_and_delete() -> None:
            if self._local:
                self._fs.makedirs(self._path, exist_ok=True)
            self._fs.pipe_file(name, b"moerl write probe\n")  # a PUT: s3fs's open() would create a missing bucket
            self._fs.rm(name)

        pool = ThreadPoolExecutor(1, thread_name_prefix="moerl-probe")
        try:
            pool.submit(write_and_delete).result(timeout=timeout_s)
        except TimeoutError:
            raise CheckpointError(f"checkpoint.dir {_shown(self.root)!r}: a test write did not finish within "
                                  f"{timeout_s:.0f} s (unreachable endpoint?)") from None
        except Exception as e:  # noqa: BLE001 - credentials, permissions, a missing bucket: named, not dumped
            raise CheckpointError(f"checkpoint.dir {_shown(self.root)!r} is not writable: "
                                  f"{_redact(_probe_cause(e, self._local))}") from None
        finally:
            pool.shutdown(wait=False)

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
        self._written.pop(step, None)

    def write_bytes(self, step: int, name: str, data: bytes) -> None:
        self._put(self._p(step_name(step), name), data)
        self._written.setdefault(step, {})[name] = checksum(data)  # of the very buffer written: no re-read

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
    def commit(self, step: int, manifest_extra: dict[str, Any] | None = None,
               checksums: dict[str, str] | None = None) -> dict[str, Any]:
        """List the files present (with sizes and checksums) into the manifest, write COMMIT, then `latest`.

        checksums: relative path -> checksum of files written elsewhere (the trainer ranks' DCP files, from
        `save_trainer_state`'s future); those of `write_bytes` are known already. A file with none is hashed
        by reading it back, with a warning: correct, but a second full read of what the writer saw."""
        extra = dict(manifest_extra or {})
        clash = [k for k in extra if k in _RESERVED]
        if clash:
            raise ValueError(f"manifest_extra may not set reserved key(s) {clash}")
        files = {k: v for k, v in self._files(step).items() if k != COMMIT and not k.endswith(".tmp")}
        if not files:
            raise CheckpointError(f"{self.step_path(step)}: nothing to commit (no files written)")
        known = {**self._written.pop(step, {}), **(checksums or {})}
        unhashed = sorted(set(files) - set(known))
        if unhashed:
            log.warning("%s: no checksum recorded while writing %s; reading back to hash",
                        self.step_path(step), ", ".join(unhashed[:5]) + (" ..." if len(unhashed) > 5 else ""))
            known.update(zip(unhashed, self._pool(lambda n: self._hash_file(step, n), unhashed)))
        sums = {name: known[name] for name in files}
        manifest = {"step": step, "files": files, CHECKSUMS: sums, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
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

    def step_dirs(self) -> list[int]:
        """The steps that have a directory, committed or not (an upload cut short, a torn checkpoint)."""
        return self._step_dirs()

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
        """Raise CheckpointError naming every file missing, of another size than the manifest says, or (read
        in full and hashed) whose checksum does not match the manifest's."""
        manifest = self.read_manifest(step)
        sums = manifest.get(CHECKSUMS, {})  # absent: written before checksums, checked by size only
        if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
            raise CheckpointError(f"{self.step_path(step)}/{COMMIT}: '{CHECKSUMS}' is not a table of strings")
        present = self._files(step)
        problems = []
        for name, size in sorted(manifest["files"].items()):
            if name not in present:
                problems.append(f"missing {name}")
            elif present[name] != size:
                problems.append(f"{name} has {present[name]} bytes, the manifest says {size}")
        if problems:
            raise CheckpointError(f"{self.step_path(step)}: incomplete checkpoint: " + "; ".join(problems))
        if not sums:
            log.info("%s: manifest has no checksums (an older checkpoint): sizes checked only", self.step_path(step))
        names = sorted(n for n in sums if n in manifest["files"])
        for name, got in zip(names, self._pool(lambda n: self._hash_file(step, n), names)):
            if not sums[name].startswith(PREFIX):
                problems.append(f"{name}: unknown checksum {sums[name]!r} in the manifest")
            elif got != sums[name]:
                problems.append(f"{name}: checksum does not match ({got}, the manifest says {sums[name]})")
        if problems:
            raise CheckpointError(f"{self.step_path(step)}: corrupted checkpoint: " + "; ".join(problems))
        return manifest

    def _hash_file(self, step: int, name: str) -> str:
        crc = 0
        with self._fs.open(self._p(step_name(step), name), "rb", block_size=_READ_BLOCK) as f:
            while chunk := f.read(_READ_BLOCK):
                crc = zlib.crc32(chunk, crc)
        return fmt(crc)

    @staticmethod
    def _pool(fn: Callable[[str], str], items: list[str]) -> list[str]:
        if len(items) <= 1:
            return [fn(i) for i in items]
        with ThreadPoolExecutor(min(_VERIFY_THREADS, len(items))) as pool:
            return list(pool.map(fn, items))

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


def _probe_cause(e: BaseException, local: bool) -> str:
    """One line: the exception's type and first line, and for the usual S3 faults what to check."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    cause = f"{type(e).__name__}: {lines[0] if lines else repr(e)}"
    if local:
        return cause
    kind = type(e).__name__
    if kind in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
        return cause + (" (no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, "
                        "or run with an instance or IRSA role)")
    if "Endpoint" in kind or "Connect" in kind:
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS's default"
        return cause + f" (cannot reach the S3 endpoint: {endpoint}; AWS_ENDPOINT_URL sets another)"
    if isinstance(e, FileNotFoundError):
        return cause + " (check the bucket's name; these credentials may not see it)"
    if isinstance(e, PermissionError):
        return cause + " (access denied: the credentials may not write under this prefix)"
    return cause


def _shown(root: str) -> str:
    """The root as messages show it: credentials written into the URL (scheme://key:secret@...) masked."""
    return re.sub(r"^([a-z0-9+.-]+://)[^/@]*@", r"\1***@", root)


def _redact(message: str) -> str:
    """`message` with the value of every secret-looking environment variable (AWS_SECRET_ACCESS_KEY,
    AWS_SESSION_TOKEN, AWS_ACCESS_KEY_ID, ...) replaced by ***."""
    for name, value in os.environ.items():
        upper = name.upper()
        if len(value) >= 4 and any(w in upper for w in ("SECRET", "TOKEN", "PASSWORD", "ACCESS_KEY", "CREDENTIAL")):
            message = message.replace(value, "***")
    return message


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)
