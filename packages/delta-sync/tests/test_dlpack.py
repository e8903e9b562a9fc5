"""CUDA arrays that are not torch tensors, on a CPU: the DLPack dispatch and its plumbing.

A stand-in device array (``__dlpack__`` and ``__dlpack_device__`` saying "CUDA device 0")
must be routed to the cupy path; without cupy that is a one-line error naming the tensor
and the extra to install. With a stand-in cupy module (numpy arrays as device memory and
numpy versions of the four named kernels), `CupyArray` must find the same changed
positions and produce the same patched bits as the host path, so everything around the
kernels is exercised here; the kernels themselves run in the `gpu` tests. So are the GPU
columns of benchmarks/delta_sync.py: the host row, the missing paths named, and a device
path (the stand-in) through the same measurement as a real one.
"""

from __future__ import annotations

import math
import sys
from types import ModuleType

import ml_dtypes
import numpy as np
import pytest

from tandem.delta_sync import DeltaSyncError, gpu_bench
from tandem.delta_sync.cupy_array import CupyArray
from tandem.delta_sync.dlpack import device_view, dlpack_device, is_cuda_array
from tandem.delta_sync.tensors import HostTensor, view_of


class StandInCudaArray:
    """A foreign array (as JAX's) that reports CUDA memory; its bytes are a numpy array."""

    def __init__(self, host: np.ndarray, kind: int = 2) -> None:
        self.host, self.kind = host, kind
        self.dtype, self.shape = host.dtype, host.shape

    def __dlpack__(self, stream=None, **kw):  # cupy.from_dlpack would call this
        raise BufferError("a stand-in has no device memory to export")

    def __dlpack_device__(self) -> tuple[int, int]:
        return (self.kind, 0)


class StandInCupyNdarray(np.ndarray):
    """The stand-in cupy's own array type: numpy memory that says it is on CUDA device 0."""

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)


def _standin_kernel(in_params: str, out_params: str, operation: str, name: str):
    ops = {
        "tandem_delta_ne": lambda a, b: a != b,
        "tandem_delta_scatter": lambda i, v, seg: seg.__setitem__(i, v),
        "tandem_delta_scatter_add": lambda i, d, seg: seg.__setitem__(i, seg[i] + d),
        "tandem_delta_xor": lambda v, seg: np.bitwise_xor(seg, v, out=seg),
    }
    return ops[name]


def _standin_cupy(calls: list) -> ModuleType:
    def from_dlpack(x):
        calls.append(x)
        return x.host

    xp = ModuleType("standin_cupy")
    xp.__dict__.update(
        __version__="stand-in",
        ndarray=StandInCupyNdarray,
        from_dlpack=from_dlpack,
        asarray=np.asarray,
        asnumpy=np.asarray,
        ascontiguousarray=np.ascontiguousarray,
        flatnonzero=np.flatnonzero,
        ElementwiseKernel=_standin_kernel,
    )
    return xp


def test_dlpack_devices_are_told_apart() -> None:
    host = np.zeros(3, np.float32)
    assert dlpack_device(host) == (1, 0) and not is_cuda_array(host)  # numpy: kDLCPU
    assert is_cuda_array(StandInCudaArray(host))
    assert is_cuda_array(StandInCudaArray(host, kind=13))  # CUDA managed memory
    assert not is_cuda_array(StandInCudaArray(host, kind=10))  # ROCm
    assert dlpack_device(object()) is None
    assert device_view("w", host, writable=False) is None


