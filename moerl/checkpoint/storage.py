"""Where checkpoints live: a local directory or `s3://bucket/prefix`, through fsspec (s3fs for S3).

Layout under the root, one directory per step:

    <root>/step-00000012/trainer/...       torch.distributed.checkpoint files (every trainer rank writes)
    <root>/step-00000012/controller.pt     the controller's state (see controller_state.py)
    <root>/step-00000012/arch.json         the model architecture (HF config.json dict), for export
    <root>/step-00000012/COMMIT            JSON manifest, written LAST: the step exists only once it does;
                                           every file's size and checksum (checksum.py)
    <root>/latest                          text "step-00000012", written after the COMMIT

A crash anywhere before the COMMIT leaves a directory that every reader ignores, so the previous committed
step stays the one resumed from. A step is committed only when every file its DCP metadata names holds the bytes
its entries need (a writer that failed leaves a hole the metadata still names); on a local path COMMIT and
`latest` are fsynced (file, then directory) before the next one is written, so a power cut cannot leave a
`latest` naming a step whose COMMIT was lost. The S3 endpoint comes from the standard AWS variables (`AWS_ENDPOINT_URL`,
honoured by botocore >= 1.31, which s3fs uses), so any S3-compatible store works. Messages never include
the filesystem object or its options: they may hold credentials.

Every call has a deadline (deadline.py), and every object key read from storage (a manifest's, a listing's) must
be a plain relative path inside its step (untrusted.py). Checksums are taken from the bytes as they are written (`write_bytes` here, DCP's writer threads in
trainer_state.py, passed to `commit`) and checked by `verify`, which resume and export call. A manifest without a
checksum for each of its files is refused: a missing table must not turn the check off.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import fsspec
from fsspec.core import url_to_fs

from moerl.checkpoint.checksum import PREFIX, checksum, fmt
from moerl.checkpoint.deadline import STORAGE_TIMEOUT_S, StorageTimeout, bound_fs, call, endpoint, fs_options
from moerl.checkpoint.untrusted import check_key
from moerl.model.config import CheckpointError

log = logging.getLogger(__name__)

COMMIT = "COMMIT"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
CHECKSUMS = "checksums"
_RESERVED = ("step", "files", "created", CHECKSUMS)
_READ_BLOCK = 16 << 20  # verify streams each file in blocks of this size: never a whole file in memory
_VERIFY_THREADS = 8  # files are hashed in parallel (zlib releases the GIL; S3 reads overlap)
DCP_METADATA = ".metadata"  # a trainer directory's DCP metadata: what its files must hold (trainer_state.py)
R = TypeVar("R")


def step_name(step: int) -> str:
    return f"step-{step:08d}"


@dataclass(frozen=True)
class StepTarget:
    """A step being saved, as the trainer ranks see it: the coordinating rank clears it (`begin`) in its upload
    thread before any rank writes, so that storage call runs neither on the controller's thread nor the trainer's."""

    root: str
    step: int
    timeout_s: float = STORAGE_TIMEOUT_S

    def begin(self) -> None:
        CheckpointStore(self.root, self.timeout_s).begin(self.step)


class CheckpointStore:
    def __init__(self, root: str, timeout_s: float = STORAGE_TIMEOUT_S) -> None:
        """timeout_s: the deadline of each storage call (checkpoint.storage_timeout_s)."""
        self.timeout_s = timeout_s
        self._fs, path = url_to_fs(root, **fs_options(root, timeout_s))
        bound_fs(self._fs)
        self.root = root.rstrip("/")
        self._path = path.rstrip("/")  # root without the protocol, as fs methods take it
        self._local = "file" in _protocols(self._fs)
        self._written: dict[int, dict[str, str]] = {}  # step -> name -> checksum of what write_bytes wrote

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        return self._fs

    def _call(self, what: str, fn: Callable[..., R], *args: Any) -> R:
        """fn(*args) within the deadline, else StorageTimeout naming the root, `what` and the endpoint."""
        return call(fn, *args, timeout_s=self.timeout_s, what=f"{_shown(self.root)}: {what}", url=self.root)

    def probe(self) -> None:
        """Write and delete a small object under the root, within the deadline: a run finds out that it cannot
        save before it trains, not at its first checkpoint. Raises CheckpointError naming the root and the
        cause in one line (never a credential: values of the environment's secret-looking variables are
        masked). On S3 a missing bucket is an error, not created (s3fs's makedirs would create it). The write
        runs in a daemon thread: a call that never answers cannot keep the process from exiting."""
        name = self._p(f".moerl-probe-{uuid.uuid4().hex}")

        def write_and_delete() -> None:
            if self._local:
                self._fs.makedirs(self._path, exist_ok=True)
            self._fs.pipe_file(name, b"moerl write probe\n")  # a PUT: s3fs's open() would create a missing bucket
            self._fs.rm(name)

        try:
            call(write_and_delete, timeout_s=self.timeout_s, what=f"checkpoint.dir {_shown(self.root)!r}: a test write",
                 url=self.root)
        except StorageTimeout:
            raise  # one line naming the endpoint already
        except Exception as e:  # noqa: BLE001 - credentials, permissions, a missing bucket: named, not dumped
            raise CheckpointError(f"checkpoint.dir {_shown(self.root)!r} is not writable: "
                                  f"{_redact(_probe_cause(e, self._local))}") from None

    def step_path(self, step: int) -> str:
        """The step directory as a URL (s3://... or a local path): what torch.distributed.checkpoint takes."""
        return f"{self.root}/{step_name(step)}"

    def _p(self, *parts: str) -> str:
        return "/".join((self._path, *parts))

    # ------------------------------------------------------------------ files of one step
    def begin(self, step: int) -> None:
        """Clear what an earlier attempt left under this step (COMMIT first), before writing it again.

        Needed after resuming from an older step: the step directory may hold a COMMIT of the abandoned
        timeline, and new files written under it must never look committed before the new COMMIT. A `latest`
        naming this step goes too (the newest committed step is found without it), so that a `latest` naming an
        uncommitted step always means a lost COMMIT (see `torn_steps`)."""
        self._remove_step(step)
        if self._latest_named() == step:
            self._call(f"delete {LATEST}", self._fs.rm_file, self._p(LATEST))
        self._written.pop(step, None)

    def write_bytes(self, step: int, name: str, data: bytes) -> None:
        self._put(self._p(step_name(step), name), data)
        self._written.setdefault(step, {})[name] = checksum(data)  # of the very buffer written: no re-read

    def read_bytes(self, step: int, name: str) -> bytes:
        path = self._p(step_name(step), check_key(name, self.step_path(step)))
        try:
            return self._call(f"read {step_name(step)}/{name}", self._fs.cat_file, path)
        except FileNotFoundError:
            raise CheckpointError(f"{self.root}/{step_name(step)}: missing file {name!r}") from None

    def _put(self, path: str, data: bytes) -> None:
        name = path[len(self._path) + 1:]
        if self._local:  # a crash mid-write must not leave a truncated COMMIT/latest: write, fsync, rename, fsync
            self._call(f"write {name}", _write_durably, path, data)
        else:  # an S3 PUT is atomic: the object appears whole or not at all
            self._call(f"write {name}", self._fs.pipe_file, path, data)

    def _files(self, step: int) -> dict[str, int]:
        """Relative path -> size of every file under the step directory (fresh listing, no cache). A listed key
        that is not a plain relative path under the step is refused, naming it."""
        base = self._p(step_name(step))

        def listing() -> dict[str, Any]:
            self._fs.invalidate_cache()  # another process (another rank, DCP's own fs instance) wrote here
            return self._fs.find(base, detail=True)
        out = {}
        for path, info in self._call(f"list {step_name(step)}", listing).items():
            if info.get("type") != "file":
                continue
            if not path.startswith(base + "/"):
                raise CheckpointError(f"{self.step_path(step)}: the listing holds {path!r}, which is not under it")
            rel = check_key(path[len(base) + 1:], self.step_path(step))
            out[rel] = int(info["size"])
        return out

    def _check_trainer_files(self, step: int, files: dict[str, int]) -> None:
        """Every DCP directory of the step (a `.metadata` among `files`) holds the bytes its metadata names:
        CheckpointError naming what is missing or short (a writer that failed without telling DCP)."""
        from moerl.checkpoint.dcp_files import check_stored

        for name in sorted(n for n in files if n.rsplit("/", 1)[-1] == DCP_METADATA):
            prefix = name[: -len(DCP_METADATA)]
            sizes = {k[len(prefix):]: v for k, v in files.items() if k.startswith(prefix) and k != name}
            check_stored(self.read_bytes(step, name), sizes, f"{self.step_path(step)}/{name}")

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
        self._check_trainer_files(step, files)  # a hole in the trainer's files: not committed, `latest` stays
        known = {**self._written.pop(step, {}), **(checksums or {})}
        unhashed = sorted(set(files) - set(known))
        if unhashed:
            log.warning("%s: no checksum recorded while writing %s; reading back to hash",
                        self.step_path(step), ", ".join(unhashed[:5]) + (" ..." if len(unhashed) > 5 else ""))
            known.update(zip(unhashed, self._pool(lambda n: self._hash_file(step, n), unhashed)))
        sums = {name: known[name] for name in files}
        manifest = {"step": step, "files": files, CHECKSUMS: sums, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    **extra}
        if self._local:  # the files' directory entries are durable before the COMMIT that names them
            self._call(f"sync {step_name(step)}", _fsync_tree, self._p(step_name(step)))
        self._put(self._p(step_name(step), COMMIT), json.dumps(manifest, indent=1, sort_keys=True).encode())
        self._put(self._p(LATEST), step_name(step).encode())
        return manifest

    def read_manifest(self, step: int) -> dict[str, Any]:
        """The COMMIT of `step`, its file names checked (plain relative paths) and sizes (integers)."""
        try:
            raw = self._call(f"read {step_name(step)}/{COMMIT}", self._fs.cat_file, self._p(step_name(step), COMMIT))
        except FileNotFoundError:
            raise CheckpointError(f"{self.step_path(step)}: not committed (no {COMMIT} marker)") from None
        try:
            manifest = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.step_path(step)}/{COMMIT}: not valid JSON ({e})") from None
        if not isinstance(manifest, dict) or manifest.get("step") != step or not isinstance(manifest.get("files"), dict):
            raise CheckpointError(f"{self.step_path(step)}/{COMMIT}: not a manifest of step {step}")
        where = f"{self.step_path(step)}/{COMMIT}"
        for name, size in manifest["files"].items():
            check_key(name, where)
            if type(size) is not int or size < 0:
                raise CheckpointError(f"{where}: the size of {name!r} is not a count of bytes ({size!r})")
        return manifest

    def _step_dirs(self) -> list[int]:
        def listing() -> list[str]:
            self._fs.invalidate_cache()
            return self._fs.ls(self._path, detail=False)
        try:
            entries = self._call("list the steps", listing)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for e in entries if (m := _STEP_DIR.match(e.rstrip("/").rsplit("/", 1)[-1])))

    def _is_committed(self, step: int) -> bool:
        try:
            self.read_manifest(step)
            return True
        except StorageTimeout:
            raise  # no answer is not "no COMMIT"
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
            text = self._call(f"read {LATEST}", self._fs.cat_file, self._p(LATEST)).decode("utf-8", "replace").strip()
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

    def torn_steps(self, after: int | None) -> list[tuple[int, str]]:
        """Steps newer than `after` whose COMMIT was written and then lost or damaged, newest first, each with
        what is wrong: a COMMIT that does not read as its step's manifest, or none where `latest` names the step
        (`latest` is written after the COMMIT, and `begin` drops a `latest` naming the step it clears). A newer
        directory without COMMIT that `latest` does not name is an upload cut short: not torn."""
        named, torn = self._latest_named(), []
        for step in reversed([s for s in self._step_dirs() if after is None or s > after]):
            try:
                self.read_manifest(step)
            except StorageTimeout:
                raise
            except CheckpointError as e:
                missing = "not committed" in str(e)
                if not missing or step == named:
                    torn.append((step, f"`{LATEST}` names it but it has no {COMMIT}" if missing else
                                 str(e).removeprefix(f"{self.step_path(step)}/")))
        return torn

    def verify(self, step: int, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
        """Raise CheckpointError naming every file missing, of another size than the manifest says, or (read
        in full and hashed) whose checksum does not match the manifest's. progress: hears a line per file read."""
        manifest = self.read_manifest(step)
        sums = manifest.get(CHECKSUMS)
        if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
            raise CheckpointError(f"{self.step_path(step)}/{COMMIT}: " + (
                f"no '{CHECKSUMS}' table, so its files cannot be checked (every moerl commit writes one: a manifest "
                "without it was edited): refused" if sums is None else f"'{CHECKSUMS}' is not a table of strings"))
        unsummed = sorted(set(manifest["files"]) - set(sums))
        if unsummed:  # a file without a checksum would be read unchecked: as much a hole as no table at all
            raise CheckpointError(f"{self.step_path(step)}/{COMMIT}: no checksum for {len(unsummed)} of its "
                                  f"{len(manifest['files'])} files ({', '.join(unsummed[:3])}"
                                  f"{' ...' if len(unsummed) > 3 else ''}), so they cannot be checked: refused")
        present = self._files(step)
        problems = []
        for name, size in sorted(manifest["files"].items()):
            if name not in present:
                problems.append(f"missing {name}")
            elif present[name] != size:
                problems.append(f"{name} has {present[name]} bytes, the manifest says {size}")
        if problems:
            raise CheckpointError(f"{self.step_path(step)}: incomplete checkpoint: " + "; ".join(problems))
        self._check_trainer_files(step, manifest["files"])
        names = sorted(manifest["files"])
        done, lock = [0, 0], threading.Lock()

        def hash_one(name: str) -> str:
            got = self._hash_file(step, name)
            if progress is not None:
                with lock:  # the files are hashed in parallel
                    done[0] += 1
                    done[1] += manifest["files"][name]
                    progress(f"read {done[0]}/{len(names)} files, {done[1] / (1 << 20):.1f} MiB ({name})")
            return got
        for name, got in zip(names, self._pool(hash_one, names)):
            if not sums[name].startswith(PREFIX):
                problems.append(f"{name}: unknown checksum {sums[name]!r} in the manifest")
            elif got != sums[name]:
                problems.append(f"{name}: checksum does not match ({got}, the manifest says {sums[name]})")
        if problems:
            raise CheckpointError(f"{self.step_path(step)}: corrupted checkpoint: " + "; ".join(problems))
        return manifest

    def _hash_file(self, step: int, name: str) -> str:
        """The file's checksum, read in blocks: the deadline bounds each block, not the whole file."""
        what = f"read {step_name(step)}/{name}"
        crc = 0
        f = self._call(what, self._fs.open, self._p(step_name(step), check_key(name, self.step_path(step))), "rb",
                       _READ_BLOCK)
        try:
            while chunk := self._call(what, f.read, _READ_BLOCK):
                crc = zlib.crc32(chunk, crc)
        finally:
            f.close()
        return fmt(crc)

    @staticmethod
    def _pool(fn: Callable[[str], str], items: list[str]) -> list[str]:
        if len(items) <= 1:
            return [fn(i) for i in items]
        with ThreadPoolExecutor(min(_VERIFY_THREADS, len(items))) as pool:
            return list(pool.map(fn, items))

    # ------------------------------------------------------------------ retention
    def prune(self, keep: int) -> list[int]:
        """Delete all but the newest `keep` committed steps (never the one `latest` names, nor the newest one
        whose files are all there: a newer one may have lost some) and the uncommitted directories older than
        the newest committed step (abandoned uploads). Newer uncommitted directories may be uploads in
        progress: they stay. Returns the steps deleted."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        dirs = self._step_dirs()
        committed = [s for s in dirs if self._is_committed(s)]
        if not committed:
            return []
        protected = set(committed[-keep:]) | {self._latest_named()}
        for s in reversed(committed):  # newest first, up to and including the newest complete one
            protected.add(s)
            if self._complete(s):
                break
        doomed = [s for s in committed if s not in protected]
        doomed += [s for s in dirs if s not in committed and s < committed[-1] and s not in protected]
        for s in sorted(doomed):
            self._remove_step(s)
        return sorted(doomed)

    def _complete(self, step: int) -> bool:
        """Every file of the manifest there with its size, and the trainer's files whole (no checksums read)."""
        try:
            manifest, present = self.read_manifest(step), self._files(step)
            if any(present.get(n) != size for n, size in manifest["files"].items()):
                return False
            self._check_trainer_files(step, manifest["files"])
            return True
        except StorageTimeout:
            raise
        except CheckpointError:
            return False

    def _remove_step(self, step: int) -> None:
        base = self._p(step_name(step))

        def remove() -> None:
            try:  # the COMMIT goes first, so a crash while deleting never leaves a committed-looking partial
                self._fs.rm_file(f"{base}/{COMMIT}")
            except FileNotFoundError:
                pass
            self._fs.invalidate_cache()
            if self._fs.exists(base):
                self._fs.rm(base, recursive=True)
            self._fs.invalidate_cache()
        self._call(f"delete {step_name(step)}", remove)


def _write_durably(path: str, data: bytes) -> None:
    """A local file that is whole or absent after a crash or power cut: write a temporary, fsync it, rename it
    over `path`, fsync the directory (the rename is durable only then)."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk: no zero-byte temporary left behind
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    """fsync every directory under `root` (DCP fsyncs its files, not the directory entries naming them)."""
    for directory, _, _ in os.walk(root):
        _fsync_dir(directory)


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
    if "Endpoint" in kind or "Connect" in kind or "Timeout" in kind:
        return cause + f" (cannot reach the {endpoint('s3://')}; AWS_ENDPOINT_URL sets another)"
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
