"""The vLLM servers a run uses: those given by URL, or one tandem starts for the policy.

`check_servable` refuses, before any start, what vLLM cannot serve: on the CPU, head sizes
its attention kernels lack, and multi-head latent attention (DeepSeek-V3), whose CPU backend
is a reference one for functional checks: its decode kernel takes only DeepSeek-V3's own
widths (latent 512, rotary 64), and on a model of those widths its log-probs were 1.5e-2 to
2.7e-2 from tandem's and transformers' (which agree within 3e-6), with or without experts.
(A shared expert is served: `save_hf` writes the sigmoid gate vLLM's Qwen3-MoE multiplies
it by so that the gated expert is tandem's, bit for bit.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tandem.moe_determinism.model.config import MoEConfig
from tandem.orchestrator.config_checks import ConfigValueError
from tandem.orchestrator.inference.engine_config import EngineConfig
from tandem.orchestrator.inference.vllm.environment import vllm_python
from tandem.orchestrator.inference.vllm.errors import VllmServerFailed
from tandem.orchestrator.inference.vllm.server import VllmServer

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes of vLLM's CPU attention (``CPUAttentionBackend.get_supported_head_sizes``)."""


def servable_head_dim(head_dim: int, *, cuda: bool) -> int:
    """The smallest head size vLLM serves that is at least ``head_dim`` (on the CPU, its
    attention kernels' sizes; on CUDA any)."""
    if cuda:
        return head_dim
    return min((h for h in CPU_HEAD_SIZES if h >= head_dim), default=head_dim)


def check_servable(model: MoEConfig, *, cuda: bool) -> None:
    """Raise `ConfigValueError` when vLLM would serve ``model`` wrongly or not at all."""
    if not cuda and model.is_mla:
        raise ConfigValueError(
            f"engine.kind = 'vllm': vLLM's CPU build does not serve {model.model_type}'s "
            "multi-head latent attention as tandem computes it (a reference backend for "
            "functional checks, log-probs 1e-2 apart); use the embedded engine, or vLLM on CUDA."
        )
    if not cuda and model.head_dim not in CPU_HEAD_SIZES:
        raise ConfigValueError(
            f"engine.kind = 'vllm': head_dim {model.head_dim} is not one vLLM's CPU attention "
            f"supports ({', '.join(map(str, CPU_HEAD_SIZES))}); set model.head_dim to one "
            "of them, or use the embedded engine."
        )


class VllmServers:
    """The servers a run plays on: ``engine.vllm.urls`` as given (then not restartable:
    tandem cannot bring back a server it did not start), or one started here.

    Every start runs in one thread kept for this object's life: a server is killed with
    the thread that started it (the kernel's parent-death signal follows the starting
    thread), so a restart from a passing worker thread would end with that thread."""

    def __init__(
        self,
        urls: list[str],
        start: Callable[[], VllmServer] | None = None,
    ) -> None:
        self.urls = urls
        self._start = start
        self._server: VllmServer | None = None
        self._launcher: ThreadPoolExecutor | None = None
        if start is not None:
            self._launcher = ThreadPoolExecutor(1, thread_name_prefix="tandem-vllm-launcher")
            try:
                self._server = self._launcher.submit(start).result()
            except BaseException:
                self.close()
                raise
            self.urls = [self._server.url]

    @property
    def server(self) -> VllmServer | None:
        """The server started here (None for servers given by URL)."""
        return self._server

    @property
    def restartable(self) -> bool:
        return self._start is not None

    def restart(self) -> list[str]:
        """A new server in place of the one started here (which failed); its URLs."""
        if self._start is None:
            raise VllmServerFailed(
                "these vLLM servers were given by URL: tandem cannot restart them"
            )
        if self._server is not None:
            self._server.close()
            self._server = None
        assert self._launcher is not None
        self._server = self._launcher.submit(self._start).result()
        self.urls = [self._server.url]
        return self.urls

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._launcher is not None:
            self._launcher.shutdown()
            self._launcher = None


@contextlib.contextmanager
def vllm_servers(
    policy_dir: Path, model: MoEConfig, engine: EngineConfig, *, log_dir: Path, seed: int
) -> Iterator[VllmServers]:
    """The servers to play on: ``engine.vllm.urls`` as given, or a server started here on
    ``policy_dir`` (a Hugging Face directory) for the block's duration."""
    if engine.vllm.urls:
        yield VllmServers(list(engine.vllm.urls))
        return
    cuda = torch.cuda.is_available()
    check_servable(model, cuda=cuda)
    cfg = engine.vllm
    python = Path(cfg.python) if cfg.python else vllm_python(cfg.package, cuda=cuda)
    if not python.exists():
        raise ConfigValueError(f"engine.vllm.python: {python} does not exist")
    servers = VllmServers(
        [],
        lambda: VllmServer.start(
            python, policy_dir, engine, log_path=log_dir / "vllm-server.log", seed=seed, cuda=cuda
        ),
    )
    try:
        yield servers
    finally:
        servers.close()
