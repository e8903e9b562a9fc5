"""The losses need torch alone: accelerate is the ``trainer`` extra, used only by `GRPOStep`.

A fresh interpreter whose import system refuses ``accelerate`` stands in for an install of
``tandem-grpo`` without the extra.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"

WITHOUT_ACCELERATE = textwrap.dedent(
    """
    import sys


    class BlockAccelerate:
        def find_spec(self, name, path=None, target=None):
            if name == "accelerate" or name.startswith("accelerate."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None


    sys.meta_path.insert(0, BlockAccelerate())

    import torch

    import tandem.grpo
    from tandem.grpo import (
        GRPOConfig,
        group_advantages,
        importance_weights,
        kl_estimate,
        policy_loss,
    )

    config = GRPOConfig(kl_coef=0.1, kl_estimator="k3")
    logp = torch.tensor([[0.0, -1.0, -0.5]], requires_grad=True)
    old = logp.detach() - 0.1
    mask = torch.tensor([[False, True, True]])
    adv = group_advantages(torch.tensor([1.0, 0.0]), group_size=2)[:1]
    weights, _ = importance_weights(logp.detach(), old, mask, "token_tis", 2.0)
    kl = kl_estimate(logp, old, mask, "k3")
    loss, _ = policy_loss(
        logp, old, adv, mask, config=config, ref_logprobs=old, is_weights=weights
    )
    loss.backward()
    assert torch.isfinite(loss) and logp.grad is not None and torch.isfinite(kl).all()

    import tandem.grpo.trainer  # the module imports; only building a step needs accelerate

    assert not any(m == "accelerate" or m.startswith("accelerate.") for m in sys.modules)
    model = torch.nn.Linear(2, 2)
    try:
        tandem.grpo.GRPOStep(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    except tandem.grpo.GRPOError as e:
        print("ERROR:", e)
    else:
        raise SystemExit("GRPOStep was built without accelerate")
    """
)


def test_losses_import_and_run_without_accelerate_and_the_step_names_the_extra() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_ACCELERATE],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    error = proc.stdout.strip().splitlines()[-1]
    assert error.startswith("ERROR: GRPOStep needs accelerate")
    assert 'pip install "tandem-grpo[trainer]"' in error


def test_accelerate_is_the_trainer_extra_only() -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("accelerate")]
    assert [d for d in project["optional-dependencies"]["trainer"] if d.startswith("accelerate")]
