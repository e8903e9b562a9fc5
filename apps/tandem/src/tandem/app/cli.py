"""`tandem` command line.

Every run subcommand shares the same config options: ``-c FILE`` (TOML), any number of
``--set key.path=value`` overrides, and ``--dump-config`` to print the resolved config and
exit. Subcommands register themselves in `COMMANDS`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.resources import files

import structlog

from tandem.app import __version__, commands, export, import_gguf, workers
from tandem.app.config import dump_config, load_config
from tandem.app.errors import ConfigError
from tandem.app.logging import configure_logging
from tandem.app.pipeline_config import PipelineConfig


@dataclass(frozen=True)
class Command:
    """A subcommand: its help line, the config type it reads and the function that runs it."""

    help: str
    run: Callable[[PipelineConfig, argparse.Namespace], int]
    default_config: str | None = None


def _packaged_config(name: str) -> str:
    """A config shipped inside this package (the demo's), so that a wheel-installed
    `tandem demo` runs the same run as a checkout (where ``configs/`` links to it)."""
    return str(files("tandem.app").joinpath(name))


def _check(config: PipelineConfig, args: argparse.Namespace) -> int:
    """Validate a config and report it as loaded; exits non-zero on a bad config before this."""
    log = structlog.get_logger("tandem")
    log.info("config ok", source=args.config or "defaults", run=config.run.name)
    print(dump_config(config), end="")
    return 0


COMMANDS: dict[str, Command] = {
    "config": Command(
        help="validate a config file (with overrides) and print every setting, resolved",
        run=_check,
    ),
    "demo": Command(
        help="mid-train a tiny MoE on code, then asynchronous GRPO on coding tasks; "
        "prints held-out pass@1 before/after",
        run=commands.run_demo,
        default_config=_packaged_config("demo.toml"),
    ),
    "midtrain": Command(
        help="next-token training on standard-library code and oracle agent transcripts",
        run=commands.run_midtrain,
    ),
    "train": Command(
        help="RL (async or sync GRPO) from a saved policy (default: the run's midtrained/)",
        run=commands.run_train,
    ),
    "eval": Command(
        help="pass@k of a saved policy on held-out generated tasks",
        run=commands.run_eval,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Asynchronous distributed RL for Mixture-of-Experts coding agents.",
    )
    parser.add_argument("--version", action="version", version=f"tandem {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        p.add_argument(
            "-c",
            "--config",
            metavar="FILE",
            default=cmd.default_config,
            help="TOML config file"
            + (f" (default: {cmd.default_config})" if cmd.default_config else ""),
        )
        p.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config value by dotted key, e.g. --set run.seed=3 (repeatable)",
        )
        p.add_argument(
            "--dump-config", action="store_true", help="print the resolved config as TOML and exit"
        )
        if name == "train":
            p.add_argument(
                "--address",
                help="run on this Ray cluster (auto, HOST:PORT): sets rl.backend=ray and "
                "rl.ray.address",
            )
    workers.add_parser(sub)
    export.add_parser(sub)
    import_gguf.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "workers":
        return workers.run_workers(args)
    if args.command == "export":
        return export.run_export(args)
    if args.command == "import-gguf":
        return import_gguf.run_import(args)
    cmd = COMMANDS[args.command]
    if getattr(args, "address", None):
        args.overrides += ["rl.backend=ray", f"rl.ray.address={args.address}"]
    try:
        config = load_config(PipelineConfig, args.config, args.overrides)
    except ConfigError as e:
        print(f"tandem {args.command}: {e}", file=sys.stderr)
        return 2
    if args.dump_config:
        print(dump_config(config), end="")
        return 0
    configure_logging(config.logging.level, config.logging.format)
    from tandem.orchestrator import ConfigValueError, VllmError, reuse_freed_memory

    reuse_freed_memory()  # the trainer's large temporaries stay mapped between micro-batches

    try:
        return cmd.run(config, args)
    except ConfigValueError as e:  # a combination of values found unworkable once running
        print(f"tandem {args.command}: {e}", file=sys.stderr)
        return 2
    except VllmError as e:  # vLLM's environment or server could not be set up
        print(f"tandem {args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
