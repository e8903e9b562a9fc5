"""Tied tensors: one tensor under two names, found by memory, stored once, restored as aliases.

Hugging Face ties the input embedding and the output head by default, so a `state_dict()`
holds the same tensor under two names. Two names are *aliases* when they are the same
memory seen the same way: same device, address, dtype, shape and strides. Equal values in
two distinct tensors are not aliases. Names whose memory overlaps in any other way (a
tensor and a slice of it) are refused with both names: patching one would change the other.

Publishing stores each tensor once and records `alias -> stored name` in the manifest (and
in an in-memory blob); `materialize`/`decode_full` give an alias the very array of its
stored name. Applying binds a subscriber's state to the published tensors: names the
subscriber ties are patched once, names it holds separately each get the stored tensor's
patch, and an alias it does not hold at all is skipped (it would hold the same bits).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from tandem.delta_sync.errors import DeltaSyncError
from tandem.delta_sync.manifest import TensorInfo
from tandem.delta_sync.tensor_view import TensorView
from tandem.delta_sync.tensors import is_torch_tensor, views_of

_CPU = -1


class _Memory(NamedTuple):
    """Where a tensor's elements lie: [start, end) bytes on a device, and how they are read."""

    device: int  # CPU: -1, CUDA: the device index
    start: int
    end: int
    layout: tuple[Any, ...]  # (dtype, shape, strides): equal for aliases
    contiguous: bool
    name: str
    obj: Any


def _extent(shape: Any, strides: Any, itemsize: int) -> tuple[int, int]:
    """[lo, hi) byte offsets a strided array spans from its first element."""
    lo = hi = 0
    for n, s in zip(shape, strides, strict=True):
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    return lo, hi + itemsize


def _memory(name: str, x: Any) -> _Memory | None:
    """None for what holds no memory (empty) or what `view_of` refuses with its own message."""
    if isinstance(x, np.ndarray):
        if x.size == 0:
            return None
        ptr = x.__array_interface__["data"][0]
        contiguous = x.flags.c_contiguous
        if contiguous:
            lo, hi = 0, x.nbytes
        else:
            lo, hi = _extent(x.shape, x.strides, x.itemsize)
        layout = (x.dtype, x.shape, x.strides)
        return _Memory(_CPU, ptr + lo, ptr + hi, layout, contiguous, name, x)
    if not is_torch_tensor(x):
        return None
    import torch  # the caller's: x is a torch tensor

    if x.layout is not torch.strided:
        return None
    if x.is_cuda:
        device = x.get_device()
    elif x.is_cpu:
        device = _CPU
    else:
        return None  # meta and other devices: view_of refuses them, naming the tensor
    numel = x.numel()
    if numel == 0:
        return None
    size, ptr, strides = x.element_size(), x.data_ptr(), x.stride()
    contiguous = x.is_contiguous()
    if contiguous:
        lo, hi = 0, numel * size
    else:
        lo, hi = _extent(x.shape, [s * size for s in strides], size)
    return _Memory(device, ptr + lo, ptr + hi, (x.dtype, x.shape, strides), contiguous, name, x)


def _host_array(m: _Memory) -> np.ndarray | None:
    """The memory as a numpy array (no copy) to ask numpy whether two really overlap."""
    if isinstance(m.obj, np.ndarray):
        return m.obj
    if m.device != _CPU:
        return None
    from tandem.delta_sync.dtypes import torch_int_view

    return torch_int_view(m.obj.detach()).numpy()


def _overlap(a: _Memory, b: _Memory) -> bool:
    """Whether two tensors whose byte ranges intersect share an element (strided views may
    interleave without sharing any)."""
    if a.contiguous and b.contiguous:
        return True
    ha, hb = _host_array(a), _host_array(b)
    if ha is None or hb is None:
        return False  # non-contiguous CUDA: read through a copy, refused when patched
    try:
        return bool(np.shares_memory(ha, hb, max_work=1 << 20))
    except np.exceptions.TooHardError:
        return True


