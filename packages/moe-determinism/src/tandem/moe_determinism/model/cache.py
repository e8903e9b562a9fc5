"""KV cache with slots, for batched decoding of sequences that start and end at different times.

An inference engine owns one `KVCache` with `max_slots` rows; each live sequence holds a slot.
A forward pass over any subset of slots appends the new tokens of each sequence at its own
current length (prefill of a new turn and one-token decode look the same), so episodes can
join, grow by whole turns, and leave independently. Token t of a sequence is stored at
position t, which is what batch-invariant attention needs: the KV splits of a sequence are
aligned to its own first token, whatever the other slots hold.

`origins` records which slots hold the same bits in a KV split (`kv_split_size` positions):
`copy_prefix` makes the copied splits share the source's origin, so attention can read a
split once for every row that holds it (a GRPO group's shared prompt). A slot whose length
drops below a split hands that split's origin role to another slot that still holds it.
"""

from __future__ import annotations

import torch

from tandem.moe_determinism.errors import MoEDeterminismError
from tandem.moe_determinism.model.config import MoEConfig
from tandem.moe_determinism.ops.tiles import aligned_zeros


class KVCache:
    def __init__(
        self,
        config: MoEConfig,
        max_slots: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.split = config.kv_split_size
        splits = -(-max_len // self.split)
        # Storage in whole splits: batch-invariant attention reads a slot's splits straight
        # from the cache only when its length is a whole number of splits (otherwise it
        # copies every row's keys out first, each step). Positions past max_len stay unused.
        # On the CPU each position's row starts on a 64-byte boundary (`aligned_zeros`): the
        # attention's products read the splits in place instead of copying them, whatever
        # the head width (24 floats are 96 bytes).
        shape = (max_slots, config.kv_heads, splits * self.split, config.attn_head_dim)
        cpu = torch.device(device).type == "cpu"

        def zeros() -> torch.Tensor:
            if cpu:
                return aligned_zeros(shape, dtype, device)
            return torch.zeros(shape, dtype=dtype, device=device)

        self.keys = [zeros() for _ in range(config.num_hidden_layers)]
        self.values = [zeros() for _ in range(config.num_hidden_layers)]
        self.lengths = torch.zeros(max_slots, dtype=torch.long)
        self.max_slots, self.max_len = max_slots, max_len
        # origins[i, s]: a slot whose split s holds the bits of slot i's split s (i itself
        # unless a copy made them equal); only ever another slot for a split both hold whole.
        self.origins = torch.arange(max_slots)[:, None].repeat(1, splits)

    def reset(self, slot: int) -> None:
        """Free a slot for a new sequence (the stale keys are masked by length, not cleared)."""
        self._check_slot(slot)
        self.lengths[slot] = 0
        self._forget_splits(slot, 0)

    def truncate(self, slot: int, length: int) -> None:
        """Drop tokens after `length` (e.g. a rejected suffix)."""
        self._check_slot(slot)
        if not 0 <= length <= int(self.lengths[slot]):
            raise MoEDeterminismError(
                f"cannot truncate slot {slot} of length {int(self.lengths[slot])} to {length}"
            )
        self.lengths[slot] = length
        self._forget_splits(slot, length)

    def copy_prefix(self, src: int, dst: int, end: int) -> None:
        """Extend ``dst`` to length ``end`` with ``src``'s keys and values at those positions
        (the caller guarantees both sequences hold the same tokens up to ``end``)."""
        self._check_slot(src)
        self._check_slot(dst)
        start = int(self.lengths[dst])
        if not start <= end <= int(self.lengths[src]):
            raise MoEDeterminismError(
                f"cannot extend slot {dst} (length {start}) to {end} from slot {src} "
                f"(length {int(self.lengths[src])})"
            )
        for cache in (*self.keys, *self.values):
            cache[dst, :, start:end] = cache[src, :, start:end]
        self.lengths[dst] = end
        # whole splits copied in full now hold the bits of the source's: they share its origin
        first, last = -(-start // self.split), end // self.split
        if last > first:
            self.origins[dst, first:last] = self.origins[src, first:last]

    def _forget_splits(self, slot: int, length: int) -> None:
        """``slot`` keeps only its first ``length`` positions: from its first split no longer
        whole, it is its own origin, and the slots that named it as theirs name another
        holder of the same bits (the lowest such slot), or themselves."""
        tail = self.origins[:, length // self.split :]
        named = tail == slot
        named[slot] = False
        heir = named.to(torch.int8).argmax(0)  # the first slot naming it, per split
        tail.copy_(torch.where(named, heir[None, :], tail))
        tail[slot] = slot

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_slots:
            raise MoEDeterminismError(f"slot {slot} out of range [0, {self.max_slots})")

    def check_room(self, slots: torch.Tensor, new_tokens: torch.Tensor) -> None:
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= self.max_slots):
            raise MoEDeterminismError(
                f"slots must be in [0, {self.max_slots}), got {slots.tolist()}"
            )
        if len(set(slots.tolist())) != slots.numel():
            raise MoEDeterminismError(f"a slot appears twice in one forward pass: {slots.tolist()}")
        end = self.lengths[slots] + new_tokens
        if bool((end > self.max_len).any()):
            raise MoEDeterminismError(
                f"KV cache full: slots {slots.tolist()} would reach lengths {end.tolist()} > "
                f"max_len={self.max_len}; allocate a larger cache or end those sequences"
            )
