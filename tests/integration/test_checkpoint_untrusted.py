"""Object keys read from storage are untrusted (issue 26 item 1): a forged checkpoint whose manifest and listing
name keys such as `hf//<absolute path>` or `hf/../../x` must never make export (or any reader) touch a path outside
its target. Local directory and moto's S3 server on 127.0.0.1 alike."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import pytest

from moerl.checkpoint import CheckpointError, CheckpointStore, export_policy
from moerl.cli import main as cli
from tests.integration.test_checkpoint_s3 import BUCKET, root, s3_endpoint, s3_root, save_step  # noqa: F401
from tests.unit.test_checkpoint_trainer import trained

pytestmark = pytest.mark.integration
PAYLOAD = b"import os; os.system('touch pwned')\n"


def _plant(store: CheckpointStore, step: int, key: str, data: bytes) -> None:
    """Put `data` where a reader of `<step>/<key>` ends up, and name the key in the manifest (the forger rewrites
    the COMMIT too: it holds sizes and CRCs, no signature)."""
    base = f"{store.step_path(step)}/{key}"
    if base.startswith("s3://"):
        import boto3

        client = boto3.client("s3")
        literal = base.removeprefix(f"s3://{BUCKET}/")
        for k in {literal, os.path.normpath(literal)}:  # whichever the HTTP layer ends up asking for
            client.put_object(Bucket=BUCKET, Key=k, Body=data)
    else:
        target = Path(os.path.normpath(base.replace("//", "/")))
        target.parent.mkdir(parents=True, exist_ok=True)
        Path(store.step_path(step), "hf").mkdir(exist_ok=True)  # so `hf/..` resolves
        target.write_bytes(data)
    commit = f"{store.step_path(step)}/COMMIT"
    manifest = json.loads(store.fs.cat_file(commit))
    manifest["files"][key] = len(data)
    manifest["checksums"][key] = f"crc32:{zlib.crc32(data):08x}"
    store.fs.pipe_file(commit, json.dumps(manifest).encode())


@pytest.mark.parametrize("how", ["absolute", "dotdot"])
def test_export_refuses_keys_that_leave_the_output_directory(root, tmp_path, how, capsys):  # noqa: F811
    store = CheckpointStore(root)
    save_step(store, trained(steps=1), 1)
    victim = tmp_path / "site-packages" / "evil.pth"
    victim.parent.mkdir()  # a directory that exists, as site-packages does
    key = f"hf/{victim}" if how == "absolute" else "hf/../../evil.pth"  # `hf/` + an absolute path: `hf//tmp/...`
    _plant(store, 1, key, PAYLOAD)
    out = tmp_path / "out" / "hf"
    with pytest.raises(CheckpointError) as e:
        export_policy(root, str(out))
    message = str(e.value)
    assert "\n" not in message and repr(key) in message, message
    assert not victim.exists() and not (tmp_path / "evil.pth").exists() and not (tmp_path / "out" / "evil.pth").exists()
    assert cli(["export", root, str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and repr(key) in err[0]
    with pytest.raises(CheckpointError, match="not a plain relative path"):
        store.verify(1)  # resume's check reads the same keys


def test_a_listing_with_a_hostile_key_is_refused_naming_it(s3_root):  # noqa: F811
    """On S3 a key is any string: a listed object that is not a plain relative path under the step is refused by
    every reader of the listing, before anything is read or written from it."""
    import boto3

    store = CheckpointStore(s3_root)
    store.write_bytes(1, "a.bin", b"a")
    store.commit(1)
    key = f"{s3_root.removeprefix(f's3://{BUCKET}/')}/step-00000001/hf//etc/x"
    boto3.client("s3").put_object(Bucket=BUCKET, Key=key, Body=b"x")
    with pytest.raises(CheckpointError, match=r"'hf//etc/x' is not a plain relative path"):
        store.verify(1)
    with pytest.raises(CheckpointError, match=r"'hf//etc/x' is not a plain relative path"):
        store.commit(1)
