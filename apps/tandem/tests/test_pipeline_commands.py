"""The pipeline commands: the demo config loads, bad values fail at start with their key."""

from __future__ import annotations

import tomllib
from pathlib import Path

from tandem.app.cli import COMMANDS, main

DEMO = Path(__file__).resolve().parents[3] / "configs" / "demo.toml"


def test_demo_reads_configs_demo_toml_by_default(capsys) -> None:
    # the config ships inside the app (a wheel install runs the same demo); configs/ links to it
    assert Path(COMMANDS["demo"].default_config or "").resolve() == DEMO.resolve()
    assert main(["demo", "--dump-config"]) == 0
    resolved = tomllib.loads(capsys.readouterr().out)
    on_disk = tomllib.loads(DEMO.read_text())
    assert resolved["model"]["hidden_size"] == on_disk["model"]["hidden_size"]
    assert resolved["rl"]["mode"] == "async"
    assert resolved["tasks"]["eval_seed"] != resolved["tasks"]["train_seed"]


def test_out_of_range_value_names_its_key(capsys) -> None:
    assert main(["train", "--set", "rl.group_size=1"]) == 2
    err = capsys.readouterr().err
    assert "rl" in err and "group_size" in err and "Traceback" not in err


def test_unknown_section_key_is_rejected(capsys) -> None:
    assert main(["demo", "--set", "trainer.loss.clip=0.3", "--dump-config"]) == 2
    assert "unknown key `trainer.loss.clip`" in capsys.readouterr().err


def test_eval_without_a_policy_says_what_to_do(tmp_path, capsys) -> None:
    code = main(["eval", "--set", f"run.output_dir={tmp_path}", "--set", "logging.level=error"])
    assert code == 2
    assert "tandem midtrain" in capsys.readouterr().err


def test_midtrain_without_usable_transcripts_names_the_keys(tmp_path, capsys) -> None:
    # one turn is too few for the oracle's read-then-edit transcripts
    code = main(
        [
            "midtrain",
            "--set", f"run.output_dir={tmp_path}",
            "--set", "logging.level=error",
            "--set", "env.max_turns=1",
            "--set", "midtrain.transcripts=2",
            "--set", "midtrain.code_bytes=20000",
            "--set", 'tasks.functions=["gcd"]',
        ]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2, err
    assert "midtrain.transcript_fraction" in err and "env.max_turns = 1" in err
    assert "Traceback" not in err


def test_eval_prints_pass_at_1_per_task_category(tmp_path, capsys) -> None:
    from tandem.moe_determinism import MoEConfig
    from tandem.orchestrator import build_model, save_policy
    from tandem.orchestrator.inference.tokenizer import ByteTokenizer

    tiny = MoEConfig(
        vocab_size=266, hidden_size=32, num_hidden_layers=1, head_dim=8, moe_intermediate_size=32
    )
    save_policy(build_model(tiny, ByteTokenizer()), tmp_path / "policy", stage="test")
    code = main(
        [
            "eval",
            "--set", f"policy={tmp_path / 'policy'}",
            "--set", "logging.level=error",
            "--set", 'tasks.functions=["gcd"]',
            "--set", "eval.tasks=3",
            "--set", "eval.samples=1",
            "--set", "engine.max_new_tokens=4",
            "--set", "env.max_turns=1",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "pass@1 = " in out and "(3 tasks of seed" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("  gcd/")]
    assert rows and sum(int(r[-2].lstrip("(")) for r in rows) == 3
