"""`moerl` command line. Subcommands import their parts lazily.

    moerl train configs/demo.toml [--resume] [--section.key=value ...]   # the RL job (`make demo` runs this)
    moerl config configs/demo.toml --train.steps=20   # print the resolved config
    moerl bench moe-layer [--help]          # benchmarks; see BENCHMARKS.md
    moerl bench dispatch [--help]
    moerl export CHECKPOINT_DIR OUT_DIR [--step N] [--source DIR]   # the policy as a Hugging Face directory
"""

from __future__ import annotations

import argparse
import importlib
import sys

BENCHES = {"moe-layer": "moerl.bench.moe_layer", "dispatch": "moerl.bench.dispatch", "rollout": "moerl.bench.rollout",
           "async": "moerl.bench.async_loop", "checkpoint": "moerl.bench.checkpoint",
           "train": "moerl.bench.train", "loop": "moerl.bench.loop"}


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHES:
        print(f"usage: moerl bench {{{','.join(BENCHES)}}} [options]", file=sys.stderr)
        return 2
    return importlib.import_module(BENCHES[argv[0]]).main(argv[1:]) or 0


def _config(argv: list[str]) -> int:
    from moerl.config import ConfigError, dump_toml, load_config

    if not argv:
        print("usage: moerl config CONFIG.toml [--section.key=value ...]", file=sys.stderr)
        return 2
    try:
        print(dump_toml(load_config(argv[0], argv[1:])), end="")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _launch(argv: list[str]) -> int:
    from moerl.launch.cli import main as launch_main

    return launch_main(argv)


def _export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moerl export", description="Write the policy of a committed "
                                     "checkpoint (latest by default) as a Hugging Face directory (safetensors).")
    parser.add_argument("checkpoint_dir", help="checkpoint.dir of the run: local path or s3://bucket/prefix")
    parser.add_argument("out_dir")
    parser.add_argument("--step", type=int, default=None, help="a committed step (default: latest)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="dtype of the written weights (default: the run's model.dtype)")
    parser.add_argument("--source", default=None, metavar="DIR",
                        help="a model or tokenizer directory whose tokenizer files and generation_config.json to "
                        "write (default: those saved with the checkpoint)")
    args = parser.parse_args(argv)
    from moerl.checkpoint import CheckpointError, CheckpointStore, export_policy

    store = CheckpointStore(args.checkpoint_dir)
    step = args.step if args.step is not None else store.latest_step()
    if step is None:
        print(f"error: {args.checkpoint_dir}: no committed checkpoint to export", file=sys.stderr)
        return 2
    try:
        out = export_policy(args.checkpoint_dir, args.out_dir, step, dtype=args.dtype, source=args.source)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {store.step_path(step)} to {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")
    return 0


def _train(argv: list[str]) -> int:
    from moerl.run import main as train_main

    return train_main(argv)


COMMANDS = {"bench": _bench, "config": _config, "export": _export, "launch": _launch, "train": _train}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser = argparse.ArgumentParser(prog="moerl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("command", choices=sorted(COMMANDS))
        parser.print_help()
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
