"""The worker extension: a delta-sync subscriber inside each vLLM worker.

Each worker keeps a host copy of the version it serves as the stream holds it (the
trainer's own tensors, read from the store when it starts following), because a delta
names those tensors while vLLM's parameters are fused (q, k and v in one matrix, experts
stacked and, on the CPU, repacked). A layout given by the engine maps them to the
checkpoint's names (a rename, or one expert of a stacked tensor). Applying a version:

1. the prepared delta patches that copy in place (bit-exact, verified while preparing);
2. vLLM's in-place reload (`reload_weights`) loads it, under the checkpoint's names, into
   the model's parameters through each layer's own weight loader, as a start would;
3. on the CPU, each MoE layer's experts go through the CPU kernel's full preparation (the
   intermediate size padded, the grouped-GEMM repack), which vLLM's reload skips there.

The server answers requests throughout a prepare (it runs in a thread of the worker); the
engine pauses it only for `tandem_apply`. Arguments and results cross ``/collective_rpc``
as strings and JSON-able dicts (it cannot carry tensors).
"""

from __future__ import annotations

import json
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

from tandem.delta_sync import Prepared, Subscriber, open_store


class DeltaSyncExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); every method name starts
    with ``tandem_`` so that none collides with the worker's own (``update_weights``,
    ``reload_weights``)."""

    def tandem_follow(self, store: str, version: str, layout: str) -> dict[str, Any]:
        """Follow ``store`` from ``version``: its weights are loaded now (whatever the server
        held before), and later versions are deltas from them.

        ``layout`` (JSON): checkpoint name -> [stream name, index along dim 0 or null,
        scale (default 1), shape of a constant zero tensor when the stream name is null],
        how the stream's tensors (the trainer's own state) make the checkpoint's."""
        subscriber = Subscriber(open_store(store))
        state = subscriber.materialize(int(version), as_torch=True)
        self._tandem_layout = {name: _source(entry) for name, entry in json.loads(layout).items()}
        named = {src for src, _, _, _ in self._tandem_layout.values() if src is not None}
        missing = sorted(named - set(state))
        if missing:
            raise KeyError(f"the stream has no tensors {missing[:3]} that the layout names")
        self._tandem_shadow = state
        self._tandem_subscriber = Subscriber(open_store(store), version=int(version))
        self._tandem_version = int(version)
        self._tandem_prepared: Prepared | None = None
        self._tandem_error: str | None = None
        self._tandem_thread: threading.Thread | None = None
        t0 = time.perf_counter()
        self._tandem_load()
        return {
            "version": self._tandem_version,
            "tensors": len(state),
            "load_s": time.perf_counter() - t0,
        }

    def _tandem_load(self) -> int:
        """The host copy into the model's parameters (vLLM's in-place reload)."""
        runner = self.model_runner  # type: ignore[attr-defined]
        reset = _reset_cpu_expert_kernels(runner.get_model())
        runner.reload_weights(weights_iterator=self._tandem_checkpoint())
        return reset

    def _tandem_checkpoint(self) -> Iterator[tuple[str, Any]]:
        """The host copy under the checkpoint's names (views, but for scaled tensors and
        constants)."""
        import torch

        for name, (src, index, scale, zeros) in self._tandem_layout.items():
            if src is None:
                yield name, torch.zeros(zeros, dtype=self._tandem_dtype())
                continue
            t = self._tandem_shadow[src]
            t = t if index is None else t[index]
            yield name, t if scale == 1 else t * scale

    def _tandem_dtype(self) -> Any:
        """The dtype of the stream's first floating tensor, for constant tensors (vLLM's
        weight loaders cast to their parameter's)."""
        return next(t.dtype for t in self._tandem_shadow.values() if t.is_floating_point())

    def tandem_prepare(self, version: str = "") -> dict[str, Any]:
        """Start preparing ``version`` (default: the latest) in the background."""
        if self._tandem_thread is not None and self._tandem_thread.is_alive():
            return {"preparing": True}
        self._tandem_error = None
        target = int(version) if version else None

        def work() -> None:
            try:
                prepared = self._tandem_subscriber.prepare(target)
                if prepared.version > self._tandem_version:
                    self._tandem_prepared = prepared
            except BaseException:
                self._tandem_error = traceback.format_exc(limit=8)

        self._tandem_thread = threading.Thread(target=work, name="tandem-prepare", daemon=True)
        self._tandem_thread.start()
        return {"preparing": True}

    def tandem_status(self) -> dict[str, Any]:
        thread = getattr(self, "_tandem_thread", None)
        prepared = getattr(self, "_tandem_prepared", None)
        return {
            "version": getattr(self, "_tandem_version", None),
            "preparing": bool(thread is not None and thread.is_alive()),
            "prepared": None if prepared is None else prepared.version,
            "prepared_bytes": 0 if prepared is None else prepared.downloaded_bytes,
            "error": getattr(self, "_tandem_error", None),
        }

    def tandem_apply(self) -> dict[str, Any]:
        """The pause: patch the host copy, load it into the model, repack the experts."""
        prepared = self._tandem_prepared
        if prepared is None:
            return {"version": self._tandem_version, "applied": False}
        t0 = time.perf_counter()
        prepared.apply(self._tandem_shadow)
        repacked = self._tandem_load()
        self._tandem_version = prepared.version
        self._tandem_prepared = None
        return {
            "version": self._tandem_version,
            "applied": True,
            "apply_s": time.perf_counter() - t0,
            "repacked_layers": repacked,
        }


def _source(entry: list[Any]) -> tuple[str | None, int | None, float, tuple[int, ...] | None]:
    """One layout entry: [stream name, index, scale, zeros shape], the last two optional."""
    src, index, scale, zeros = [*entry, 1.0, None][:4] if len(entry) == 2 else [*entry, None][:4]
    if src is None and zeros is None:
        raise ValueError(f"layout entry {entry}: neither a stream tensor nor a constant's shape")
    return (
        None if src is None else str(src),
        None if index is None else int(index),
        float(scale),
        None if zeros is None else tuple(int(n) for n in zeros),
    )


def _reset_cpu_expert_kernels(model: Any) -> int:
    """On the CPU, make the reload prepare each MoE layer's experts as a first load does;
    returns the layers reset (0 elsewhere).

    vLLM's reload treats a layer whose expert kernel exists as an update and skips the CPU
    kernel's own preparation (the intermediate size padded to its alignment, then the
    grouped-GEMM repack): the reloaded experts would keep the checkpoint's shape, which does
    not fit the padded parameters, or compute with unpacked weights. Without the kernel,
    the reload builds it again and prepares the experts in full."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    count = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if getattr(method, "moe_kernel", None) is not None:
            method.moe_kernel = None  # type: ignore[union-attr]
            count += 1
    return count
