"""Run artefacts: the reward-curve PNG and the markdown report."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tandem.orchestrator.artifacts.metrics import read_metrics


def _smooth(values: Sequence[float], window: int) -> list[float]:
    out, acc = [], []
    for v in values:
        acc.append(v)
        if len(acc) > window:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def plot_rewards(
    metrics_path: str | Path,
    out_png: str | Path,
    *,
    baseline: float | None = None,
    final: float | None = None,
) -> Path:
    """Training reward and pass rate per step (with a moving average), plus held-out marks."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    steps = [r["step"] for r in records]
    reward = [r.get("reward") or 0.0 for r in records]
    passed = [r.get("pass_rate") or 0.0 for r in records]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, reward, alpha=0.3, color="tab:blue")
    ax.plot(steps, _smooth(reward, 5), color="tab:blue", label="train reward (5-step mean)")
    ax.plot(steps, _smooth(passed, 5), color="tab:green", label="train pass rate (5-step mean)")
    if baseline is not None:
        ax.axhline(
            baseline, color="gray", ls="--", label=f"held-out pass@1 before RL ({baseline:.2f})"
        )
    if final is not None:
        ax.axhline(final, color="tab:red", ls="--", label=f"held-out pass@1 after RL ({final:.2f})")
    ax.set_xlabel("RL step")
    ax.set_ylabel("reward / pass rate")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out_png)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def markdown_table(
    rows: Sequence[Sequence[str]], header: Sequence[str] = ("metric", "value")
) -> str:
    """A markdown table; the first column is padded to one width so the source reads too."""
    width = max(len(r[0]) for r in [header, *rows])

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join([f"{cells[0]:<{width}}", *cells[1:]]) + " |"

    rule = f"|{'-' * (width + 2)}|" + "".join(f"{'-' * (len(h) + 2)}|" for h in header[1:])
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def write_report(
    path: str | Path,
    *,
    title: str,
    rows: Sequence[tuple[str, str]],
    sections: Mapping[str, str] | None = None,
    config_toml: str | None = None,
    image: str | None = None,
) -> Path:
    """A markdown report: the summary table, free sections, the curve and the config."""
    parts = [f"# {title}", "", markdown_table(rows), ""]
    if image:
        parts += [f"![reward curve]({image})", ""]
    for head, body in (sections or {}).items():
        parts += [f"## {head}", "", body, ""]
    if config_toml:
        parts += ["## Resolved config", "", "```toml", config_toml.rstrip(), "```", ""]
    out = Path(path)
    out.write_text("\n".join(parts))
    return out


def fmt(value: Any, spec: str = ".3f") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)
