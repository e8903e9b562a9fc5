"""The state's own read-only mapped checkpoint files as the publisher's base: the same bits
as with a copy, and a file written, truncated or deleted after publishing never breaks it."""

from __future__ import annotations

import os

import numpy as np
from structlog.testing import capture_logs

from tandem.delta_sync import Publisher, Subscriber, load_safetensors
from tandem.delta_sync import save_safetensors as save


def publish_files(pub: Publisher, paths, first: int = 0) -> None:
    for i, path in enumerate(paths, first):
        state, _ = load_safetensors(path, mmap_mode="r")
        pub.publish(i, state)


def checkpoints(tmp_path, trainer, n: int = 4) -> tuple[list[dict], list]:
    """n versions of the trainer's state, each written to its own file."""
    versions = [trainer.snapshot()] + [trainer.step() for _ in range(n - 1)]
    paths = [tmp_path / f"v{i}.safetensors" for i in range(n)]
    for path, v in zip(paths, versions, strict=True):
        save(path, v)
    return versions, paths


def pulled(store, version: int, v0) -> dict[str, np.ndarray]:
    state = {k: a.copy() for k, a in v0.items()}
    with Subscriber(store, version=0) as sub:
        sub.pull(state, version=version)
    return state


def test_the_mapped_files_are_the_base_and_give_the_same_bits(
    tmp_path, local_store, big_trainer, same_bits
) -> None:
    versions, paths = checkpoints(tmp_path, big_trainer)
    with Publisher(
        local_store, anchor_every=2, mapped_base=True, shard_bytes=64 << 10, chunk_bytes=64 << 10
    ) as pub:
        publish_files(pub, paths[:2])
        prev = pub._prev  # the base is the file's mapping itself: no copy was kept
        assert prev is not None and all(
            isinstance(v.flat, np.memmap) and str(v.flat.filename) == str(paths[1])
            for v in prev.values()
        )
        os.unlink(paths[0])  # the anchor's file deleted, v1's renamed over: both still read
        os.replace(paths[1], tmp_path / "moved.safetensors")
        publish_files(pub, paths[2:], first=2)  # a delta (+ catch-up), then an anchor
    for i in (1, 2, 3):
        same_bits(pulled(local_store, i, versions[0]), versions[i])


def test_a_published_file_written_or_truncated_afterwards_is_rebuilt_from_the_store(
    tmp_path, local_store, big_trainer, same_bits
) -> None:
    versions, paths = checkpoints(tmp_path, big_trainer)
    pub = Publisher(
        local_store, anchor_every=10, mapped_base=True, shard_bytes=64 << 10, chunk_bytes=64 << 10
    )
    with pub, capture_logs() as logs:
        publish_files(pub, paths[:2])
        paths[1].write_bytes(paths[3].read_bytes())  # v1's file rewritten in place
        publish_files(pub, paths[2:3], first=2)
        with open(paths[2], "r+b") as f:  # v2's file truncated: reading it would fault
            f.truncate(8)
        publish_files(pub, paths[3:], first=3)
    rebuilt = [e["reason"] for e in logs if e["event"] == "delta_sync.mapped_base_changed"]
    assert len(rebuilt) == 2 and "v1.safetensors" in rebuilt[0] and "v2" in rebuilt[1]
    for i in (1, 2, 3):
        same_bits(pulled(local_store, i, versions[0]), versions[i])


def test_a_writable_or_in_memory_state_keeps_a_copy(
    tmp_path, local_store, big_trainer, same_bits
) -> None:
    v0, v1 = big_trainer.snapshot(), big_trainer.step()
    save(tmp_path / "v0.safetensors", v0)
    writable, _ = load_safetensors(tmp_path / "v0.safetensors", mmap_mode="r+")
    with Publisher(
        local_store, mapped_base=True, shard_bytes=64 << 10, chunk_bytes=64 << 10
    ) as pub:
        pub.publish(0, writable)
        assert pub._mapped == {}
        pub.publish(1, v1)
        assert pub._mapped == {}
    same_bits(load_safetensors(tmp_path / "v0.safetensors")[0], v0)  # the copy advanced, not it
    same_bits(pulled(local_store, 1, v0), v1)
