"""A vLLM server's weights following the run's delta-sync stream, in place.

The server's worker extension (tandem-vllm-plugin) holds a delta-sync subscriber; this side
drives it over HTTP. An update prepares the next version in the workers while the server
keeps serving, then pauses it only to apply:

1. ``/pause?mode=keep``: no step runs; requests in flight wait where they are;
2. ``tandem_apply`` in every worker: the delta patched into place;
3. ``/reset_prefix_cache?reset_running_requests=true``: cached prefixes of the old weights
   are dropped, and the requests in flight are recomputed on the new ones (their earlier
   tokens keep the version that sampled them);
4. ``/update_weight_version``: tokens from now on carry the new version;
5. ``/resume``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import msgspec

from tandem.moe_determinism.model.hf import HfSource
from tandem.orchestrator.inference.vllm.engine import KEEPALIVE_S
from tandem.orchestrator.protocols import EngineStopped

POLL_S = 0.02
"""How often a prepare in progress is checked."""


class VllmUpdate(msgspec.Struct, kw_only=True):
    """One version applied to one server: its pause is the server's stop of serving."""

    url: str
    version: int
    prepare_s: float
    pause_s: float
    apply_s: float
    downloaded_bytes: int


class VllmWeights:
    """The weight stream of one server (its plugin's subscriber)."""

    def __init__(
        self, url: str, *, client: httpx.AsyncClient | None = None, timeout_s: float = 600.0
    ) -> None:
        """``client``: one to share; by default a client of its own, so that an update never
        waits for a connection that generations hold."""
        self._own = client is None
        self.client = client or httpx.AsyncClient(
            timeout=timeout_s, limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S)
        )
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.version = -1

    async def _post(self, path: str, **kw: Any) -> dict[str, Any]:
        try:
            r = await self.client.post(self.url + path, **kw)
        except httpx.HTTPError as e:
            raise EngineStopped(f"vLLM server {self.url} did not answer {path}: {e!r}") from None
        if r.status_code != 200:
            raise EngineStopped(
                f"vLLM server {self.url}: {path} answered HTTP {r.status_code}: {r.text[:400]}"
            )
        return dict(r.json()) if r.content else {}

    async def rpc(self, method: str, *args: str) -> list[dict[str, Any]]:
        """Call ``method`` of the plugin in every worker; their results."""
        body = {"method": method, "args": list(args), "timeout": self.timeout_s}
        results = (await self._post("/collective_rpc", json=body)).get("results") or []
        if not results or not all(isinstance(r, dict) for r in results):
            raise EngineStopped(
                f"vLLM server {self.url}: {method} returned {results!r}; is it started with "
                "--worker-extension-cls tandem.vllm_plugin.DeltaSyncExtension?"
            )
        return [dict(r) for r in results]

    async def follow(self, store: str, version: int, layout: dict[str, HfSource]) -> None:
        """Subscribe every worker to ``store`` from ``version`` and load that version now (a
        server given by URL may hold anything); ``layout`` maps the checkpoint's names to
        the stream's (`hf_layout`)."""
        await self._swap(version, "tandem_follow", store, str(version), json.dumps(layout))
        self.version = version

    async def _swap(self, version: int, method: str, *args: str) -> list[dict[str, Any]]:
        """Run ``method`` in every worker with the server paused, then drop what the old
        weights computed and tag tokens from now on with ``version``."""
        await self._post("/pause", params={"mode": "keep"})
        try:
            results = await self.rpc(method, *args)
            reset = await self._post(
                "/reset_prefix_cache", params={"reset_running_requests": "true"}
            )
            if not reset.get("success", False):
                raise EngineStopped(f"vLLM server {self.url} could not reset its prefix cache")
            await self._post("/update_weight_version", json={"new_version": str(version)})
        finally:
            await self._post("/resume")
        return results

    async def update(self, version: int | None = None) -> VllmUpdate | None:
        """Prepare ``version`` (default: the latest) while serving, then apply it in a pause;
        None when there is nothing newer than what the server holds."""
        t0 = time.perf_counter()
        await self.rpc("tandem_prepare", "" if version is None else str(version))
        while True:
            status = await self.rpc("tandem_status")
            errors = [s["error"] for s in status if s.get("error")]
            if errors:
                raise EngineStopped(f"vLLM server {self.url} failed to prepare:\n{errors[0]}")
            if not any(s.get("preparing") for s in status):
                break
            if time.perf_counter() - t0 > self.timeout_s:
                raise EngineStopped(
                    f"vLLM server {self.url}: a prepare took over {self.timeout_s} s"
                )
            await asyncio.sleep(POLL_S)
        prepared = {s.get("prepared") for s in status}
        if prepared == {None}:
            return None
        if len(prepared) != 1:
            raise EngineStopped(
                f"vLLM server {self.url}: workers prepared {sorted(map(str, prepared))}"
            )
        target = int(prepared.pop())  # type: ignore[arg-type]
        prepare_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        applied = await self._swap(target, "tandem_apply")
        self.version = target
        return VllmUpdate(
            url=self.url,
            version=target,
            prepare_s=prepare_s,
            pause_s=time.perf_counter() - t1,
            apply_s=max(float(a.get("apply_s", 0.0)) for a in applied),
            downloaded_bytes=sum(int(s.get("prepared_bytes", 0)) for s in status),
        )

    async def close(self) -> None:
        if self._own:
            await self.client.aclose()
