"""The long-horizon comparison's config and table (the comparison itself is a benchmark run:
`uv run tandem demo -c configs/long.toml`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.agent_env import generate_multibug_tasks
from tandem.app.compare import compare_table, variant_config
from tandem.app.config import load_config
from tandem.app.errors import ConfigError
from tandem.app.pipeline_config import PipelineConfig
from tandem.orchestrator.inference.chat_format import ChatFormat
from tandem.orchestrator.midtrain.transcripts import oracle_transcripts
from tandem.orchestrator.rollout.compaction import check_prompts

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def test_the_long_config_compares_four_variants_on_long_tasks() -> None:
    cfg = load_config(PipelineConfig, CONFIGS / "long.toml")
    assert cfg.tasks.family == "multibug" and cfg.env.partial_credit
    assert cfg.demo.compare.variants == ["none", "sliding", "prompted", "trained"]
    assert cfg.demo.compare.seeds >= 3
    modes = {
        v: (c.episode.compaction.mode, c.episode.compaction.train_summary, c.run.seed)
        for v in cfg.demo.compare.variants
        for c in [variant_config(cfg, v, 7)]
    }
    assert modes == {
        "none": ("none", False, 7),
        "sliding": ("sliding", False, 7),
        "prompted": ("summary", False, 7),
        "trained": ("summary", True, 7),
    }
    # every held-out task's prompt fits before the trigger, and the oracle's whole episode
    # does not fit the window (what the variants differ on)
    t = cfg.tasks
    tasks = generate_multibug_tasks(
        t.eval_seed, 8, modules=t.repo_modules, buggy=t.buggy_modules,
        functions_per_module=t.functions_per_repo, kinds=t.kinds,
        hidden_per_function=t.hidden_per_function,
    )  # fmt: skip
    chat = ChatFormat()
    check_prompts(chat, tasks, cfg.env, cfg.engine.max_len, cfg.episode.compaction)
    whole = oracle_transcripts(
        tasks[:2], cfg.env, chat, max_observation_chars=cfg.episode.max_observation_chars,
        max_turns=cfg.env.max_turns,
    )  # fmt: skip
    assert len(whole) == 2 and all(len(ids) > cfg.engine.max_len for ids, _ in whole)


def test_unknown_variants_are_one_line() -> None:
    with pytest.raises(ConfigError, match=r"demo\.compare: variants: unknown \['best'\]"):
        load_config(PipelineConfig, CONFIGS / "long.toml", ['demo.compare.variants=["best"]'])


def test_the_table_gives_each_run_its_lift_and_compaction_figures() -> None:
    row = {
        "variant": "trained",
        "seed": 1,
        "before": 0.10,
        "after": 0.25,
        "lift": 0.15,
        "low": 0.05,
        "high": 0.25,
        "reward_before": 0.25,
        "reward_after": 0.5,
        "turns": 11.5,
        "compaction": {
            "compactions": 2.0,
            "summary_tokens": 90.0,
            "replaced_tokens": 1600.0,
            "summaries_cut": 0.25,
        },
    }
    plain = {**row, "variant": "none", "compaction": {}}
    text = compare_table([row, plain], 600.0)
    lines = text.splitlines()
    assert lines[2] == (
        "| trained | 1 | 10.0 | 25.0 | +15.0 (+5.0 to +25.0) | 0.250 -> 0.500 | 11.5 | 2.00 "
        "| 90 / 1600 | 0.25 |"
    )
    assert lines[3].startswith("| none | 1 | 10.0 | 25.0 |") and lines[3].endswith(
        "| 0.00 | - | 0.00 |"
    )
    assert "wall time: 10.0 min" in text
