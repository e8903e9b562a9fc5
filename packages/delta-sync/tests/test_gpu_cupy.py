"""cupy arrays and foreign DLPack CUDA arrays: diffed and patched on the device with cupy's
kernels, bit-identical to the host path, with torch nowhere in the process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

from tandem.delta_sync import apply_delta, encode_delta
from tandem.delta_sync.cupy_array import CupyArray
from tandem.delta_sync.dlpack import device_view
from tandem.delta_sync.tensors import view_of

pytestmark = pytest.mark.gpu
DTYPES = [np.dtype(ml_dtypes.bfloat16), np.float32, np.float16, np.int8, np.int64]


@pytest.fixture(scope="module")
def cp():
    return pytest.importorskip("cupy", reason="cupy (the gpu extra) is not installed")


class Foreign:
    """Another library's CUDA array: only the DLPack protocol, forwarded to a cupy array."""

    def __init__(self, arr) -> None:
        self.arr = arr

    def __dlpack__(self, **kw):
        return self.arr.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.arr.__dlpack_device__()


def _pair(dtype, n: int = 1 << 20, seed: int = 0):
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(n).astype(np.float32).astype(dtype)
    new = base.copy()
    u = new.view(f"u{new.itemsize}")
    hit = rng.random(n) < 0.03
    u[hit] += np.array(1, u.dtype)
    return base, new


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_cupy_kernels_match_the_host_bit_for_bit(cp, dtype) -> None:
    base, new = _pair(dtype)
    dev_new = device_view("w", cp.asarray(new), writable=False)
    dev_base = device_view("w", cp.asarray(base), writable=True)
    assert isinstance(dev_new, CupyArray)
    host_new, host_base = view_of("w", new), view_of("w", base.copy(), writable=True)
    idx = dev_new.changed(dev_base, 0, new.size)
    assert np.array_equal(idx, host_new.changed(host_base, 0, new.size))
    values = dev_new.gather(0, idx)
    assert np.array_equal(values, host_new.gather(0, idx))
    diff = values - host_base.gather(0, idx)  # modulo 2^bits
    dev_base.add_at(0, idx, diff)
    assert np.array_equal(dev_base.read(0, new.size), host_new.read(0, new.size))
    host_base.add_at(0, idx, diff)
    for view in (dev_base, host_base):  # the same calls, the same bits
        view.xor_at(5, view.read(5, 1000))  # x ^ x = 0
        view.scatter(2000, np.array([0, 3]), np.array([7, 9], view.read(0, 1).dtype))
        view.write(new.size - 2, view.read(0, 2))
    assert not dev_base.read(5, 1000).any()
    assert np.array_equal(dev_base.read(0, new.size), host_base.read(0, new.size))


def test_cupy_state_encodes_to_the_host_blob_and_applies_in_place(cp, trainer, same_bits) -> None:
    v0, v1 = trainer.snapshot(), trainer.step()
    g0 = {k: cp.asarray(a) for k, a in v0.items()}
    g1 = {k: cp.asarray(a) for k, a in v1.items()}
    blob = encode_delta(g0, g1)
    assert blob == encode_delta(v0, v1)
    ptrs = {k: a.data.ptr for k, a in g0.items()}
    apply_delta(g0, blob)
    same_bits({k: cp.asnumpy(a) for k, a in g0.items()}, v1)
    assert {k: a.data.ptr for k, a in g0.items()} == ptrs


def test_a_foreign_dlpack_array_is_read_through_cupy(cp, trainer) -> None:
    v0, v1 = trainer.snapshot(), trainer.step()
    foreign0 = {k: Foreign(cp.asarray(a)) for k, a in v0.items()}
    foreign1 = {k: Foreign(cp.asarray(a)) for k, a in v1.items()}
    assert encode_delta(foreign0, foreign1) == encode_delta(v0, v1)


def test_no_torch_is_imported_on_the_cupy_path(cp) -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # any import of torch now fails
        import cupy, numpy as np
        from tandem.delta_sync import apply_delta, encode_delta
        base = {"w": np.arange(4096, dtype=np.float32)}
        new = {"w": base["w"] + (np.arange(4096) % 7 == 0)}
        blob = encode_delta({k: cupy.asarray(v) for k, v in base.items()},
                            {k: cupy.asarray(v) for k, v in new.items()})
        assert blob == encode_delta(base, new)
        live = {k: cupy.asarray(v) for k, v in base.items()}
        apply_delta(live, blob)
        assert np.array_equal(cupy.asnumpy(live["w"]), new["w"])
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
