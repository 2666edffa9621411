"""torch.distributed.checkpoint's files through fsspec, as moerl writes and reads them.

    writer(path, ...)          DCP's FsspecWriter that hashes what it writes, fails when any writer thread failed
                               (DCP drops those threads' errors and writes a .metadata naming bytes that were never
                               stored), clears the step first when asked, and bounds each storage call
    read_metadata(path)        the .metadata through an allow-list unpickler, every entry checked (untrusted input)
    load_into(path, wanted)    the tensors named, with a failure named by its file in one line
    check_stored(raw, sizes)   every byte range the metadata names lies inside a file of those sizes
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed.checkpoint as dcp

from moerl.checkpoint.checksum import HashingStream
from moerl.checkpoint.deadline import STORAGE_TIMEOUT_S, bound_fs, fs_options, is_s3
from moerl.checkpoint.untrusted import check_key, load_error
from moerl.model.config import CheckpointError

_READ_BLOCK = 128 << 20
METADATA = ".metadata"


def _fsspec():
    try:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    except ImportError as e:  # a private module (torch 2.11-2.14): say what is missing, not a bare ImportError
        raise ImportError(f"moerl checkpoints need torch.distributed.checkpoint._fsspec_filesystem (torch "
                          f"{torch.__version__} lacks it or fsspec is not installed): {e}") from e
    return FsspecReader, FsspecWriter


# ---------------------------------------------------------------------------------------- write
class _HashingFS:
    """DCP's filesystem wrapper, hashing every file it writes as the bytes go out (DCP opens, writes and
    renames its files itself, so this is where the bytes can be seen without reading them back). `sums`:
    path relative to the checkpoint -> checksum; a rename (DCP writes .metadata.tmp, then renames it) moves
    the entry. `errors`: (path, exception) of every write that failed, in whichever writer thread. Everything
    else passes through."""

    def __init__(self, inner: Any, root: str, sums: dict[str, str]) -> None:
        self._inner, self._root, self.sums = inner, root.rstrip("/") + "/", sums
        self.errors: list[tuple[str, BaseException]] = []

    def _rel(self, path: Any) -> str:
        p = os.fspath(path)
        return p[len(self._root):] if p.startswith(self._root) else os.path.basename(p)

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if "r" in mode:
            with self._inner.create_stream(path, mode) as raw:
                yield raw
            return
        try:
            with self._inner.create_stream(path, mode) as raw:
                stream = HashingStream(raw)
                yield stream
        except BaseException as e:
            self.errors.append((self._rel(path), e))  # DCP's extra writer threads drop what they raise
            raise
        self.sums[self._rel(path)] = stream.hexdigest()  # only once the file closed without error

    def rename(self, path: Any, new_path: Any) -> None:
        self._inner.rename(path, new_path)
        if (s := self.sums.pop(self._rel(path), None)) is not None:
            self.sums[self._rel(new_path)] = s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def writer(path: str, thread_count: int, before_write: Callable[[], None] | None = None,
           timeout_s: float = STORAGE_TIMEOUT_S):
    """DCP's fsspec writer for `path`; `writer.fs.sums` holds the checksums of the files written.

    before_write: run by the coordinating rank while DCP plans, before any rank writes (each rank's writes
    follow the plan collective, which waits for the coordinator's local plan): clearing the step directory
    here keeps that storage call in the upload thread, off the trainer's and the controller's threads."""
    _, FsspecWriter = _fsspec()

    class SafeWriter(FsspecWriter):
        def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            super().set_up_storage_writer(is_coordinator, *args, **kwargs)
            self._coordinator = is_coordinator

        def prepare_local_plan(self, plan):
            if before_write is not None and getattr(self, "_coordinator", True):
                before_write()
            return super().prepare_local_plan(plan)

        def write_data(self, plan, planner):
            if not is_s3(os.fspath(self.path)):  # the coordinator's clearing may have removed this rank's directory
                self.fs.mkdir(self.path)
            result = super().write_data(plan, planner)  # joins every writer thread
            if self.fs.errors:
                rel, error = self.fs.errors[0]
                raise OSError(f"writing {rel} failed: {type(error).__name__}: {error}") from error
            return result

    w = SafeWriter(path, thread_count=thread_count, overwrite=True, **fs_options(path, timeout_s))
    bound_fs(w.fs.fs)
    w.fs = _HashingFS(w.fs, os.fspath(w.path), {})
    return w


# ---------------------------------------------------------------------------------------- read
class _MetadataUnpickler(pickle.Unpickler):
    """DCP stores its .metadata with plain pickle. Accept only the data classes of DCP's metadata module (and
    its per-file `_StorageInfo`), torch.Size, dtypes, layouts and memory formats, so a forged .metadata in the
    bucket cannot run code when a run resumes. (A name imported into a DCP module, e.g. a writer class or
    `os`, is not enough: the class must be defined in the metadata module itself.)"""

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:  # a dotted name would let pickle walk attributes to anything
            if (module, name) in (("torch.serialization", "_get_layout"),  # how torch pickles torch.strided
                                  ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                                  ("torch", "Size"), ("collections", "OrderedDict")):
                return super().find_class(module, name)
            if module in ("torch", "torch.distributed.checkpoint.metadata"):
                obj = super().find_class(module, name)
                if isinstance(obj, (torch.dtype, torch.memory_format, torch.layout)) or (
                        isinstance(obj, type) and obj.__module__ == "torch.distributed.checkpoint.metadata"):
                    return obj
        raise pickle.UnpicklingError(f"checkpoint .metadata refers to {module}.{name}, which is not allowed")


def _validate_metadata(metadata: Any, where: str) -> None:
    """Only tensor entries, at paths inside the checkpoint, each chunk of each with its stored bytes. DCP reads a
    "bytes" entry with `torch.load(weights_only=False)`, a pickle loader: a forged entry of that kind ran its
    payload on resume. A chunk without storage is what a failed writer thread left (DCP then died on a KeyError).
    Types are checked exactly (pickle can give any allowed class any attribute, so duck typing proves nothing)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
    )

    if type(metadata) is not Metadata:
        raise CheckpointError(f"{where}: not a checkpoint's metadata ({type(metadata).__name__})")
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        raise CheckpointError(f"{where}: no table of entries")
    for key, entry in entries.items():
        if type(entry) is not TensorStorageMetadata:
            raise CheckpointError(f"{where}: entry {key!r} is a {type(entry).__name__}, not a tensor (moerl "
                                  "checkpoints hold tensors only; anything else could reach a pickle loader)")
        size = entry.size
        if (type(entry.properties) is not TensorProperties or not isinstance(entry.properties.dtype, torch.dtype)
                or not isinstance(size, (tuple, torch.Size)) or not all(type(n) is int and n >= 0 for n in size)):
            raise CheckpointError(f"{where}: entry {key!r} has no valid dtype and shape")
    storage = metadata.storage_data or {}
    if not isinstance(storage, dict):
        raise CheckpointError(f"{where}: no table of stored bytes")
    for index, info in storage.items():
        rel = getattr(info, "relative_path", None)
        try:
            if type(index) is not MetadataIndex or type(info) is not _StorageInfo:
                raise CheckpointError("")
            check_key(rel, where)
        except CheckpointError:
            raise CheckpointError(f"{where}: storage path {rel!r} of {getattr(index, 'fqn', index)!r} is not a "
                                  "plain path inside the checkpoint") from None
        if (type(info.offset) is not int or type(info.length) is not int or info.offset < 0 or info.length < 0
                or info.transform_descriptors):
            raise CheckpointError(f"{where}: storage of {getattr(index, 'fqn', index)!r} has an invalid offset, "
                                  "length or transform")
    stored = {(i.fqn, tuple(i.offset or ())) for i in storage}
    unstored = []
    for key, entry in entries.items():
        chunks = entry.chunks
        if not isinstance(chunks, list) or not all(type(c) is ChunkStorageMetadata for c in chunks):
            raise CheckpointError(f"{where}: entry {key!r} has no valid chunks")
        unstored += [key for c in chunks if (key, tuple(c.offsets)) not in stored][:1]
    if unstored:
        raise CheckpointError(f"{where}: {len(unstored)} of {len(entries)} entries have no stored bytes (a writer "
                              f"failed), e.g. {', '.join(map(repr, unstored[:3]))}")


