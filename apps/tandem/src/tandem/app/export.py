"""`tandem export --run DIR --out DIR`: a run's trained policy as a Hugging Face directory.

The stages already save their policies in that layout (``midtrained/``, ``rl_trained/``:
config.json, safetensors, the checkpoint's tokenizer files, and ``tandem.json``); this copies
the newest of a run (RL's if there is one) to a directory of its own, loaded and saved again
so the copy is checked to load and holds nothing else.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

STAGE_DIRS = ("rl_trained", "midtrained")
"""A run's policy directories, newest stage first."""


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "export",
        help="write a run's trained policy as a Hugging Face model directory",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    p.add_argument(
        "--run",
        required=True,
        help="the run's directory (run.output_dir/run.name), or a policy directory itself",
    )
    p.add_argument("--out", required=True, help="the directory to write (created if absent)")


def policy_of(run: Path) -> Path:
    """The policy directory of ``run``: itself if it holds config.json, else its newest
    stage's; raises FileNotFoundError naming what was looked for."""
    if (run / "config.json").is_file():
        return run
    for name in STAGE_DIRS:
        if (run / name / "config.json").is_file():
            return run / name
    looked = " or ".join(f"{name}/config.json" for name in STAGE_DIRS)
    raise FileNotFoundError(f"{run}: no trained policy ({looked}); run `tandem midtrain` first")


def run_export(args: argparse.Namespace) -> int:
    from tandem.orchestrator import PolicyError, load_policy, save_policy

    try:
        source = policy_of(Path(args.run))
    except FileNotFoundError as e:
        print(f"tandem export: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.resolve() == source.resolve():
        print(f"tandem export: --out is the policy directory itself ({source})", file=sys.stderr)
        return 2
    try:
        model = load_policy(source)
    except (PolicyError, ValueError) as e:
        print(f"tandem export: {source}: {e}", file=sys.stderr)
        return 2
    save_policy(model, out, stage="export", source=str(source))
    print(f"exported {source} to {out}")
    return 0
