"""The GPU check's one summary file: written as Markdown, read back, and the key figures
taken from each check's output (pytest's closing line, the benchmarks' tables and their
`gpu_check:` lines).

Standard library only, like scripts/gpu_check.py, which runs before any environment exists.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

SUMMARY_FILE = "gpu_check_summary.md"
GOOD = ("pass", "dry-run ok", "not available")
TAIL_LINES = 40
PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)\b")
FIGURE_LINE = "gpu_check: "
VERSIONS_LINE = "gpu_check_versions: "


@dataclass
class Row:
    check: str
    status: str
    seconds: float
    limit_s: int
    figures: str
    what: str = ""
    output: str = ""


@dataclass
class Summary:
    mode: str
    when: str
    seconds: float
    budget_s: int
    gpu: str
    versions: str
    rows: list[Row]

    @property
    def ok(self) -> bool:
        return all(r.status in GOOD for r in self.rows)

    @property
    def verdict(self) -> str:
        if not self.ok:
            return "FAIL"
        return "DRY RUN OK" if self.mode.startswith("dry") else "PASS"

    def render(self) -> str:
        lines = [
            f"# tandem GPU check: {self.verdict}",
            "",
            f"- mode: {self.mode}",
            f"- when: {self.when}; {self.seconds:.0f} s of a {self.budget_s} s budget",
            f"- gpu: {self.gpu}",
            f"- versions: {self.versions}",
            "",
            "| check | result | seconds | limit s | figures |",
            "|---|---|---:|---:|---|",
        ]
        for r in self.rows:
            figures = r.figures.replace("|", "/").replace("\n", " ")
            lines.append(f"| {r.check} | {r.status} | {r.seconds:.1f} | {r.limit_s} | {figures} |")
        lines += ["", "What each check proves:", ""]
        lines += [f"- {r.check}: {r.what}" for r in self.rows]
        failed = [r for r in self.rows if r.status not in GOOD and r.output]
        if failed:
            lines += ["", "## Output of the checks that did not pass (last lines)"]
            for r in failed:
                tail = "\n".join(r.output.rstrip().splitlines()[-TAIL_LINES:])
                lines += ["", f"### {r.check}: {r.status}", "", "```", tail, "```"]
        return "\n".join(lines) + "\n"


def read(text: str) -> Summary:
    """The summary a file holds (what someone quoting it reads); ValueError if malformed."""
    head = re.search(r"^# tandem GPU check: (.+)$", text, re.M)
    fields = dict(re.findall(r"^- (mode|when|gpu|versions): (.*)$", text, re.M))
    if head is None or len(fields) != 4:
        raise ValueError("not a tandem GPU check summary (no title or header fields)")
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or not line.startswith("| ") or cells[0] == "check":
            continue
        rows.append(Row(cells[0], cells[1], float(cells[2]), int(cells[3]), cells[4]))
    seconds, budget = re.match(r".*; (\d+) s of a (\d+) s budget", fields["when"]).groups()
    summary = Summary(
        fields["mode"], fields["when"].split(";")[0], float(seconds), int(budget),
        fields["gpu"], fields["versions"], rows,
    )  # fmt: skip
    if summary.verdict != head.group(1):
        raise ValueError(f"the title says {head.group(1)} but the rows say {summary.verdict}")
    return summary


def collected(output: str) -> list[str]:
    """Test ids that ``pytest --collect-only -q`` listed."""
    return [line for line in output.splitlines() if "::" in line and not line[:1].isspace()]


def _pytest_figures(output: str) -> str:
    counts = [m for line in output.splitlines()[-5:] for m in PYTEST_COUNT.findall(line)]
    text = ", ".join(f"{n} {word}" for n, word in counts)
    reasons = [line for line in output.splitlines() if line.startswith("SKIPPED")]
    if reasons:
        text += f"; {reasons[0].split(': ', 1)[-1][:90]}"
    return text


def _determinism_figures(output: str) -> str:
    """Rows of benchmarks/determinism.py --gpu: name, dtype, invariant, stock, triton, ratio."""
    invariant, ratios = [], []
    for line in output.splitlines():
        m = re.match(
            r"^(.+?)\s+(float32|bfloat16)\s+(True|False)?\s+[\d.]+\s+[\d.]+\s+([\d.]+)x$", line
        )
        if m:
            if m.group(3):
                invariant.append(m.group(3) == "True")
            ratios.append((float(m.group(4)), f"{m.group(1).strip()} {m.group(2)}"))
    if not ratios:
        return ""
    worst = max(ratios)
    return (
        f"bitwise invariant {sum(invariant)}/{len(invariant)}; triton/stock time "
        f"{min(ratios)[0]:.2f}x-{worst[0]:.2f}x (slowest: {worst[1]})"
    )


def figures_of(check: str, output: str) -> str:
    """Key figures of a check's output: its `gpu_check:` lines, else what its kind prints."""
    lines = [
        line[len(FIGURE_LINE) :] for line in output.splitlines() if line.startswith(FIGURE_LINE)
    ]
    if lines:
        return "; ".join(lines)
    if check.startswith("tests:"):
        return _pytest_figures(output)
    if check == "bench:determinism":
        return _determinism_figures(output)
    return ""


def versions_line(output: str) -> str:
    """The probe's versions (a JSON line in the env step's output) as one line."""
    for line in reversed(output.splitlines()):
        if line.startswith(VERSIONS_LINE):
            found = json.loads(line[len(VERSIONS_LINE) :])
            return ", ".join(f"{k} {v}" for k, v in found.items())
    return "unknown (the env step printed none)"
