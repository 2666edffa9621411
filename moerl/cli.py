"""`moerl` command line. Subcommands import their parts lazily: every `--help` answers before torch or Ray loads.

    moerl train configs/demo.toml [--resume] [--section.key=value ...]   # the RL job (`make demo` runs this)
    moerl config configs/demo.toml --train.steps=20   # print the resolved config
    moerl bench NAME [--help]               # benchmarks (listed below); see BENCHMARKS.md
    moerl export CHECKPOINT_DIR OUT_DIR [--step N] [--source DIR] [--force] [--timeout S]   # the policy as a Hugging Face directory
    moerl launch configs/demo.toml --scheduler local_cwd     # TorchX: local or EKS (docs/eks.md)
    moerl --version
"""

from __future__ import annotations

import argparse
import importlib
import sys
import textwrap

from moerl.train_args import config_overrides, config_sections, parse_train_args

BENCHES = {"moe-layer": "moerl.bench.moe_layer", "dispatch": "moerl.bench.dispatch", "rollout": "moerl.bench.rollout",
           "async": "moerl.bench.async_loop", "checkpoint": "moerl.bench.checkpoint", "moe-decode": "moerl.bench.moe_decode",
           "train": "moerl.bench.train", "loop": "moerl.bench.loop", "learn": "moerl.bench.learn",
           "logprobs": "moerl.bench.logprobs", "kernels": "moerl.bench.kernels",
           "varlen": "moerl.bench.varlen", "paged-decode": "moerl.bench.paged_decode",
           "fleet": "moerl.bench.fleet", "plan": "moerl.bench.plan_report", "ray-fleet": "moerl.bench.ray_fleet"}


