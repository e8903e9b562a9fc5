"""A vLLM server that tandem starts on loopback, serving a policy directory.

The server is vLLM's OpenAI-compatible API server (``vllm.entrypoints.launchers.api_server``,
run as a module: the CPU distribution's ``vllm`` script does not start), with the endpoints
an RL engine needs: token ids in and out (``--skip-tokenizer-init``), the token-in/token-out
``/inference/v1/generate`` (``--enable-scale-out``), log-probs of the sampled tokens after
temperature (``--logprobs-mode processed_logprobs``) and the weight-version endpoints
(``VLLM_SERVER_DEV_MODE``). It runs in its own session, killed with its parent (the kernel's
parent-death signal, which follows the *thread* that started it: start servers from a
thread that outlives them, as `VllmServers` does), and `close` ends its process group.

On CUDA two more settings align it with the trainer: ``--enable-return-routed-experts`` for
an MoE policy (every turn reports the experts each token was routed to, which the trainer
replays: R3) and, under ``engine.deterministic``, ``VLLM_BATCH_INVARIANT=1`` (vLLM's
batch-invariant kernels: a sequence's numbers do not depend on what it is batched with).
Neither exists in vLLM's CPU build.

vLLM reports some unservable models only when the first request reaches the model (the CPU
attention kernels' head sizes), after ``/health`` already answers: a start therefore ends
with one short generation, and a failure there is reported with the server's own reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import httpx
import structlog

from tandem.moe_determinism.model.families import EXPERT_COUNT_KEYS
from tandem.orchestrator.inference.engine_config import EngineConfig
from tandem.orchestrator.inference.vllm.errors import VllmServerFailed

log = structlog.get_logger()

PLUGIN = "tandem.vllm_plugin.DeltaSyncExtension"
"""The worker extension that follows the run's weight stream (tandem-vllm-plugin)."""
BATCHED_TOKENS = 8192
"""Tokens per step on the CPU, where a prefill is never split (at least ``max_len``)."""
PROGRESS_S = 15.0
"""How often a start in progress is logged."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _hf_config(model_dir: Path) -> dict[str, object]:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def checkpoint_dtype(model_dir: Path) -> str:
    """The dtype config.json names (vLLM's own "auto" would serve float32 weights in 16 bits)."""
    config = _hf_config(model_dir)
    name = str(config.get("torch_dtype") or config.get("dtype") or "auto")
    return name.removeprefix("torch.")


def has_experts(model_dir: Path) -> bool:
    """Whether the checkpoint is an MoE (vLLM refuses to capture routes of a dense model)."""
    config = _hf_config(model_dir)
    return any(int(str(config.get(k) or 0)) > 0 for k in EXPERT_COUNT_KEYS)


def server_env(engine: EngineConfig, *, cuda: bool) -> dict[str, str]:
    """The server's environment on top of this process's."""
    env = {
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": f"{engine.vllm.kv_cache_gib:g}",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    if cuda and engine.deterministic:
        env["VLLM_BATCH_INVARIANT"] = "1"
    return env


def server_command(
    python: Path, model_dir: Path, engine: EngineConfig, port: int, seed: int, *, cuda: bool
) -> list[str]:
    """The server's command line. On the CPU, prefills are never split across steps: vLLM
    rewinds a seeded request's generator after a partial prefill, which the CPU generator
    cannot do (its engine dies with "CPU Generator does not use offset")."""
    cfg = engine.vllm
    command = [
        str(python), "-m", "vllm.entrypoints.launchers.api_server.entry",
        "--model", str(model_dir),
        "--skip-tokenizer-init",
        "--enable-scale-out",
        "--logprobs-mode", "processed_logprobs",
        "--dtype", checkpoint_dtype(model_dir) if cfg.dtype == "auto" else cfg.dtype,
        "--max-model-len", str(engine.max_len),
        "--max-num-seqs", str(engine.max_slots),
        "--seed", str(seed),
        "--host", "127.0.0.1",
        "--port", str(port),
    ]  # fmt: skip
    command += ["--worker-extension-cls", PLUGIN]
    if cfg.enforce_eager:
        command.append("--enforce-eager")
    if not cuda:
        budget = max(engine.max_len, BATCHED_TOKENS)
        command += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(budget)]
    elif has_experts(model_dir):
        command.append("--enable-return-routed-experts")
    return command + list(cfg.extra_args)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class VllmServer:
    """One vLLM server process serving ``model_dir`` at ``url``; `start` returns once it
    has answered a generation."""

    def __init__(self, process: subprocess.Popen[bytes], url: str, log_path: Path) -> None:
        self.process = process
        self.url = url
        self.log_path = log_path

    @classmethod
    def start(
        cls,
        python: Path,
        model_dir: Path,
        engine: EngineConfig,
        *,
        log_path: Path,
        seed: int = 0,
        cuda: bool = False,
        extra_env: Mapping[str, str] | None = None,
    ) -> VllmServer:
        """``extra_env``: variables for the server's environment on top of tandem's own."""
        port = free_port()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **server_env(engine, cuda=cuda), **(extra_env or {})}
        env.pop("VIRTUAL_ENV", None)  # tandem's, not the server's
        command = server_command(python, model_dir, engine, port, seed, cuda=cuda)
        with open(log_path, "wb") as out:
            process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )
        server = cls(process, f"http://127.0.0.1:{port}", log_path)
        log.info("vllm.server.starting", url=server.url, model=str(model_dir), log=str(log_path))
        try:
            server._wait_ready(engine.vllm.start_timeout_s)
            server._probe()
        except BaseException:
            server.close()
            raise
        return server

    def _wait_ready(self, timeout_s: float) -> None:
        t0 = time.monotonic()
        shown = t0
        while True:
            if self.process.poll() is not None:
                raise VllmServerFailed(
                    f"the vLLM server exited with code {self.process.returncode} while "
                    f"starting:\n{self.reason()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    log.info(
                        "vllm.server.ready", url=self.url, seconds=round(time.monotonic() - t0, 1)
                    )
                    return
            except httpx.HTTPError:
                pass
            now = time.monotonic()
            if now - t0 > timeout_s:
                raise VllmServerFailed(
                    f"the vLLM server did not answer within {timeout_s:.0f} s "
                    f"(engine.vllm.start_timeout_s):\n{self.reason()}"
                )
            if now - shown >= PROGRESS_S:
                log.info("vllm.server.waiting", url=self.url, seconds=round(now - t0))
                shown = now
            time.sleep(0.5)

    def _probe(self) -> None:
        """One token from the model: the first request is where vLLM checks some shapes."""
        body = {
            "token_ids": [0],
            "sampling_params": {"max_tokens": 1, "temperature": 0.0},
        }
        try:
            r = httpx.post(f"{self.url}/inference/v1/generate", json=body, timeout=300.0)
        except httpx.HTTPError as e:
            raise VllmServerFailed(
                f"the vLLM server failed its first request ({e!r}):\n{self.reason()}"
            ) from None
        if r.status_code != 200:
            raise VllmServerFailed(
                f"the vLLM server cannot serve this model (HTTP {r.status_code} on its first "
                f"request):\n{self.reason()}"
            )

    def reason(self, lines: int = 12) -> str:
        """The server's own account of a failure: its error lines, else its log's tail."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no server log)"
        errors = [ln for ln in text if re.search(r"Error:|error:|ERROR", ln)]
        unsupported = [ln for ln in text if "Unsupported CPU attention" in ln]
        if unsupported:
            return (
                f"{unsupported[0].strip()}\nvLLM's CPU attention supports head sizes 32, 64, "
                "80, 96, 112, 128, 160, 192, 224, 256 and 512: give the model one of them "
                f"(model.head_dim). Server log: {self.log_path}"
            )
        chosen = (errors or text)[-lines:]
        return "\n".join(chosen) + f"\n(server log: {self.log_path})"

    def close(self, timeout_s: float = 20.0) -> None:
        """End the server and every process it started (its session)."""
        if self.process.poll() is None:
            _signal_group(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout_s)
        _signal_group(self.process.pid, signal.SIGKILL)  # leftovers of the group, if any
        self.process.wait()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
