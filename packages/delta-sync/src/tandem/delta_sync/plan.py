"""Predict one step of weight sync before buying the cluster: bytes per link, times, bottleneck.

The model follows what the code does, stage by stage:

1. The trainer encodes the whole state (every chunk is compared) at the measured encode
   throughput per core, streaming shards to the origin store as they fill.
2. The version becomes visible (manifest, then `latest`) only when every shard is in.
3. Every engine (or its region's relay) is already waiting for the next version's
   manifest with a long-poll (`Subscriber.prepare(wait=...)`), held by the origin, so the
   manifest reaches it half a round trip after the commit (a polling engine: one round
   trip, asking for `latest` and the manifest together); then it asks for the shards,
   `download_workers` at a time, over kept-alive connections: one round trip each wave
   before its first byte. A relay takes each shard from the origin once and serves it to
   its engines once it is in.
4. Links share their rate fairly between the flows crossing them (max-min, water-filling),
   re-shared as flows start and finish: the trainer's uplink between the regions pulling
   at once (a nearer region starts sooner and has it alone until the farther ones start),
   a region's link between its engines when there is no relay.
5. Each engine stages the delta and applies it (the pause): every chunk of the model is
   patched and hashed, at the measured decode+apply throughput per core.

The delta's size comes from the changed fraction: each changed weight costs the entropy
of its position, H(c)/c bits, plus the bits of its value difference, measured by
`delta-sync bench` (about 2-3 bits for Adam's one-ulp moves). What it leaves out is said
in `Plan.notes`.
"""

from __future__ import annotations

import math

import msgspec

GBIT = 1e9 / 8  # bytes per second in a Gbit/s


class Codec(msgspec.Struct, frozen=True):
    """Throughputs per core (GB of dense state per CPU-second) and compression figures,
    as `delta-sync bench --json` measures them on the machine at hand."""

    encode_gbps_core: float
    apply_gbps_core: float
    value_bits: float = 2.8  # bits per changed weight beyond its position's entropy
    full_ratio: float = 1.3  # dense bytes / bytes of a full snapshot (an anchor)
    full_encode_gbps_core: float = 0.5  # zstd-1 per core, for the full-snapshot baseline
    full_apply_gbps_core: float = 1.5
    measured_on: str = "defaults"


class Region(msgspec.Struct, frozen=True):
    name: str
    engines: int
    rate_gbit: float  # the link between the trainer's uplink and this region
    rtt_ms: float  # round trip between the region and the origin
    relay: bool = True
    in_region_gbit: float = 25.0  # the relay's (or the region's) link to its engines


class Scenario(msgspec.Struct, frozen=True):
    model_bytes: float
    regions: list[Region]
    uplink_gbit: float  # the origin's link to the world, shared by every region
    itemsize: int = 2
    changed: float = 0.02
    shard_bytes: int = 32 << 20
    trainer_cores: int = 8  # all ranks' encode workers together
    engine_cores: int = 8  # the workers applying one engine's copy
    download_workers: int = 8
    store_gbit: float = 25.0  # trainer -> origin store (same datacenter)
    long_poll: bool = True  # engines wait for the next manifest (False: they poll `latest`)


class RegionTime(msgspec.Struct):
    name: str
    bytes_in: float  # over the region's link
    rate_gbit: float  # its share of the path
    fetch_s: float
    done_s: float  # from the start of the step to its last engine applied


class Plan(msgspec.Struct):
    delta_bytes: float
    uplink_bytes: float
    prepare_s: float  # the trainer: encode + upload + commit
    apply_s: float  # each engine's pause
    total_s: float  # to every engine applied
    bottleneck: str
    regions: list[RegionTime]
    notes: list[str]


def binary_entropy(p: float) -> float:
    if p <= 0 or p >= 1:
        return 0.0
    return -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def value_bits_from(ratio: float, changed: float, itemsize: int) -> float:
    """The value bits per change implied by a measured ratio at a measured changed fraction."""
    bits_per_change = 8 * itemsize / (ratio * changed)
    return max(0.0, bits_per_change - binary_entropy(changed) / changed)


def delta_bytes(s: Scenario, codec: Codec) -> float:
    n = s.model_bytes / s.itemsize
    k = n * s.changed
    return k * (binary_entropy(s.changed) / s.changed + codec.value_bits) / 8 if k else 0.0


def fair_shares(capacity: float, demands: list[float]) -> list[float]:
    """Max-min fair split of `capacity` between flows each capped at its demand."""
    out = [0.0] * len(demands)
    left, todo = capacity, sorted(range(len(demands)), key=lambda i: demands[i])
    while todo:
        share = left / len(todo)
        i = todo[0]
        if demands[i] <= share:
            out[i] = demands[i]
            left -= demands[i]
            todo.pop(0)
        else:
            for j in todo:
                out[j] = share
            break
    return out


