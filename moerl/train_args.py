"""The arguments of `moerl train`, and what `moerl config` shares with them: the config sections listed in --help
and the --section.key=value overrides. Standard library only (the config's classes are read for --help alone):
cli.py parses `moerl train`'s arguments here to answer --help and argument errors before torch or Ray loads, and
train_cli.py parses them again to run.
"""

from __future__ import annotations

import argparse
import textwrap

EXIT_CODES = ("exit status: 0 the run finished; 1 it failed (the error line says how to resume); 2 a bad config "
              "or input, found before anything started; 130 / 143 stopped by Ctrl-C / SIGTERM after saving a "
              "checkpoint (the last line says how to resume)")


def config_sections() -> str:
    """Every config key with its default and description (moerl/config_docs.py: the fields' docstrings), for --help."""
    from moerl.config import MoerlConfig
    from moerl.config_docs import help_text

    return help_text(MoerlConfig)


def config_overrides(parser: argparse.ArgumentParser, extra: list[str]) -> list[str]:
    """The arguments parse_known_args left over, which must all be --section.key=value (else parser.error)."""
    bad = [a for a in extra if not (a.startswith("--") and "." in a.partition("=")[0])]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)} (config overrides are --section.key=value)")
    return extra


def train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moerl train", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="moerl train CONFIG.toml [--resume | --resume-step N] [--resume-override KEY ...] "
              "[--section.key=value ...]",
        description=textwrap.fill(
            "Run the asynchronous RL job of CONFIG (a local Ray unless ray.address is set). Inputs are checked "
            "before Ray starts; a run directory that holds a run is never overwritten (--resume continues it). "
            "SIGTERM or Ctrl-C saves a checkpoint and stops; a second Ctrl-C aborts.", 112),
        epilog=config_sections() + "\n\n" + textwrap.fill(EXIT_CODES, 112))
    parser.add_argument("config", help="TOML config (e.g. configs/demo.toml)")
    which = parser.add_mutually_exclusive_group()  # usage says so: --resume-step names the step --resume would pick
    which.add_argument("--resume", action="store_true", help="continue from the newest committed checkpoint")
    which.add_argument("--resume-step", type=int, metavar="N", help="continue from committed checkpoint step N")
    parser.add_argument("--resume-override", action="append", default=[], metavar="KEY",
                        help="with --resume: accept a changed config KEY (or section) that changes the experiment "
                        "(model, task, group size, loss, optimizer, ...); repeatable")
    parser.add_argument("--resume-if-saved", action="store_true",
                        help="continue from the newest committed checkpoint when there is one, else start the run "
                        "(what a restarted job wants: `moerl launch`'s trainer passes it)")
    return parser


def parse_train_args(argv: list[str]) -> argparse.Namespace:
    """`moerl train`'s arguments: config, resume, resume_step and the --section.key=value overrides."""
    parser = train_parser()
    args, extra = parser.parse_known_args(argv)
    args.overrides = config_overrides(parser, extra)
    if args.resume_override and not (args.resume or args.resume_step is not None or args.resume_if_saved):
        parser.error("--resume-override applies to a resumed run only: add --resume (or --resume-step N)")
    return args