def test_a_cuda_array_without_cupy_is_a_one_line_error(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    fake = StandInCudaArray(np.zeros((2, 3), np.float32))
    with pytest.raises(DeltaSyncError) as err:
        device_view("layers.0.w", fake, writable=False)
    msg = str(err.value)
    assert "\n" not in msg
    assert "'layers.0.w'" in msg and "StandInCudaArray" in msg and "CUDA device 0" in msg
    assert "tandem-delta-sync[gpu]" in msg


def test_dispatch_reads_through_from_dlpack_and_refuses_writing_a_foreign_array() -> None:
    calls: list = []
    xp = _standin_cupy(calls)
    host = np.arange(12, dtype=np.float32).reshape(3, 4)
    fake = StandInCudaArray(host)
    view = device_view("w", fake, writable=False, cupy=xp)
    assert isinstance(view, CupyArray) and calls == [fake]
    assert (view.dtype, view.shape, view.numel, view.itemsize) == ("float32", (3, 4), 12, 4)
    assert np.array_equal(view.read(0, 12), host.reshape(-1).view(np.uint32))
    with pytest.raises(DeltaSyncError, match=r"'w'.*cupy.from_dlpack\(x\)"):
        device_view("w", fake, writable=True, cupy=xp)
    own = np.zeros(4, np.float32).view(StandInCupyNdarray)
    assert device_view("w", own, writable=True, cupy=xp).ints.base is not None  # an alias
    strided = np.zeros((4, 4), np.float32).view(StandInCupyNdarray)[:, ::2]
    with pytest.raises(DeltaSyncError, match="not a C-contiguous"):
        device_view("w", strided, writable=True, cupy=xp)


def test_unsupported_dtype_names_the_tensor() -> None:
    fake = StandInCudaArray(np.zeros(3, np.complex64))
    with pytest.raises(DeltaSyncError, match=r"'z'.*unsupported dtype"):
        device_view("z", fake, writable=False, cupy=_standin_cupy([]))


@pytest.mark.parametrize(
    "dtype", [np.dtype(ml_dtypes.bfloat16), np.float32, np.int8, np.float64, np.bool_]
)
def test_cupy_view_diffs_and_patches_like_the_host(dtype) -> None:
    rng = np.random.default_rng(0)
    n = 5000
    base = rng.standard_normal(n).astype(np.float32).astype(dtype)
    new = base.copy()
    hit = np.sort(rng.choice(n, 300, replace=False))
    new.reshape(-1).view(f"u{new.itemsize}")[hit] ^= np.array(1, f"u{new.itemsize}")
    xp = _standin_cupy([])
    dev_new = device_view("w", new.view(StandInCupyNdarray), writable=False, cupy=xp)
    dev_base = device_view("w", base.copy().view(StandInCupyNdarray), writable=True, cupy=xp)
    host_new, host_base = view_of("w", new), view_of("w", base.copy(), writable=True)
    assert isinstance(host_new, HostTensor)
    for start, stop in ((0, n), (1000, 3000), (4999, 5000)):
        for b in (dev_base, host_base):  # the base on the device, or on the host
            idx = dev_new.changed(b, start, stop)
            assert np.array_equal(idx, host_new.changed(host_base, start, stop))
            assert np.array_equal(dev_new.gather(start, idx), host_new.gather(start, idx))
    # patches: the same calls on both sides leave the same bits
    u = new.reshape(-1).view(f"u{new.itemsize}")
    diff = u[hit] - base.reshape(-1).view(u.dtype)[hit]  # wraps modulo 2^bits
    for view in (dev_base, host_base):
        view.add_at(0, hit, diff)
        view.scatter(100, np.array([0, 7]), u[100:108:7])
        view.xor_at(10, u[10:20] ^ view.read(10, 20))
        view.write(n - 3, u[n - 3 :])
    assert np.array_equal(dev_base.read(0, n), host_base.read(0, n))
    assert np.array_equal(dev_base.read(0, n), u)
    snap = dev_base.snapshot()
    snap.write(0, ~u[:1])
    assert not np.array_equal(snap.read(0, 1), dev_base.read(0, 1))  # an independent copy


def test_a_patch_past_the_end_is_refused_before_any_kernel_runs() -> None:
    xp = _standin_cupy([])
    arr = np.zeros(10, np.float32).view(StandInCupyNdarray)
    view = device_view("w", arr, writable=True, cupy=xp)
    one = np.ones(1, np.uint32)
    for call in (
        lambda: view.add_at(5, np.array([5]), one),
        lambda: view.scatter(0, np.array([10]), one),
        lambda: view.write(9, np.ones(2, np.uint32)),
        lambda: view.xor_at(9, np.ones(2, np.uint32)),
        lambda: view.add_at(0, np.array([1, 2]), one),  # positions and values disagree
    ):
        with pytest.raises(DeltaSyncError, match="'w'"):
            call()
    assert not arr.any()


def _pair():
    from tandem.delta_sync.bench import adam_snapshots, moe_shapes

    _, base, new = next(adam_snapshots(moe_shapes(1 << 20), [1e-5], warmup=1))
    return base, new


def test_on_a_cpu_the_host_row_is_exact_and_the_device_paths_say_why_not(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # as without the gpu extra
    monkeypatch.setattr(gpu_bench, "_torch_cuda", lambda: False)
    base, new = _pair()
    rows, missing = gpu_bench.measure_paths(base, new, repeat=1)
    assert [r.path for r in rows] == ["cpu"] and rows[0].bit_exact
    rates = (rows[0].encode_gbs, rows[0].apply_gbs, rows[0].diff_gbs, rows[0].patch_gbs)
    assert all(math.isfinite(x) and x > 0 for x in rates)
    assert missing == ["torch: no CUDA device visible", "cupy: not installed (the gpu extra)"]
    assert gpu_bench.figures_line(rows).startswith("cpu enc ")


def test_a_device_path_goes_through_the_same_measurement(monkeypatch) -> None:
    xp = _standin_cupy([])
    monkeypatch.setitem(sys.modules, "cupy", xp)
    path = gpu_bench.DevicePath(
        "cupy", lambda a: np.array(a).view(StandInCupyNdarray), np.asarray, lambda: None
    )
    monkeypatch.setattr(gpu_bench, "available_paths", lambda: ([path], []))
    base, new = _pair()
    rows, _ = gpu_bench.measure_paths(base, new, repeat=1)
    assert [r.path for r in rows] == ["cpu", "cupy"]
    assert rows[1].bit_exact is True and rows[1].diff_gbs > 0 and rows[1].patch_gbs > 0
    table = gpu_bench.format_paths(rows)
    assert "cupy arrays, DLPack CUDA arrays" in table and "NO" not in table


def test_a_failing_path_is_reported_without_hiding_the_others(monkeypatch) -> None:
    def broken(a):
        raise RuntimeError("out of device memory")

    path = gpu_bench.DevicePath("torch", broken, np.asarray, lambda: None)
    monkeypatch.setattr(gpu_bench, "available_paths", lambda: ([path], []))
    rows, _ = gpu_bench.measure_paths(*_pair(), repeat=1)
    assert rows[0].bit_exact and rows[1].bit_exact is False
    assert "out of device memory" in rows[1].note
    assert "torch" in gpu_bench.figures_line(rows) and "NOT bit-exact" in gpu_bench.figures_line(
        rows
    )


@pytest.mark.parametrize("faster", ["torch", "cupy"])
def test_the_faster_device_kernels_are_named(faster: str) -> None:
    rows = [gpu_bench.PathRow(p, True, 1, 1, 10, 10) for p in ("cpu", "torch", "cupy")]
    next(r for r in rows if r.path == faster).diff_gbs = 50
    assert gpu_bench.figures_line(rows).endswith(f"faster device kernels: {faster}")