def _unpickle_metadata(f: Any, where: str) -> Any:
    try:
        metadata = _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{where}: {e}") from None
    except Exception as e:  # noqa: BLE001 - a truncated or garbled pickle: named, in one line
        raise CheckpointError(f"{where}: not a checkpoint's metadata ({load_error(e)})") from None
    _validate_metadata(metadata, where)
    return metadata


def check_stored(raw: bytes, sizes: dict[str, int], where: str) -> None:
    """`raw` (a .metadata's bytes) is valid and every byte range it names lies inside a file of `sizes` (name
    relative to the metadata's directory -> bytes): else CheckpointError naming each file missing or short."""
    metadata = _unpickle_metadata(io.BytesIO(raw), where)
    need: dict[str, int] = {}
    for info in metadata.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    problems = [f"missing {rel}" if rel not in sizes else f"{rel} has {sizes[rel]} bytes, its entries need {n}"
                for rel, n in sorted(need.items()) if sizes.get(rel, -1) < n]
    if problems:
        raise CheckpointError(f"{where}: the trainer's files are incomplete: " + "; ".join(problems))


def _reader(path: str, timeout_s: float = STORAGE_TIMEOUT_S):
    FsspecReader, _ = _fsspec()

    class SafeReader(FsspecReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            from torch.distributed.checkpoint.metadata import StorageMeta

            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = _unpickle_metadata(f, f"{path}/{METADATA}")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan, planner):
            # DCP reads items in plan order; s3fs' read-ahead cache then refetches a block per backwards seek.
            # In file-offset order every byte is fetched once, in a few large ranged GETs.
            info = self.storage_data
            items = sorted(plan.items, key=lambda r: (info[r.storage_index].relative_path, info[r.storage_index].offset))
            return super().read_data(dataclasses.replace(plan, items=items), planner)

    # s3fs reads ahead 50 MiB past each miss; every ranged GET has a fixed cost (on moto, a copy of the whole
    # object), so fewer, larger ones: a rank's file of a few hundred MB comes in two or three GETs.
    reader = SafeReader(path, **({"default_block_size": _READ_BLOCK} if is_s3(path) else {}),
                        **fs_options(path, timeout_s))
    bound_fs(reader.fs.fs)
    reader.fs = _NamingFS(reader.fs)
    return reader