def transfer_ends(
    capacity: float, caps: list[float], starts: list[float], sizes: list[float]
) -> list[float]:
    """When each flow's last byte is through: flows starting at `starts` (s) with `sizes`
    (bytes), each capped at its own rate (`caps`, bytes/s), share `capacity` max-min fairly
    while they are active, re-shared each time one starts or finishes (a region that
    learns of the version sooner has the link to itself until the others start)."""
    n = len(sizes)
    left, ends = list(sizes), [math.inf] * n
    for i in range(n):
        if sizes[i] <= 0:
            ends[i] = starts[i]
    t = min(starts, default=0.0)
    for _ in range(2 * n + 1):  # each round starts or finishes at least one flow
        todo = [i for i in range(n) if ends[i] == math.inf]
        if not todo:
            break
        active = [i for i in todo if starts[i] <= t]
        later = [starts[i] for i in todo if starts[i] > t]
        if not active:
            t = min(later)
            continue
        rates = fair_shares(capacity, [caps[i] for i in active])
        dt = min(left[i] / r for i, r in zip(active, rates, strict=True))
        if later:
            dt = min(dt, min(later) - t)
        for i, r in zip(active, rates, strict=True):
            left[i] -= r * dt
            if left[i] <= 1e-9 * sizes[i]:
                ends[i] = t + dt
        t += dt
    return ends


def plan(s: Scenario, codec: Codec, *, payload: float | None = None, full: bool = False) -> Plan:
    """One step of `s` (or, with `full`, a full snapshot through the same topology)."""
    if not s.regions:
        raise ValueError("a topology needs at least one region")
    size = s.model_bytes
    d = (
        payload
        if payload is not None
        else (size / codec.full_ratio if full else delta_bytes(s, codec))
    )
    enc = codec.full_encode_gbps_core if full else codec.encode_gbps_core
    app = codec.full_apply_gbps_core if full else codec.apply_gbps_core
    encode_s = size / (enc * 1e9 * s.trainer_cores)
    upload_s = d / (s.store_gbit * GBIT)
    prepare_s = max(encode_s, upload_s) + 0.01  # streaming; the commit is two small writes
    apply_s = size / (app * 1e9 * s.engine_cores)
    shards = max(1, math.ceil(d / s.shard_bytes))
    # flows over the uplink: one per relay, one per engine without; each capped by its
    # share of the region's link
    flows = [1 if r.relay else r.engines for r in s.regions]
    caps = [r.rate_gbit / f for r, f in zip(s.regions, flows, strict=True) for _ in range(f)]
    waves = math.ceil(shards / s.download_workers)
    # the manifest: half a round trip after the commit for a held long-poll, a round trip
    # for a poll (`latest` and the manifest together); then one per wave of shards
    latencies = [
        (r.rtt_ms / 2e3 if s.long_poll else r.rtt_ms / 1e3) + waves * r.rtt_ms / 1e3
        for r in s.regions
    ]
    starts = [lat for lat, f in zip(latencies, flows, strict=True) for _ in range(f)]
    ends = transfer_ends(s.uplink_gbit * GBIT, [c * GBIT for c in caps], starts, [d] * len(caps))
    times, fan_outs, pos = [], [], 0
    for r, f, latency in zip(s.regions, flows, latencies, strict=True):
        wire_end = max(ends[pos : pos + f])  # the region's flows, counted from the commit
        pos += f
        fan_out = r.engines * d / (r.in_region_gbit * GBIT) if r.relay else 0.0
        fetch = max(wire_end, latency + fan_out)
        rate = d * f / GBIT / max(wire_end - latency, 1e-12)  # its average share
        fan_outs.append(fan_out)
        times.append(RegionTime(r.name, d * f, rate, fetch, prepare_s + fetch + apply_s))
    total = max(t.done_s for t in times)
    slowest = max(range(len(times)), key=lambda i: times[i].done_s)
    stages = {
        "trainer encode": encode_s,
        "origin uplink": sum(t.bytes_in for t in times) / (s.uplink_gbit * GBIT),
        f"{times[slowest].name} link": times[slowest].bytes_in
        / (s.regions[slowest].rate_gbit * GBIT),
        f"{times[slowest].name} round trips": latencies[slowest],
        f"{times[slowest].name} fan-out to engines": fan_outs[slowest],
        "engine apply": apply_s,
    }
    notes = [
        f"codec throughputs: {codec.measured_on}",
        "links are shared fairly; TCP windows are assumed large enough for each link's "
        "bandwidth-delay product (tuned hosts), so round trips add latency, not a rate cap",
        "engines wait for the next manifest with a long-poll"
        if s.long_poll
        else "engines poll `latest` right after the commit (no polling interval added)",
    ]
    return Plan(
        delta_bytes=d,
        uplink_bytes=sum(t.bytes_in for t in times),
        prepare_s=prepare_s,
        apply_s=apply_s,
        total_s=total,
        bottleneck=max(stages, key=stages.__getitem__),
        regions=times,
        notes=notes,
    )
