"""Loaded inside the tests' vLLM server (its directory is on the server's PYTHONPATH, and
nothing else of the tests is): tandem's worker extension plus a pace, so that a test can
slow every engine step down on demand.

A test that must act while a turn decodes (pause the server after its first tokens, then
update the weights) would otherwise race the server's remaining steps: on a loaded
machine the client can be starved for the seconds a whole turn takes. A paced step sleeps
before it runs, leaving the CPU to the client; the sampled tokens do not change.
"""

from __future__ import annotations

import time
from typing import Any

from tandem.vllm_plugin import DeltaSyncExtension


class PacedDeltaSyncExtension(DeltaSyncExtension):
    """`DeltaSyncExtension` with ``tandem_pace``."""

    def tandem_pace(self, seconds: str) -> dict[str, Any]:
        """Sleep ``seconds`` before each engine step from now on (0: no more)."""
        runner = self.model_runner  # type: ignore[attr-defined]
        unpaced = runner.__dict__.get("_tandem_unpaced") or runner.execute_model
        runner._tandem_unpaced = unpaced
        delay = float(seconds)
        if delay <= 0:
            runner.execute_model = unpaced
        else:

            def paced(*args: Any, **kwargs: Any) -> Any:
                time.sleep(delay)
                return unpaced(*args, **kwargs)

            runner.execute_model = paced
        return {"pace_s": delay}