class _NamingFS:
    """Remembers the file DCP's reader opened last (it reads one file at a time), so a failure names it."""

    def __init__(self, inner: Any) -> None:
        self._inner, self.last = inner, ""

    def create_stream(self, path: Any, mode: str):
        self.last = os.fspath(path)
        return self._inner.create_stream(path, mode)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def read_metadata(path: str, timeout_s: float = STORAGE_TIMEOUT_S) -> dict[str, Any]:
    """Key -> DCP storage metadata (`.size`, `.properties.dtype` for tensors) of the checkpoint at `path`."""
    try:
        return _reader(path, timeout_s).read_metadata().state_dict_metadata
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no trainer checkpoint ({METADATA} missing)") from None


def load_into(path: str, wanted: dict[str, Any], timeout_s: float = STORAGE_TIMEOUT_S) -> dict[str, torch.Tensor]:
    """Read the tensors named in `wanted` (a subset of `read_metadata(path)`) into fresh CPU tensors. A file that
    cannot be read (not tensors, cut short, refused) is named in one CheckpointError line."""
    from torch.distributed.checkpoint.api import CheckpointException

    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in wanted.items()}
    reader = _reader(path, timeout_s)
    try:
        dcp.load(sd, storage_reader=reader, no_dist=True)  # every rank reads its own keys: no collectives
    except CheckpointException as e:
        error = cause_of(e)
        if isinstance(error, CheckpointError):
            raise CheckpointError(str(error)) from None
        raise CheckpointError(f"{reader.fs.last or path}: cannot be loaded: {load_error(error)}") from None
    return sd


def cause_of(e: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException (whose text is every rank's traceback)."""
    failures = getattr(e, "failures", None)
    first = next(iter(failures.values()), None) if isinstance(failures, dict) else None
    return first[0] if isinstance(first, tuple) and isinstance(first[0], BaseException) else e
