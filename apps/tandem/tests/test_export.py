"""`tandem export`: a run's policy written as a Hugging Face directory that transformers loads
with the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rl_helpers import TINY

from tandem.app.cli import main
from tandem.orchestrator.inference.tokenizer import ByteTokenizer
from tandem.orchestrator.policy import build_model, save_policy


def test_export_writes_the_newest_stage_loadable_by_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    run = tmp_path / "runs" / "demo"
    save_policy(build_model(TINY, ByteTokenizer(), seed=1), run / "midtrained", stage="midtrain")
    trained = build_model(TINY, ByteTokenizer(), seed=2)
    save_policy(trained, run / "rl_trained", stage="rl")
    out = tmp_path / "exported"
    assert main(["export", "--run", str(run), "--out", str(out)]) == 0
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert torch.equal(back.lm_head.weight, trained.lm_head.weight)  # RL's, not mid-training's
    ids = torch.randint(0, 266, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = trained(ids).logits, back(ids).logits
    assert float((ours.log_softmax(-1) - theirs.log_softmax(-1)).abs().max()) <= 1e-5


def test_export_of_a_run_without_a_policy_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["export", "--run", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tandem export: ") and "midtrained/config.json" in err
    assert "\n" not in err