def split_aliases(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """(tensors to store, {alias: stored name}) of a state; refuses partial overlaps.

    Of the names of one tensor, the first in sorted order is stored, the others are aliases.
    """
    if not isinstance(state, Mapping):
        raise DeltaSyncError(f"a state must be a mapping of name -> tensor, got {type(state)}")
    names = sorted(state)
    first: dict[tuple[int, int, int], _Memory] = {}  # plain ints: cheap to hash
    aliases: dict[str, str] = {}
    spans: list[_Memory] = []
    for name in names:
        m = _memory(name, state[name])
        if m is None:
            continue
        seen = first.setdefault((m.device, m.start, m.end), m)
        if seen is not m and seen.layout == m.layout:
            aliases[name] = seen.name
            continue
        spans.append(m)  # the same bytes seen another way are caught as an overlap below
    spans.sort(key=lambda m: (m.device, m.start))
    active: list[_Memory] = []
    for m in spans:
        active = [a for a in active if a.device == m.device and a.end > m.start]
        for a in active:
            if _overlap(a, m):
                one, other = sorted((a.name, m.name))
                raise DeltaSyncError(
                    f"tensors {one!r} and {other!r} share memory but are not the same "
                    "tensor (different offset, shape, dtype or strides); only one tensor under "
                    "two names (tied weights) can be published: pass a copy of one of them"
                )
        active.append(m)
    unique = {name: state[name] for name in names if name not in aliases}
    return unique, aliases


def check_same_ties(before: Mapping[str, str], now: Mapping[str, str], version: int) -> None:
    """A stream keeps the tying of its first version (the subscribers' states follow it)."""
    changed = sorted(set(before.items()) ^ set(now.items()))
    if not changed:
        return
    alias, stored = changed[0]
    first, second = sorted((alias, stored))
    tied_before = (alias, stored) in before.items()
    was = "one tied tensor" if tied_before else "separate tensors"
    now_ = "separate" if tied_before else "one tied tensor"
    raise DeltaSyncError(
        f"tensors {first!r} and {second!r} were {was} in version {version} and are {now_} "
        "now; tying must not change within a stream: publish into a new store (or prefix) "
        "to start over"
    )


def restore_aliases(arrays: dict[str, Any], aliases: Mapping[str, str]) -> dict[str, Any]:
    """Give every alias the very array (or tensor) of its stored name, in place."""
    for alias, stored in aliases.items():
        arrays[alias] = arrays[stored]
    return arrays


def bind(
    state: Mapping[str, Any],
    stored: Mapping[str, TensorInfo],
    aliases: Mapping[str, str],
    label: str,
) -> tuple[dict[str, TensorView], dict[str, TensorInfo], dict[str, str]]:
    """The views of `state` to patch, the published tensor each must become, and the stored
    name whose chunks each gets: (views, targets, sources), all keyed by the state's names.

    Every stored tensor must be in the state under its own name or one of its aliases. Names
    the state ties together are patched once; they must be one published tensor, or
    tensors published with equal contents.
    """
    if not isinstance(state, Mapping):
        raise DeltaSyncError(f"a state must be a mapping of name -> tensor, got {type(state)}")
    wanted = {n: n for n in stored if n in state}
    wanted.update({a: s for a, s in aliases.items() if a in state and s in stored})
    held = set(wanted.values())
    for name in stored:
        if name not in held:
            raise DeltaSyncError(f"{label}: the state has no tensor {name!r}; pass the full state")
    unique, tied = split_aliases({n: state[n] for n in wanted})
    for alias, kept in tied.items():
        a, k = stored[wanted[alias]], stored[wanted[kept]]
        if wanted[alias] != wanted[kept] and (a.dtype, a.shape, a.digest) != (
            k.dtype,
            k.shape,
            k.digest,
        ):
            first, second = sorted((alias, kept))
            raise DeltaSyncError(
                f"{label}: {first!r} and {second!r} are one tensor in this state (tied) but "
                "different tensors in the published version; untie them (give one its own "
                "copy) or publish them tied"
            )
    views = views_of(unique, writable=True)
    return views, {n: stored[wanted[n]] for n in views}, {n: wanted[n] for n in views}
