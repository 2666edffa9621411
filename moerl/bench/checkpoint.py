"""`moerl bench checkpoint`: trainer checkpoints to an S3 endpoint, against plain s3fs transfers of the same bytes.

    moerl bench checkpoint                          # starts moto's S3 server on 127.0.0.1 (its own process)
    moerl bench checkpoint --endpoint http://host:9000 --bucket ckpt --size-mb 1000

The state is a MoE trainer's after one AdamW step (fp32 weights + two moments, ~--size-mb MB). Rows:
  - save / load MB/s: our DCP save/load (one rank) against s3fs `pipe_file` / `cat_file` of the very same files;
  - training stall: how long the caller is blocked by an async save (staging to CPU memory) against a blocking
    save, and the wall time of "save + 3 train steps" both ways (the upload overlaps the steps).
The "of hw limit" column of the save row is the fraction of this machine's local-disk write bandwidth
(8 MiB writes + fsync of the same number of bytes), measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Callable

import torch

from moerl.bench import options
from moerl.bench.common import Row, device_description, format_table

_MOTO = ("import sys, time, logging; from moto.server import ThreadedMotoServer; "
         "logging.getLogger('werkzeug').setLevel(logging.ERROR); "
         "s = ThreadedMotoServer(ip_address='127.0.0.1', port=0, verbose=False); s.start(); "
         "print(s.get_host_and_port()[1], flush=True); sys.stdin.read()")  # lives until our stdin closes


def _parse(argv: list[str]) -> argparse.Namespace:
    return options.parser("checkpoint").parse_args(argv)  # moerl/bench/options.py: --help before torch loads


def _start_moto() -> tuple[subprocess.Popen, str]:
    """moto in its own process: in ours its request handling would compete with the client for the GIL."""
    proc = subprocess.Popen([sys.executable, "-c", _MOTO], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    port = proc.stdout.readline().strip()
    if not port.isdigit():
        proc.kill()
        raise RuntimeError("moto's S3 server did not start (pip install 'moto[server]')")
    return proc, f"http://127.0.0.1:{port}"


def _trainer(size_mb: float):
    """A MoE whose fp32 weights + 2 AdamW moments take ~size_mb MB, after one RL step."""
    from moerl.model import build_model, tiny_config
    from moerl.model.transformer import MoECausalLM
    from moerl.train.loss import LossConfig
    from moerl.train.trainer import OptimConfig, PolicyTrainer, Sample

    arch = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                head_dim=64, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256)  # ~40 MB per layer

    def params(layers: int) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in MoECausalLM(tiny_config(**arch, num_hidden_layers=layers)).parameters())

    per_layer, base = params(2) - params(1), params(1) - (params(2) - params(1))
    layers = layers_for(size_mb, base, per_layer)
    model = build_model(tiny_config(**arch, num_hidden_layers=layers), seed=0)
    trainer = PolicyTrainer(model, OptimConfig(lr=1e-4), LossConfig())
    g = torch.Generator().manual_seed(0)
    samples = [Sample(torch.randint(0, 1024, (8,), generator=g).tolist(), torch.randint(0, 1024, (8,), generator=g).tolist(),
                      [-1.0] * 8, 1.0 - 2 * (i % 2)) for i in range(4)]
    trainer.rl_step(samples)
    return trainer, samples, layers


def layers_for(size_mb: float, base: int, per_layer: int) -> int:
    """Decoder layers (at least 1) whose trainer state takes about `size_mb` MB: 12 bytes per parameter (fp32
    weights and AdamW's two moments), `base` parameters outside the layers and `per_layer` in each."""
    return max(1, round((size_mb * 1e6 / 12 - base) / per_layer))


def checkpoint_rows(nbytes: int, disk_bps: float, seconds: dict[str, float]) -> list[Row]:
    """The table's rows from the bytes of one save's files, the local disk's write bandwidth (bytes/s, the save
    rate's ceiling) and the median seconds of each measurement (save, put, load, cat, stall, async_steps,
    sync_steps)."""
    mb, s = nbytes / 1e6, seconds
    return [
        Row("save MB/s (DCP vs s3fs pipe_file of the same files)", mb / s["save"], mb / s["put"], "MB/s",
            ceiling=disk_bps / 1e6),
        Row("load MB/s (DCP vs s3fs cat_file of the same files)", mb / s["load"], mb / s["cat"], "MB/s"),
        Row("caller blocked per save (async vs blocking save)", s["stall"], s["save"], "s", higher_is_better=False),
        Row("save + 3 train steps, wall (async vs blocking)", s["async_steps"], s["sync_steps"], "s",
            higher_is_better=False),
    ]


def _disk_write_bw(nbytes: int) -> float:
    """Bytes/s of sequential 8 MiB writes + fsync to a local temp file: the `dd conv=fsync` figure."""
    block = os.urandom(8 << 20)
    with tempfile.NamedTemporaryFile(dir=tempfile.gettempdir()) as f:
        t0 = time.perf_counter()
        for _ in range(max(1, nbytes // len(block))):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
        return max(1, nbytes // len(block)) * len(block) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(argv or []))
    moto = None
    endpoint = args.endpoint or os.environ.get("AWS_ENDPOINT_URL", "")
    if not endpoint:
        moto, endpoint = _start_moto()
        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    os.environ["AWS_ENDPOINT_URL"] = endpoint  # what s3fs/botocore (and so DCP's fsspec writer) read
    try:
        return _bench(args, endpoint, local_moto=moto is not None)
    finally:
        if moto is not None:
            moto.stdin.close()
            moto.terminate()
            moto.wait(10)


def _bench(args: argparse.Namespace, endpoint: str, local_moto: bool) -> int:
    import s3fs

    from moerl.checkpoint import load_trainer_state, save_trainer_state, trainer_state_dict

    fs = s3fs.S3FileSystem()
    if not fs.exists(args.bucket):
        fs.mkdir(args.bucket)
    run = f"{args.bucket}/bench-{uuid.uuid4().hex[:8]}"
    trainer, samples, layers = _trainer(args.size_mb)
    state_bytes = sum(t.numel() * t.element_size() for t in trainer_state_dict(trainer).values())
    where = "moto S3 server on 127.0.0.1 (own process)" if local_moto else "the S3 endpoint given"
    print(f"checkpoint: {state_bytes / 1e6:.0f} MB trainer state ({layers}-layer MoE, 16 experts, fp32 + AdamW), "
          f"{where}, DCP writer threads {args.threads}, median of {args.iters}; {device_description(torch.device('cpu'))}; "
          f"load average {os.getloadavg()[0]:.1f}")

    def save(i) -> float:
        t0 = time.perf_counter()
        save_trainer_state(trainer, f"s3://{run}/save{i}/trainer", use_async=False, thread_count=args.threads)
        return time.perf_counter() - t0

    save("warm")  # connections, first-call costs; its files are what the peer uploads
    files = {p: fs.cat_file(p) for p in fs.find(f"{run}/savewarm/trainer")}  # the very bytes DCP wrote
    nbytes = sum(len(b) for b in files.values())

    def put(i: int) -> float:
        t0 = time.perf_counter()
        for p, data in files.items():
            fs.pipe_file(p.replace("/savewarm/", f"/put{i}/"), data)
        return time.perf_counter() - t0

    def load(i: int) -> float:
        t0 = time.perf_counter()
        load_trainer_state(trainer, f"s3://{run}/save{i}/trainer")
        return time.perf_counter() - t0

    def cat(i: int) -> float:
        t0 = time.perf_counter()
        for p in files:
            fs.cat_file(p.replace("/savewarm/", f"/put{i}/"))
        return time.perf_counter() - t0

    def stall(i: int) -> float:
        t0 = time.perf_counter()
        fut = save_trainer_state(trainer, f"s3://{run}/async{i}/trainer", use_async=True, thread_count=args.threads)
        blocked = time.perf_counter() - t0
        fut.result()
        return blocked

    def with_steps(i: int, use_async: bool) -> float:
        t0 = time.perf_counter()
        fut = save_trainer_state(trainer, f"s3://{run}/steps{i}{'a' if use_async else 's'}/trainer",
                                 use_async=use_async, thread_count=args.threads)
        for _ in range(3):
            trainer.rl_step(samples)
        if fut is not None:
            fut.result()
        return time.perf_counter() - t0

    # Ours and the peer's alternate within each repetition, so load from elsewhere on the machine hits both.
    runs: dict[str, list[float]] = {}
    for i in range(args.iters):
        for name, fn in (("save", save), ("put", put), ("load", load), ("cat", cat), ("stall", stall),
                         ("async_steps", lambda i: with_steps(i, True)), ("sync_steps", lambda i: with_steps(i, False)),
                         ("step", lambda i: _time(lambda: trainer.rl_step(samples)))):
            runs.setdefault(name, []).append(fn(i))
        fs.rm(f"{run}/", recursive=True)  # moto keeps objects in memory
        fs.invalidate_cache()
    medians = {k: statistics.median(v) for k, v in runs.items()}
    disk = _disk_write_bw(nbytes)
    mb = nbytes / 1e6
    print(format_table(f"moerl bench checkpoint ({mb:.0f} MB of files per save, train step {medians['step']:.2f} s)",
                       checkpoint_rows(nbytes, disk, medians), peer_name="peer"))
    print(f"of hw limit: save MB/s over local-disk write bandwidth ({disk / 1e6:,.0f} MB/s, 8 MiB writes + fsync); "
          f"load average at the end {os.getloadavg()[0]:.1f}")
    return 0


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
