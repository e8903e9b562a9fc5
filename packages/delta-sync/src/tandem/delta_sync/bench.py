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


def _best_time(fn: Callable[[], object], repeat: int) -> float:
    best = math.inf
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


@dataclass
class Row:
    lr: float
    changed: float
    ratio: float
    bound: float
    full_zstd: float
    xor_zstd: float
    encode_1: float = 0.0
    encode_all: float = 0.0
    decode_1: float = 0.0
    decode_all: float = 0.0
    stores: dict[str, tuple[float, float]] = field(default_factory=dict)  # (delta s, full s)


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
    for w, enc_attr, dec_attr in (
        (1, "encode_1", "decode_1"),
        (workers, "encode_all", "decode_all"),
    ):
        setattr(
            row, enc_attr, gb / _best_time(lambda w=w: encode_delta(base, new, workers=w), repeat)
        )
        best = math.inf
        for _ in range(repeat):
            target = {k: v.copy() for k, v in base.items()}
            t = time.perf_counter()
            apply_delta(target, blob, workers=w)
            best = min(best, time.perf_counter() - t)
        setattr(row, dec_attr, gb / best)
    assert all(np.array_equal(_bits(target[k]), _bits(new[k])) for k in new), "not bit-exact"
    return row


def publish_pull_seconds(
    make_store: Callable[[str], Store], base: State, new: State, workers: int
) -> tuple[float, float]:
    """(publish delta + pull it, publish full snapshot + pull it) through fresh stores."""
    store = make_store("delta")
    pub = Publisher(store, anchor_every=1 << 30, workers=workers, catchup=False)
    pub.publish(0, base)
    engine = {k: v.copy() for k, v in base.items()}
    sub = Subscriber(store, workers=workers)
    sub.pull(engine)
    t = time.perf_counter()
    pub.publish(1, new)
    sub.pull(engine)
    delta_s = time.perf_counter() - t
    full_store = make_store("full")
    t = time.perf_counter()
    Publisher(full_store, workers=workers).publish(1, new)
    fresh = {k: np.empty_like(v) for k, v in new.items()}
    Subscriber(full_store, workers=workers).pull(fresh)
    full_s = time.perf_counter() - t
    assert all(np.array_equal(_bits(engine[k]), _bits(new[k])) for k in new)
    assert all(np.array_equal(_bits(fresh[k]), _bits(new[k])) for k in new)
    return delta_s, full_s


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


def moe_shapes(target_bytes: int, d: int = 1024, experts: int = 16) -> dict[str, tuple[int, ...]]:
    """A Qwen3-MoE-like layout (embeddings, GQA attention, router, stacked experts)."""
    ff, vocab, kv = d // 2, 16384, d // 4
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
    stores = list(rows[0].stores) if rows else []
    head = (
        f"{'lr':>8} {'changed':>8} {'ours':>7} {'bound':>7} {'ours/bnd':>8} {'zstd':>6} "
        f"{'xor+zstd':>8} {'enc GB/s':>9} {'enc GB/s':>9} {'dec GB/s':>9} {'dec GB/s':>9}"
    )
    sub = f"{'':>8} {'':>8} {'':>7} {'':>7} {'':>8} {'':>6} {'':>8} {'1 core':>9} "
    sub += f"{f'{workers} thr':>9} {'1 core':>9} {f'{workers} thr':>9}"
    for s in stores:
        head += f" {s + ' delta/full s':>22} {'speedup':>7}"
        sub += f" {'':>22} {'':>7}"
    lines = [head, sub]
    for r in rows:
        line = (
            f"{r.lr:>8.1e} {100 * r.changed:>7.2f}% {r.ratio:>6.1f}x {r.bound:>6.1f}x "
            f"{r.ratio / r.bound:>8.2f} {r.full_zstd:>5.2f}x {r.xor_zstd:>7.1f}x "
            f"{r.encode_1:>9.2f} {r.encode_all:>9.2f} {r.decode_1:>9.2f} {r.decode_all:>9.2f}"
        )
        for s in stores:
            d, f = r.stores[s]
            line += f" {f'{d:.3f} / {f:.3f}':>22} {f / d:>6.1f}x"
        lines.append(line)
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
            row.stores[name] = publish_pull_seconds(factory, base, new, workers)
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
