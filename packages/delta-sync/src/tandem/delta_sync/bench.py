"""Measurements behind `delta-sync bench` and benchmarks/delta_sync.py, side by side.

For each pair of consecutive bf16 snapshots it measures: the changed fraction; our ratio;
the order-0 entropy bound of that delta (changed-mask entropy + entropy of the bit-pattern
differences); full-snapshot zstd and XOR+zstd ratios; encode and decode+apply throughput
(GB/s of dense bytes) on one worker and on all; and publish-then-pull wall time of the
delta against a full snapshot through the same store.

`adam_snapshots` makes the pairs without torch: Adam (bias-corrected, as in Kingma & Ba)
on fp32 master weights of a transformer/MoE-shaped state, with a bf16 snapshot per step.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import zstandard

from tandem.delta_sync.delta import apply_delta, encode_delta
from tandem.delta_sync.publisher import Publisher
from tandem.delta_sync.stores.base import Store
from tandem.delta_sync.subscriber import Subscriber

State = dict[str, np.ndarray]


def _bits(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(f"u{a.itemsize}")


def dense_bytes(state: Mapping[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in state.values())


def changed_fraction(base: State, new: State) -> float:
    n = sum(a.size for a in new.values())
    k = sum(int(np.count_nonzero(_bits(base[k]) != _bits(new[k]))) for k in new)
    return k / n


def entropy_bound_bytes(base: State, new: State) -> float:
    """Order-0 bound: n*H(k/n) for the changed mask + k*H(differences) for the values."""
    n, counts = 0, {}
    for name, a in new.items():
        b, o = _bits(a), _bits(base[name])
        n += b.size
        idx = np.flatnonzero(b != o)
        diff = (b[idx] - o[idx]).astype(np.uint64) + (a.itemsize << 56)  # per-width symbols
        vals, cnt = np.unique(diff, return_counts=True)
        for v, c in zip(vals.tolist(), cnt.tolist(), strict=True):
            counts[v] = counts.get(v, 0) + c
    k = sum(counts.values())
    if k == 0:
        return 0.0
    p = k / n
    mask_bits = n * (-(p * math.log2(p)) - ((1 - p) * math.log2(1 - p) if p < 1 else 0.0))
    c = np.array(list(counts.values()), np.float64)
    value_bits = float(-(c * np.log2(c / k)).sum())
    return (mask_bits + value_bits) / 8


def _zstd_bytes(chunks: Iterator[np.ndarray], workers: int, level: int = 1) -> int:
    def one(a: np.ndarray) -> int:
        return len(zstandard.ZstdCompressor(level=level).compress(a.data))

    with ThreadPoolExecutor(workers) as pool:
        return sum(pool.map(one, chunks))


def _chunks(state: State, step: int = 4 << 20) -> Iterator[np.ndarray]:
    for a in state.values():
        b = a.reshape(-1).view(np.uint8)
        for s in range(0, b.size, step):
            yield np.ascontiguousarray(b[s : s + step])


def full_zstd_ratio(state: State, workers: int) -> float:
    return dense_bytes(state) / _zstd_bytes(_chunks(state), workers)


def xor_zstd_ratio(base: State, new: State, workers: int) -> float:
    xored = {k: (_bits(new[k]) ^ _bits(base[k])) for k in new}
    return dense_bytes(new) / _zstd_bytes(_chunks(xored), workers)


def _best(fn: Callable[[], object], repeat: int, setup: Callable[[], object] | None = None):
    """(best wall seconds, best process CPU seconds) over `repeat` runs.

    CPU seconds (all threads of this process) make a per-core figure that does not depend
    on how busy a shared machine is; wall seconds are what a user waits.
    """
    wall = cpu = math.inf
    for _ in range(repeat):
        arg = setup() if setup is not None else None
        w, c = time.perf_counter(), time.process_time()
        fn() if arg is None else fn(arg)  # type: ignore[call-arg]
        wall = min(wall, time.perf_counter() - w)
        cpu = min(cpu, time.process_time() - c)
    return wall, cpu


@dataclass
class Row:
    lr: float
    changed: float
    ratio: float
    bound: float
    full_zstd: float
    xor_zstd: float
    encode_1: float = 0.0  # GB/s of dense bytes, one worker, wall clock
    encode_cpu: float = 0.0  # GB per CPU-second (per core, independent of machine load)
    encode_all: float = 0.0  # GB/s, all workers, wall clock
    decode_1: float = 0.0
    decode_cpu: float = 0.0
    decode_all: float = 0.0
    # store -> (delta wall s, full wall s, delta cpu s, full cpu s)
    stores: dict[str, tuple[float, float, float, float]] = field(default_factory=dict)


def measure_codec(base: State, new: State, workers: int, repeat: int = 2) -> Row:
    n = dense_bytes(new)
    blob = encode_delta(base, new, workers=workers)
    bound = entropy_bound_bytes(base, new)
    row = Row(
        lr=0.0,
        changed=changed_fraction(base, new),
        ratio=n / len(blob),
        bound=n / bound if bound else math.inf,
        full_zstd=full_zstd_ratio(new, workers),
        xor_zstd=xor_zstd_ratio(base, new, workers),
    )
    gb = n / 1e9
    targets: list[State] = []

    def fresh() -> State:
        targets.append({k: v.copy() for k, v in base.items()})
        return targets[-1]

    wall, cpu = _best(lambda: encode_delta(base, new, workers=1), repeat)
    row.encode_1, row.encode_cpu = gb / wall, gb / cpu
    row.encode_all = gb / _best(lambda: encode_delta(base, new, workers=workers), repeat)[0]
    wall, cpu = _best(lambda t: apply_delta(t, blob, workers=1), repeat, fresh)
    row.decode_1, row.decode_cpu = gb / wall, gb / cpu
    row.decode_all = gb / _best(lambda t: apply_delta(t, blob, workers=workers), repeat, fresh)[0]
    for t in targets:
        assert all(np.array_equal(_bits(t[k]), _bits(new[k])) for k in new), "not bit-exact"
    return row


def publish_pull_seconds(
    make_store: Callable[[str], Store], base: State, new: State, workers: int, repeat: int = 1
) -> tuple[float, float, float, float]:
    """Publish then pull, delta vs full snapshot, through fresh stores of one kind.

    Returns (delta wall s, full wall s, delta CPU s, full CPU s), each the best of `repeat`
    runs (the two sides alternate, so a busy spell of the machine hits both). The delta
    side starts with version 0 published and pulled by a running publisher and subscriber
    (what a trainer and an engine following the stream are); the full side publishes into
    an empty store and pulls into empty arrays.
    """
    best = [math.inf] * 4
    for _ in range(repeat):
        delta = _delta_publish_pull(make_store("delta"), base, new, workers)
        full = _full_publish_pull(make_store("full"), new, workers)
        for i, x in enumerate((delta[0], full[0], delta[1], full[1])):
            best[i] = min(best[i], x)
    return best[0], best[1], best[2], best[3]


def _delta_publish_pull(store: Store, base: State, new: State, workers: int) -> tuple[float, float]:
    pub = Publisher(store, anchor_every=1 << 30, workers=workers, catchup=False)
    pub.publish(0, base)
    engine = {k: np.empty_like(v) for k, v in base.items()}
    sub = Subscriber(store, workers=workers)
    sub.pull(engine)  # a running engine: it follows the stream, so it is at version 0
    w, c = time.perf_counter(), time.process_time()
    pub.publish(1, new)
    sub.pull(engine)
    seconds = (time.perf_counter() - w, time.process_time() - c)
    pub.close()
    sub.close()
    assert all(np.array_equal(_bits(engine[k]), _bits(new[k])) for k in new)
    return seconds


def _full_publish_pull(store: Store, new: State, workers: int) -> tuple[float, float]:
    fresh = {k: np.empty_like(v) for k, v in new.items()}
    w, c = time.perf_counter(), time.process_time()
    with Publisher(store, workers=workers) as full_pub:
        full_pub.publish(1, new)
    with Subscriber(store, workers=workers) as full_sub:
        full_sub.pull(fresh)
    seconds = (time.perf_counter() - w, time.process_time() - c)
    assert all(np.array_equal(_bits(fresh[k]), _bits(new[k])) for k in new)
    return seconds


class LocalStoreFactory:
    """Fresh LocalStore directories under `root`; `cleanup` removes them."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.made: list[str] = []

    def __call__(self, tag: str) -> Store:
        from tandem.delta_sync.stores.local import LocalStore

        path = os.path.join(self.root, f"{tag}-{len(self.made)}")
        self.made.append(path)
        return LocalStore(path)

    def cleanup(self) -> None:
        import shutil

        for path in self.made:
            shutil.rmtree(path, ignore_errors=True)
        self.made.clear()


