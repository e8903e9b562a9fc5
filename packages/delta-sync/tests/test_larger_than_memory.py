"""Models larger than memory: memory-mapped base copies, checkpoints and staged shards give
the same bits as the in-memory paths (the memory figures are benchmarks/delta_sync_scale.py's)."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from tandem.delta_sync import DeltaSyncError, Publisher, Subscriber, load_safetensors
from tandem.delta_sync import save_safetensors as save


def owner(a: np.ndarray) -> object:
    """What an array's memory belongs to, down its chain of views."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a.base.obj if isinstance(a.base, memoryview) else a.base


def test_memory_mapped_base_checkpoint_and_engine_give_the_same_bits(
    tmp_path, local_store, big_trainer, same_bits
) -> None:
    v0, v1, v2 = big_trainer.snapshot(), big_trainer.step(), big_trainer.step()
    for i, v in enumerate((v0, v1, v2)):
        save(tmp_path / f"v{i}.safetensors", v)
    base_dir = tmp_path / "base"
    with Publisher(
        local_store, base_dir=base_dir, anchor_every=2, shard_bytes=64 << 10, chunk_bytes=64 << 10
    ) as pub:
        for i in range(3):  # anchor, delta, anchor (+ step delta): every copy kind is kept
            state, _ = load_safetensors(tmp_path / f"v{i}.safetensors", mmap_mode="r")
            assert isinstance(next(iter(state.values())).base, np.memmap)
            pub.publish(i, state)
        assert list(base_dir.iterdir()) == []  # the copies' files were unlinked when mapped
    save(tmp_path / "engine.safetensors", v0)
    engine, _ = load_safetensors(tmp_path / "engine.safetensors", mmap_mode="r+")
    with Subscriber(local_store, version=0, cache_dir=tmp_path / "cache") as sub:
        prepared = sub.prepare(1)
        streams = [op.sparse for ops in prepared.patch.ops.values() for op in ops if op.sparse]
        assert streams, "an Adam-like step should stage sparse chunks"
        for s in streams:  # staged in the spill file (already unlinked), not in memory
            assert isinstance(owner(s.glow), mmap.mmap) and isinstance(owner(s.vpacked), mmap.mmap)
        assert prepared.spilled_bytes >= sum(s.nbytes for s in streams) > 0
        assert not list((tmp_path / "cache").glob("staged-*"))
        assert prepared.apply(engine).downloaded_bytes > 0
        sub.pull(engine)
    del engine
    reread, _ = load_safetensors(tmp_path / "engine.safetensors")  # patched in the file itself
    same_bits(reread, v2)
    # fresh engines pull the anchor through a shard cache (staged memory-mapped from it):
    # the first downloads every shard, the second finds them all there
    for downloads in (True, False):
        fresh = {k: np.zeros_like(a) for k, a in v2.items()}
        with Subscriber(local_store, cache_dir=tmp_path / "cache2") as sub:
            report = sub.pull(fresh, version=2)
        assert (report.downloaded_bytes > 0) == downloads
        assert (report.cached_bytes > 0) != downloads
        same_bits(fresh, v2)


def test_an_unknown_mmap_mode_is_one_line(tmp_path, big_trainer) -> None:
    save(tmp_path / "m.safetensors", big_trainer.snapshot())
    with pytest.raises(DeltaSyncError, match="mmap_mode must be None, 'r' or 'r"):
        load_safetensors(tmp_path / "m.safetensors", mmap_mode="w+")
