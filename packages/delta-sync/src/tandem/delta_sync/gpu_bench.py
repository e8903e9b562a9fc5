"""GPU columns of the delta-sync benchmark: each device path against the CPU, side by side.

A state lands on one of three paths, by what it is made of: numpy arrays and CPU torch
tensors on the host path; torch CUDA tensors on torch's kernels (`gpu.CudaTensor`); cupy
arrays and other DLPack CUDA arrays on cupy's kernels (`cupy_array.CupyArray`). For each
path available here this measures, on the same pair of snapshots: whether its blob and its
patched state are bit-identical to the host path's; encode and apply GB/s through the
public API (dense bytes per second); and the device part alone (diff: changed positions
and values to the host; patch: the staged additions applied), so that where torch and cupy
could both serve an array the faster kernels are plain.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem.delta_sync.delta import apply_delta, encode_delta
from tandem.delta_sync.dlpack import device_view
from tandem.delta_sync.errors import DeltaSyncError
from tandem.delta_sync.tensor_view import TensorView
from tandem.delta_sync.tensors import view_of

State = Mapping[str, Any]
USED_FOR = {
    "cpu": "numpy arrays, CPU torch tensors",
    "torch": "torch CUDA tensors",
    "cupy": "cupy arrays, DLPack CUDA arrays (JAX, ...)",
}


@dataclass
class PathRow:
    path: str
    bit_exact: bool | None = None  # None: not measured through the public API
    encode_gbs: float = float("nan")
    apply_gbs: float = float("nan")
    diff_gbs: float = float("nan")
    patch_gbs: float = float("nan")
    note: str = ""


@dataclass
class DevicePath:
    """How to put a host state on one path, and how to read one back."""

    name: str
    upload: Callable[[np.ndarray], Any]
    download: Callable[[Any], np.ndarray]
    sync: Callable[[], None]


def _torch_cuda() -> bool | None:
    """Whether torch sees a CUDA device; None when torch is not installed."""
    try:
        import torch
    except ImportError:
        return None
    return bool(torch.cuda.is_available())


def available_paths() -> tuple[list[DevicePath], list[str]]:
    """The device paths this machine has, and a line for each it lacks."""
    paths, missing = [], []
    cuda = _torch_cuda()
    if cuda:
        import torch

        from tandem.delta_sync.torch_interop import to_torch

        paths.append(
            DevicePath(
                "torch", lambda a: to_torch(a).cuda(), _bits_of_torch, torch.cuda.synchronize
            )
        )
    else:
        missing.append("torch: " + ("not installed" if cuda is None else "no CUDA device visible"))
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            sync = cupy.cuda.Device().synchronize
            paths.append(DevicePath("cupy", cupy.asarray, cupy.asnumpy, sync))
    except ImportError:
        missing.append("cupy: not installed (the gpu extra)")
    except Exception as e:  # cupy imports without a driver, then fails on the first call
        missing.append(f"cupy: no usable CUDA device ({type(e).__name__})")
    return paths, missing


def _bits_of_torch(t: Any) -> np.ndarray:
    from tandem.delta_sync.dtypes import torch_int_view

    return torch_int_view(t.detach().cpu()).numpy()


def _bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).reshape(-1).view(f"u{np.asarray(a).itemsize}")


def _best(fn: Callable[[], object], repeat: int, sync: Callable[[], None]) -> float:
    best = float("inf")
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _view(name: str, x: Any) -> TensorView:
    """The view the codec reads ``x`` through (DLPack CUDA arrays included)."""
    return device_view(name, x, writable=False) or view_of(name, x)


def _device_part(
    base: State, new: State, repeat: int, sync: Callable[[], None]
) -> tuple[float, float]:
    """Seconds of the diff (changed + gather) and of the patch (add_at), all tensors."""
    nv = {k: _view(k, v) for k, v in new.items()}
    bv = {k: _view(k, v) for k, v in base.items()}
    staged = {}

    def diff() -> None:
        for k, v in nv.items():
            idx = v.changed(bv[k], 0, v.numel)
            staged[k] = (idx, v.gather(0, idx) - bv[k].gather(0, idx))

    diff_s = _best(diff, repeat, sync)
    targets = {k: v.snapshot() for k, v in bv.items()}

    def patch() -> None:
        for k, (idx, d) in staged.items():
            targets[k].add_at(0, idx, d)

    return diff_s, _best(patch, repeat, sync)


def measure_paths(base: State, new: State, *, repeat: int = 3) -> tuple[list[PathRow], list[str]]:
    """One row per path: the host path first, then each device path this machine has."""
    gb = sum(np.asarray(a).nbytes for a in new.values()) / 1e9
    ref_blob = encode_delta(base, new)
    host = PathRow("cpu", bit_exact=True)
    host.encode_gbs = gb / _best(lambda: encode_delta(base, new), repeat, lambda: None)
    copies = [{k: np.array(v) for k, v in base.items()} for _ in range(repeat)]
    host.apply_gbs = gb / _best(lambda: apply_delta(copies.pop(), ref_blob), repeat, lambda: None)
    diff_s, patch_s = _device_part(base, new, repeat, lambda: None)
    host.diff_gbs, host.patch_gbs = gb / diff_s, gb / patch_s
    rows = [host]
    paths, missing = available_paths()
    for p in paths:
        try:
            rows.append(_measure_path(p, base, new, ref_blob, gb, repeat))
        except Exception as e:  # one path failing must not hide the others' figures
            rows.append(PathRow(p.name, bit_exact=False, note=f"failed: {type(e).__name__}: {e}"))
    return rows, missing


def _measure_path(
    p: DevicePath, base: State, new: State, ref_blob: bytes, gb: float, repeat: int
) -> PathRow:
    dev_base = {k: p.upload(v) for k, v in base.items()}
    dev_new = {k: p.upload(v) for k, v in new.items()}
    row = PathRow(p.name)
    diff_s, patch_s = _device_part(dev_base, dev_new, repeat, p.sync)
    row.diff_gbs, row.patch_gbs = gb / diff_s, gb / patch_s
    try:
        blob = encode_delta(dev_base, dev_new)
    except DeltaSyncError as e:  # a path the public API does not dispatch to
        row.note = f"public API: {e}"
        return row
    live = {k: p.upload(v) for k, v in base.items()}
    apply_delta(live, blob)
    row.bit_exact = blob == ref_blob and all(
        np.array_equal(_bits(p.download(live[k])), _bits(new[k])) for k in new
    )
    row.encode_gbs = gb / _best(lambda: encode_delta(dev_base, dev_new), repeat, p.sync)
    fresh = [{k: p.upload(v) for k, v in base.items()} for _ in range(repeat)]
    row.apply_gbs = gb / _best(lambda: apply_delta(fresh.pop(), blob), repeat, p.sync)
    return row


def format_paths(rows: list[PathRow]) -> str:
    cols = [("path", 6), ("used for", 44), ("bit-exact", 9), ("enc GB/s", 8),
            ("apply GB/s", 10), ("diff GB/s", 9), ("patch GB/s", 10)]  # fmt: skip
    lines = [" ".join(f"{n:>{w}}" if i > 1 else f"{n:<{w}}" for i, (n, w) in enumerate(cols))]
    for r in rows:
        exact = "-" if r.bit_exact is None else ("yes" if r.bit_exact else "NO")
        cells = [r.path, USED_FOR[r.path], exact, f"{r.encode_gbs:.2f}", f"{r.apply_gbs:.2f}",
                 f"{r.diff_gbs:.2f}", f"{r.patch_gbs:.2f}"]  # fmt: skip
        lines.append(
            " ".join(
                f"{c:>{w}}" if i > 1 else f"{c:<{w}}"
                for i, (c, (_, w)) in enumerate(zip(cells, cols, strict=True))
            )
        )
        if r.note:
            lines.append(f"       {r.note}")
    return "\n".join(lines)


def figures_line(rows: list[PathRow]) -> str:
    """One line for the GPU check's summary: each path's rates and whether it is exact."""
    parts = []
    for r in rows:
        exact = {None: "not via the API", True: "bit-exact", False: "NOT bit-exact"}[r.bit_exact]
        parts.append(
            f"{r.path} enc {r.encode_gbs:.2f} / apply {r.apply_gbs:.2f} / diff {r.diff_gbs:.1f} "
            f"/ patch {r.patch_gbs:.1f} GB/s {exact}"
        )
    both = {r.path: r for r in rows if r.path in ("torch", "cupy")}
    if len(both) == 2:
        t, c = both["torch"], both["cupy"]
        faster = "torch" if t.diff_gbs + t.patch_gbs >= c.diff_gbs + c.patch_gbs else "cupy"
        parts.append(f"faster device kernels: {faster}")
    return "; ".join(parts)