def moe_shapes(
    target_bytes: int, d: int | None = None, experts: int = 16
) -> dict[str, tuple[int, ...]]:
    """A Qwen3-MoE-like layout (embeddings, GQA attention, router, stacked experts)."""
    d = d or (1024 if target_bytes >= 64 << 20 else 256)
    vocab = int(np.clip(target_bytes // (16 * d), 512, 16384))
    ff, kv = d // 2, d // 4
    layer = {
        "self_attn.q_proj.weight": (d, d),
        "self_attn.k_proj.weight": (kv, d),
        "self_attn.v_proj.weight": (kv, d),
        "self_attn.o_proj.weight": (d, d),
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
        "mlp.gate.weight": (experts, d),
        "mlp.experts.gate_proj": (experts, ff, d),
        "mlp.experts.up_proj": (experts, ff, d),
        "mlp.experts.down_proj": (experts, d, ff),
    }
    per_layer = 2 * sum(math.prod(s) for s in layer.values())
    fixed = 2 * 2 * vocab * d
    layers = max(1, math.ceil((target_bytes - fixed) / per_layer))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, d)}
    for i in range(layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    shapes["model.norm.weight"] = (d,)
    shapes["lm_head.weight"] = (vocab, d)
    return shapes


def adam_snapshots(
    shapes: Mapping[str, tuple[int, ...]],
    lrs: list[float],
    *,
    warmup: int = 3,
    active_experts: float = 0.5,
    seed: int = 0,
) -> Iterator[tuple[float, State, State]]:
    """(lr, bf16 snapshot before, after) for one Adam step at each lr, after a warmup.

    Gradients are Gaussian with per-row scales (so Adam's normalisation sees a realistic
    spread); expert tensors get gradient only for the experts a step routes to.
    """
    rng = np.random.default_rng(seed)
    master = {}
    for k, s in shapes.items():
        master[k] = (
            np.ones(s, np.float32) if "norm" in k else rng.normal(0, 0.02, s).astype(np.float32)
        )
    m = {k: np.zeros_like(v) for k, v in master.items()}
    v2 = {k: np.zeros_like(v) for k, v in master.items()}
    scales = {
        k: rng.lognormal(0, 1, (s[0],) + (1,) * (len(s) - 1)).astype(np.float32)
        for k, s in shapes.items()
    }
    b1, b2, eps = 0.9, 0.999, 1e-8
    step = 0

    def adam(lr: float) -> None:
        nonlocal step
        step += 1
        for k, w in master.items():
            g = rng.standard_normal(w.shape, np.float32) * scales[k]
            if "experts" in k:
                g *= rng.random((w.shape[0],) + (1,) * (w.ndim - 1)) < active_experts
            m[k] *= b1
            m[k] += (1 - b1) * g
            v2[k] *= b2
            v2[k] += (1 - b2) * g * g
            mhat = m[k] / (1 - b1**step)
            vhat = v2[k] / (1 - b2**step)
            w -= lr * mhat / (np.sqrt(vhat) + eps)

    for _ in range(warmup):
        adam(float(np.median(lrs)))
    for lr in lrs:
        before = {k: w.astype(ml_dtypes.bfloat16) for k, w in master.items()}
        adam(lr)
        yield lr, before, {k: w.astype(ml_dtypes.bfloat16) for k, w in master.items()}


def format_table(rows: list[Row], workers: int) -> str:
    """One line per step; GB/s are of dense bytes, 'cpu' columns are GB per CPU-second,
    'scale' is all workers' throughput over one worker's (the multi-core scaling)."""
    stores = list(rows[0].stores) if rows else []
    cols = [
        ("lr", 8), ("changed", 8), ("ours", 7), ("bound", 7), ("ours/bnd", 8),
        ("zstd", 6), ("xor+zstd", 8),
        ("enc 1thr", 8), ("enc cpu", 7), (f"enc {workers}thr", 8), ("scale", 5),
        ("dec 1thr", 8), ("dec cpu", 7), (f"dec {workers}thr", 8), ("scale", 5),
    ]  # fmt: skip
    for s in stores:
        cols += [(f"{s} delta/full wall s", 22), ("x", 5), (f"{s} delta/full cpu s", 21), ("x", 5)]
    lines = [" ".join(f"{name:>{w}}" for name, w in cols)]
    for r in rows:
        cells = [
            f"{r.lr:.1e}", f"{100 * r.changed:.2f}%", f"{r.ratio:.1f}x", f"{r.bound:.1f}x",
            f"{r.ratio / r.bound:.2f}", f"{r.full_zstd:.2f}x", f"{r.xor_zstd:.1f}x",
            f"{r.encode_1:.2f}", f"{r.encode_cpu:.2f}", f"{r.encode_all:.2f}",
            f"{r.encode_all / r.encode_1:.2f}",
            f"{r.decode_1:.2f}", f"{r.decode_cpu:.2f}", f"{r.decode_all:.2f}",
            f"{r.decode_all / r.decode_1:.2f}",
        ]  # fmt: skip
        for s in stores:
            dw, fw, dc, fc = r.stores[s]
            cells += [
                f"{dw:.3f} / {fw:.3f}",
                f"{fw / dw:.1f}",
                f"{dc:.2f} / {fc:.2f}",
                f"{fc / dc:.1f}",
            ]
        lines.append(" ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, cols, strict=True)))
    return "\n".join(lines)


def run(
    pairs: Iterator[tuple[float, State, State]],
    *,
    workers: int,
    stores: dict[str, Callable[[str], Store]] | None = None,
    repeat: int = 2,
    echo: Callable[[str], None] | None = None,
) -> list[Row]:
    rows = []
    for lr, base, new in pairs:
        row = measure_codec(base, new, workers, repeat)
        row.lr = lr
        for name, factory in (stores or {}).items():
            row.stores[name] = publish_pull_seconds(factory, base, new, workers, repeat)
            cleanup = getattr(factory, "cleanup", None)
            if cleanup is not None:  # keep disk / object-store memory bounded between rows
                cleanup()
        rows.append(row)
        if echo is not None:
            echo(
                f"lr {lr:.1e}: {100 * row.changed:.2f}% changed, {row.ratio:.1f}x "
                f"(bound {row.bound:.1f}x)"
            )
    return rows


def default_local_stores() -> tuple[tempfile.TemporaryDirectory, dict[str, Callable[[str], Store]]]:
    tmp = tempfile.TemporaryDirectory(prefix="delta-sync-bench-")
    return tmp, {"local": LocalStoreFactory(tmp.name)}
