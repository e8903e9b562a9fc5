"""The vLLM servers a run uses: those given by URL, or one tandem starts for the policy.

`check_servable` refuses, before any start, what vLLM would mis-serve or cannot serve:
a shared expert (vLLM's Qwen3-MoE expects a sigmoid shared-expert gate that tandem's layout
lacks, and loads the checkpoint without complaint while being wrong by up to 7 nats) and,
on the CPU, head sizes its attention kernels lack.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from tandem.moe_determinism.model.config import MoEConfig
from tandem.orchestrator.config_checks import ConfigValueError
from tandem.orchestrator.inference.engine_config import EngineConfig
from tandem.orchestrator.inference.vllm.environment import vllm_python
from tandem.orchestrator.inference.vllm.server import VllmServer

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes of vLLM's CPU attention (``CPUAttentionBackend.get_supported_head_sizes``)."""


def check_servable(model: MoEConfig, *, cuda: bool) -> None:
    """Raise `ConfigValueError` when vLLM would serve ``model`` wrongly or not at all."""
    if model.shared_expert_intermediate_size:
        raise ConfigValueError(
            "engine.kind = 'vllm': the model has a shared expert "
            f"(shared_expert_intermediate_size = {model.shared_expert_intermediate_size}); "
            "vLLM's Qwen3-MoE gates it with a sigmoid gate this layout does not have and "
            "would serve wrong log-probs. Use the embedded engine for it."
        )
    if not cuda and model.head_dim not in CPU_HEAD_SIZES:
        raise ConfigValueError(
            f"engine.kind = 'vllm': head_dim {model.head_dim} is not one vLLM's CPU attention "
            f"supports ({', '.join(map(str, CPU_HEAD_SIZES))}); set model.head_dim to one "
            "of them, or use the embedded engine."
        )


@contextlib.contextmanager
def vllm_urls(
    policy_dir: Path, model: MoEConfig, engine: EngineConfig, *, log_dir: Path, seed: int
) -> Iterator[list[str]]:
    """The URLs of the servers to play on: ``engine.vllm.urls`` as given, or a server
    started here on ``policy_dir`` (a Hugging Face directory) for the block's duration."""
    if engine.vllm.urls:
        yield list(engine.vllm.urls)
        return
    cuda = torch.cuda.is_available()
    check_servable(model, cuda=cuda)
    cfg = engine.vllm
    python = Path(cfg.python) if cfg.python else vllm_python(cfg.package, cuda=cuda)
    if not python.exists():
        raise ConfigValueError(f"engine.vllm.python: {python} does not exist")
    server = VllmServer.start(
        python, policy_dir, engine, log_path=log_dir / "vllm-server.log", seed=seed, cuda=cuda
    )
    try:
        yield [server.url]
    finally:
        server.close()
