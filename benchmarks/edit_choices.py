"""Where a policy's edits land, per task category: the file's buggy text, or a recalled fix.

A demo episode reads the file, then sends one `edit` whose old text must be in it. This
plays held-out tasks (the demo's evaluation seed and sampling) with one or more policies
and sorts each episode's first edit:

- ``bug``: its old text lies inside the task's buggy line (copied from the file);
- ``sibling``: not in the file, but the bug text of another bug kind of the same function
  (a fix recalled from mid-training, made for another task);
- ``elsewhere``: in the file, outside the buggy line;
- ``unknown``: in neither; ``none``: no edit was sent.

A policy that reads the file sends ``bug`` edits in every category; one that recalls a
function's fixes sends the same sibling text whatever the file holds, and its pass rates of
a function's bug kinds add up to about one (docs/experiments.md).

    uv run python benchmarks/edit_choices.py runs/demo/midtrained runs/demo/rl_trained \\
        [-c configs/demo.toml] [--tasks 360] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path
from typing import Any

from tandem.agent_env import Task
from tandem.app.config import load_config
from tandem.app.pipeline_config import PipelineConfig
from tandem.orchestrator import load_policy
from tandem.orchestrator.eval.replicas import play_here
from tandem.orchestrator.rollout.tasks import TaskSource, task_category

KINDS = ("bug", "sibling", "elsewhere", "unknown", "none")


def first_edit(messages: list[dict[str, Any]]) -> str | None:
    """The old text of the episode's first `edit` call ('' if its arguments do not parse)."""
    for m in messages:
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call)
            if fn.get("name") == "edit":
                try:
                    return str(json.loads(fn.get("arguments") or "{}").get("old_string", ""))
                except json.JSONDecodeError:
                    return ""
    return None


def bug_texts(tasks: list[Task]) -> dict[str, set[str]]:
    """Function -> the buggy lines of its tasks (each bug kind's text, as the files hold it)."""
    out: dict[str, set[str]] = collections.defaultdict(set)
    for t in tasks:
        for e in t.reference_edits:
            out[t.metadata.get("function", "")].add(e.old.strip())
    return out


def classify(task: Task, old: str | None, siblings: set[str]) -> str:
    if old is None:
        return "none"
    edit = task.reference_edits[0]
    text = task.files.get(edit.path, "")
    at, bug = text.find(old) if old else -1, text.find(edit.old)
    if at >= 0:
        return "bug" if bug <= at < bug + len(edit.old) else "elsewhere"
    if old and any(old.strip() in s for s in siblings if s != edit.old.strip()):
        return "sibling"
    return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("policies", nargs="+", type=Path)
    ap.add_argument("-c", "--config", default="configs/demo.toml")
    ap.add_argument("--tasks", type=int, default=360)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    args = ap.parse_args()
    config = load_config(PipelineConfig, args.config, args.sets)
    tasks = TaskSource(config.tasks, config.tasks.eval_seed).take(0, args.tasks)
    siblings = bug_texts(tasks)
    for path in args.policies:
        samples = play_here(load_policy(path), config, tasks, list(range(len(tasks))), samples=1)
        table: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        for task, (sample,) in zip(tasks, samples, strict=True):
            fn = task.metadata.get("function", "")
            row = table[task_category(task)]
            row[classify(task, first_edit(sample.messages), siblings[fn])] += 1
            row["solved"] += int(sample.resolved)
            row["episodes"] += 1
        print(f"\n{path}: first edit of each episode ({args.tasks} held-out tasks x 1)")
        print(f"| category | episodes | solved | {' | '.join(KINDS)} |")
        print("|---" * (3 + len(KINDS)) + "|")
        for category, row in sorted(table.items()):
            cells = [str(row[k]) for k in ("episodes", "solved", *KINDS)]
            print(f"| {category} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
