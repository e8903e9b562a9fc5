"""CUDA tensors: diffed and patched on the device, bit-identical to the host path."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.delta_sync import (
    BaseMismatchError,
    Publisher,
    Subscriber,
    apply_delta,
    encode_delta,
)

pytestmark = pytest.mark.gpu


def _cuda(state: dict) -> dict:
    import torch

    return {
        k: torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).cuda()
        for k, a in state.items()
    }


def test_cuda_blob_equals_host_blob_and_applies_in_place(trainer, same_bits) -> None:
    v0, v1 = trainer.snapshot(), trainer.step()
    g0, g1 = _cuda(v0), _cuda(v1)
    blob = encode_delta(g0, g1)
    assert blob == encode_delta(v0, v1)  # same bytes as the numpy implementation
    live = {k: t.clone() for k, t in g0.items()}
    ptrs = {k: t.data_ptr() for k, t in live.items()}
    apply_delta(live, blob)
    same_bits(live, v1)
    assert {k: t.data_ptr() for k, t in live.items()} == ptrs
    assert all(t.is_cuda for t in live.values())


def test_cuda_changed_positions_match_numpy(trainer) -> None:
    from tandem.delta_sync.gpu import CudaTensor
    from tandem.delta_sync.tensors import view_of

    v0, v1 = trainer.snapshot(), trainer.step()
    g0, g1 = _cuda(v0), _cuda(v1)
    for name in v0:
        new, base = view_of(name, g1[name]), view_of(name, g0[name])
        assert isinstance(new, CudaTensor)
        idx = new.changed(base, 0, new.numel)
        ref = np.flatnonzero(v1[name].view(np.uint16).ravel() != v0[name].view(np.uint16).ravel())
        assert np.array_equal(idx, ref)
        assert np.array_equal(new.gather(0, idx), v1[name].view(np.uint16).ravel()[ref])


def test_cuda_publish_and_pull_stream(local_store, trainer, same_bits) -> None:
    from tandem.delta_sync.gpu import CudaTensor

    pub = Publisher(local_store, anchor_every=3, chunk_bytes=1 << 16, shard_bytes=1 << 16)
    first = trainer.step()
    pub.publish(0, _cuda(first))
    assert all(isinstance(v, CudaTensor) for v in pub._prev.values())  # base stays on device
    engine = _cuda(first)
    sub = Subscriber(local_store, version=0)
    for v in range(1, 5):
        state = trainer.step()
        pub.publish(v, _cuda(state))
        sub.pull(engine)
        same_bits(engine, state)


def test_cuda_wrong_base_is_undone(trainer, same_bits) -> None:
    v0, v1, v2 = trainer.snapshot(), trainer.step(), trainer.step()
    blob = encode_delta(_cuda(v1), _cuda(v2))
    live = _cuda(v0)
    with pytest.raises(BaseMismatchError):
        apply_delta(live, blob)
    same_bits(live, v0)


def test_cuda_tied_weights_are_stored_once_and_pulled_onto_a_tied_engine(
    local_store, trainer, same_bits
) -> None:
    pub = Publisher(local_store, chunk_bytes=1 << 16, shard_bytes=1 << 16)
    engine = _cuda(trainer.snapshot())
    engine["lm_head"] = engine["embed"]  # tied on the device, as Hugging Face ties them
    sub = Subscriber(local_store)
    for v in range(3):
        state = _cuda(trainer.step())
        state["lm_head"] = state["embed"]
        pub.publish(v, state)
        sub.pull(engine)
        same_bits(engine, state)
    assert sub.manifest(2).aliases() == {"lm_head": "embed"}
    assert engine["lm_head"].data_ptr() == engine["embed"].data_ptr()