def _bench(argv: list[str]) -> int:
    if argv[:1] and argv[0] in BENCHES and {"-h", "--help"} & set(argv[1:]):
        from moerl.bench import options

        if argv[0] in options.OPTIONS:  # the options without the benchmark's module (which imports torch)
            options.parser(argv[0]).parse_args(argv[1:])  # prints the help and exits 0
    if not argv or argv[0] not in BENCHES:
        print(f"usage: moerl bench {{{','.join(BENCHES)}}} [options]\n\nbenchmarks (see BENCHMARKS.md): "
              f"{', '.join(BENCHES)}; `moerl bench NAME --help` lists each one's options",
              file=sys.stdout if argv[:1] in (["-h"], ["--help"]) else sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    return importlib.import_module(BENCHES[argv[0]]).main(argv[1:]) or 0


def _config(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="moerl config", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="moerl config CONFIG.toml [--section.key=value ...] | moerl config --reference [--out FILE]",
        description=textwrap.fill("Print the resolved config (defaults < file < overrides) as TOML, after its "
                                  "checks: every key's type and value, the task's options against the task's "
                                  "own option class, the model directory's headers, and the task's data and "
                                  "tokenizer with its first prompt (exit 2 with one line naming a problem). "
                                  "--reference: every key's type, default and description as Markdown (what "
                                  "docs/config.md holds).", 112),
        epilog=config_sections())
    parser.add_argument("config", nargs="?", help="TOML config (e.g. configs/demo.toml)")
    parser.add_argument("--reference", action="store_true", help="print the configuration reference (Markdown)")
    parser.add_argument("--out", metavar="FILE", help="with --reference: write it to FILE (docs/config.md)")
    args, extra = parser.parse_known_args(argv)
    if args.reference:
        from moerl.config import MoerlConfig
        from moerl.config_docs import reference_markdown

        text = reference_markdown(MoerlConfig)
        if args.out:
            from pathlib import Path

            Path(args.out).write_text(text)
            print(f"wrote {args.out}")
        else:
            print(text, end="")
        return 0
    if args.config is None:
        parser.error("the following arguments are required: config (or --reference)")
    from moerl.config import ConfigError, MoerlConfig, config_from_dict, config_to_dict, dump_toml, load_config
    from moerl.redact import redact, redact_config

    try:
        cfg = load_config(args.config, config_overrides(parser, extra))
    except ConfigError as e:
        print(f"error: {redact(str(e))}", file=sys.stderr)
        return 2
    from moerl.tasks.base import TaskError, task_config

    try:  # imports the task's module (a config is trusted: it names code that every node imports)
        task_config(cfg.task.name, dict(cfg.task.options), seed=cfg.run.seed)
    except TaskError as e:
        print(f"error: config key 'task.options' (or 'task.name'): {redact(str(e))}", file=sys.stderr)
        return 2
    from moerl import preflight

    try:  # the inputs `moerl train` reads before Ray starts: the model's headers, the task's data and tokenizer
        if cfg.model.path:
            preflight.check_model(cfg.model.path)
        preflight.check_task(cfg)
    except Exception as e:  # noqa: BLE001 - PreflightError, TaskError, a reader's error: one line
        print(f"error: {redact(preflight.one_line(e))}", file=sys.stderr)
        return 2
    plain = config_to_dict(cfg)
    shown = redact_config(plain)  # credentials in a URL, values of secret keys: never printed
    if shown != plain:
        print("# values that look like credentials are shown as ***")
    print(dump_toml(config_from_dict(shown, MoerlConfig, validate=False)), end="")
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
    parser.add_argument("--force", action="store_true", help="write into OUT_DIR even if it is not empty "
                        "(files of the same names are replaced)")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="S", help="deadline of each storage call in "
                        "seconds, as a run's checkpoint.storage_timeout_s (default: 60)")
    args = parser.parse_args(argv)
    from pathlib import Path

    out_dir = Path(args.out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not args.force:
        what = "is not empty" if out_dir.is_dir() else "is a file"
        print(f"error: {args.out_dir} {what}: choose another OUT_DIR, or --force to write into it", file=sys.stderr)
        return 2
    from moerl.checkpoint import CheckpointError, CheckpointStore, export_policy, export_step

    try:  # every storage call within --timeout; a line per stage, so a slow store is seen to be working
        store = CheckpointStore(args.checkpoint_dir, args.timeout)
        step = export_step(store, args.step)
        print(f"export: step {step}, " + ("the newest committed step" if args.step is None else "as asked")
              + f" under {args.checkpoint_dir}", flush=True)
        for warning in _export_warnings(store, step):
            print(f"warning: {warning}", file=sys.stderr, flush=True)
        out = export_policy(args.checkpoint_dir, args.out_dir, step, dtype=args.dtype, source=args.source,
                            timeout_s=args.timeout, progress=lambda text: print(f"export: {text}", flush=True),
                            warn=lambda text: print(f"warning: {text}", file=sys.stderr, flush=True))
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported step {step} to {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")
    return 0


def _export_warnings(store, step: int) -> list[str]:
    """Why `step` may not be the policy the run ended with (a run that reached step 600 exported step 168
    without a word): newer steps whose save did not finish, and a run directory (the checkpoints' parent, the
    default layout) that logged later steps."""
    from pathlib import Path

    from moerl.preflight import last_logged_step

    out = []
    newer = [s for s in store.step_dirs() if s > step]
    committed = [s for s in store.committed_steps() if s > step] if newer else []
    if committed:  # --step of an older step: the newer ones are committed, not "never committed"
        out.append(f"step {step} is not the newest committed step under {store.root}: step {committed[-1]} is "
                   "(export it without --step)")
    unfinished = [s for s in newer if s not in committed]
    if unfinished and unfinished[-1] > max(committed, default=step):
        out.append(f"step {unfinished[-1]} under {store.root} is newer than step {max(committed, default=step)}, but "
                   "its save did not finish (it was never committed)")
    if "://" not in store.root:
        run_dir = Path(store.root).parent
        last = last_logged_step(run_dir)
        if last > step:
            out.append(f"step {step} is not the run's last: it logged steps up to {last} in "
                       f"{run_dir / 'metrics.jsonl'}, after its newest checkpoint")
    return out


def _train(argv: list[str]) -> int:
    parse_train_args(argv)  # --help and argument errors answer here, before torch and Ray load
    from moerl.train_cli import main as train_main

    return train_main(argv)


COMMANDS = {"bench": _bench, "config": _config, "export": _export, "launch": _launch, "train": _train}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--version"]:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"moerl {version('moerl')}")
        except PackageNotFoundError:  # run from a source tree that was never installed
            print("moerl (not installed: version unknown)")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser = argparse.ArgumentParser(
            prog="moerl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog=textwrap.fill(f"benchmarks (moerl bench NAME): {', '.join(BENCHES)}", 112))
        parser.add_argument("command", choices=sorted(COMMANDS))
        parser.print_help()
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except KeyboardInterrupt:  # `moerl train` handles its own; the other commands stop here, without a traceback
        print(f"moerl {argv[0]}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
