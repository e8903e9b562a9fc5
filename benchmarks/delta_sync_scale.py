"""How delta-sync's time and memory grow with the model: 256 MB to 8 GB and beyond.

For each size the script writes two bf16 safetensors files, version 0 and version 1 (about
`--changed` of the weights moved by one or two ulps, in runs like Adam's), then measures,
each in a fresh process so that its peak memory is its own:

    anchor publish   Publisher(mapped_base=True) publishes version 0 from the read-only
                     memory-mapped file, which it keeps as its base (`--base copy`: a
                     memory-mapped copy of it under base_dir, patched in place each step)
    delta publish    the same publisher publishes version 1 against it
    delta pull       an engine at version 0 (a memory-mapped copy, patched in place) pulls 1
                     through a shard cache directory (shards and decoded streams staged
                     in files there, memory-mapped)
    anchor pull      a fresh engine (a memory-mapped empty file) pulls version 0 through a
                     shard cache directory (staged shards memory-mapped, not in memory)

Memory is the process's anonymous resident memory (RssAnon: what it allocated itself, not
the page cache of the memory-mapped files), sampled every 5 ms; `extra` is its peak minus
what it held before the operation. Both results are checked bit for bit against the files.

    uv run python benchmarks/delta_sync_scale.py [--sizes 0.25,1,2,4] [--dir /tmp/x]
    uv run python benchmarks/delta_sync_scale.py --sizes 8   # the big point
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import structlog

from tandem.delta_sync import LocalStore, Publisher, Subscriber, load_safetensors, warm_up
from tandem.delta_sync.bench import moe_shapes

SHARD = 32 << 20


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) << 10
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakAnon:
    """Peak RssAnon while the block runs, sampled by a thread every 5 ms."""

    def __enter__(self) -> PeakAnon:
        self.before = self.peak = rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_anon())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())

    @property
    def extra(self) -> int:
        return self.peak - self.before


def write_states(directory: Path, size: int, changed: float, seed: int = 0) -> dict:
    """v0.safetensors and v1.safetensors of about `size` bytes, written tensor by tensor
    into memory-mapped files (never a whole state in memory)."""
    shapes = moe_shapes(size, d=2048 if size >= 1 << 30 else None)
    header, offset = {}, 0
    for name, shape in shapes.items():
        nbytes = 2 * math.prod(shape)
        header[name] = {
            "dtype": "BF16",
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(1 << 24, np.float32) * 0.02).view(np.uint32) >> 16
    pool = pool.astype(np.uint16)  # 32 MiB of bf16 bit patterns, tiled with offsets
    for tag in ("v0", "v1"):
        path = directory / f"{tag}.safetensors"
        with open(path, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            f.truncate(8 + len(raw) + offset)
    files = {t: np.memmap(directory / f"{t}.safetensors", np.uint8, "r+") for t in ("v0", "v1")}
    moved = 0
    for i, meta in enumerate(header.values()):
        b, e = (8 + len(raw) + x for x in meta["data_offsets"])
        v0, v1 = files["v0"][b:e].view(np.uint16), files["v1"][b:e].view(np.uint16)
        for s in range(0, v0.size, pool.size):
            n = min(pool.size, v0.size - s)
            v0[s : s + n] = np.roll(pool, 7919 * (i + s // pool.size))[:n]
            block = v0[s : s + n].copy()
            # changed positions scattered (geometric gaps), moved by 1-2 ulps as Adam does
            idx = np.cumsum(rng.geometric(changed, int(n * changed * 1.2) + 16)) - 1
            idx = idx[idx < n]
            block[idx] += rng.choice(
                np.array([1, 1, 1, 2, 0xFFFF, 0xFFFF, 0xFFFE], np.uint16), idx.size
            )
            moved += int(np.count_nonzero(block != v0[s : s + n]))
            v1[s : s + n] = block
    for m in files.values():
        m.flush()
    return {
        "bytes": offset,
        "tensors": len(header),
        "largest": max(2 * math.prod(s) for s in shapes.values()),
        "changed": moved / (offset // 2),
    }


def same_bits(a: dict, b: dict) -> bool:
    return all(
        np.array_equal(a[k].reshape(-1).view(np.uint16), b[k].reshape(-1).view(np.uint16))
        for k in b
    )


def timed(fn):
    """(fn's result, {wall s, process CPU s (user + kernel), kernel s, peak extra anonymous
    bytes})."""
    with PeakAnon() as mem:
        t, c = time.perf_counter(), os.times()
        result = fn()
        d = os.times()
        figures = {"s": time.perf_counter() - t, "cpu": d.user - c.user + d.system - c.system}
        figures["sys"] = d.system - c.system  # page faults and reclaim of the mapped files
    return result, {**figures, "extra": mem.extra}


def child(role: str, d: Path, workers: int, base: str) -> dict:
    """One measured operation in this (fresh) process; returns its figures."""
    warm_up((2,))  # numba's kernels loaded before the clock starts, as an engine does at start-up
    store = LocalStore(d / "store")
    v0, _ = load_safetensors(d / "v0.safetensors", mmap_mode="r")
    out: dict = {}
    if role == "publish":
        v1, _ = load_safetensors(d / "v1.safetensors", mmap_mode="r")
        with Publisher(
            store,
            anchor_every=1 << 30,
            catchup=False,
            shard_bytes=SHARD,
            workers=workers,
            base_dir=d / "base",
            mapped_base=base == "mapped",
        ) as pub:
            for version, state, tag in ((0, v0, "anchor_publish"), (1, v1, "delta_publish")):
                os.sync()  # a training step's time between publishes: earlier writes are out
                report, out[tag] = timed(lambda: pub.publish(version, state))  # noqa: B023
                out[tag]["bytes"] = report.step_bytes
    elif role == "delta_pull":
        shutil.copyfile(d / "v0.safetensors", d / "engine.safetensors")
        os.sync()  # the engine's file as it was before the step, not dirty from the copy
        engine, _ = load_safetensors(d / "engine.safetensors", mmap_mode="r+")
        with Subscriber(store, version=0, workers=workers, cache_dir=d / "cache") as sub:
            report, out[role] = timed(lambda: sub.pull(engine))
        out[role]["bytes"] = report.downloaded_bytes
        shutil.rmtree(d / "cache")
        v1, _ = load_safetensors(d / "v1.safetensors", mmap_mode="r")
        out[role]["exact"] = same_bits(engine, v1)
        del engine
        os.unlink(d / "engine.safetensors")
    elif role == "anchor_pull":
        shutil.copyfile(d / "v0.safetensors", d / "engine.safetensors")  # same header
        engine, _ = load_safetensors(d / "engine.safetensors", mmap_mode="r+")
        for a in engine.values():
            a.reshape(-1).view(np.uint16)[:] = 0
        os.sync()
        with Subscriber(store, workers=workers, cache_dir=d / "cache") as sub:
            report, out[role] = timed(lambda: sub.pull(engine, version=0))
        out[role]["bytes"] = report.downloaded_bytes
        out[role]["exact"] = same_bits(engine, v0)
        del engine
        os.unlink(d / "engine.safetensors")
        shutil.rmtree(d / "cache")
    return out


def measure(size_gb: float, root: Path, workers: int, changed: float, base: str) -> dict:
    d = Path(tempfile.mkdtemp(prefix=f"scale-{size_gb:g}g-", dir=root))
    try:
        t = time.perf_counter()
        info = write_states(d, int(size_gb * 2**30), changed)
        # the inputs on disk before anything is measured, as a checkpoint written earlier
        # is: otherwise the first operations share the disk with their inputs' write-back
        os.sync()
        info["write_s"] = time.perf_counter() - t
        for role in ("publish", "delta_pull", "anchor_pull"):
            cmd = [
                sys.executable,
                __file__,
                "--child",
                role,
                "--dir",
                str(d),
                "--workers",
                str(workers),
                "--base",
                base,
            ]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
            if res.returncode != 0:
                raise RuntimeError(f"{role} at {size_gb:g} GB failed:\n{res.stderr[-3000:]}")
            info.update(json.loads(res.stdout.strip().splitlines()[-1]))
        return info
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="0.25,1,2,4", help="state sizes in GiB, comma-separated")
    ap.add_argument("--changed", type=float, default=0.02, help="fraction of weights changed")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--base",
        choices=("mapped", "copy"),
        default="mapped",
        help="the publisher's base: the mapped checkpoint itself, or a copy under base_dir",
    )
    ap.add_argument("--dir", default=None, help="where the states are written (removed after)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if args.child:
        print(json.dumps(child(args.child, Path(args.dir), args.workers, args.base)))
        return
    root = Path(args.dir or tempfile.gettempdir())
    ops = ("anchor_publish", "delta_publish", "delta_pull", "anchor_pull")
    print(
        f"bf16 MoE-shaped states, {args.changed:.0%} changed, {args.workers} workers, "
        f"{SHARD >> 20} MiB shards, publisher base: {args.base}"
    )
    head = f"{'GiB':>6} {'largest MiB':>11}" + "".join(
        f" {op + ' s':>17} {'cpu s':>6} {'extra MiB':>9}" for op in ops
    )
    print(head + f" {'changed':>7} {'delta MB':>9} {'exact':>5}", flush=True)
    rows = []
    for size in (float(x) for x in args.sizes.split(",")):
        r = measure(size, root, args.workers, args.changed, args.base)
        rows.append(r)
        cells = "".join(
            f" {r[op]['s']:>17.2f} {r[op]['cpu']:>6.2f} {r[op]['extra'] / 2**20:>9.0f}"
            for op in ops
        )
        exact = r["delta_pull"]["exact"] and r["anchor_pull"]["exact"]
        print(
            f"{r['bytes'] / 2**30:>6.2f} {r['largest'] / 2**20:>11.0f}{cells} {r['changed']:>7.2%} {r['delta_publish']['bytes'] / 1e6:>9.1f} {exact!s:>5}",
            flush=True,
        )
    print("\ncpu s per GiB (flat: linear growth)")
    print(f"{'GiB':>6}" + "".join(f" {op:>15}" for op in ops))
    for r in rows:
        gib = r["bytes"] / 2**30
        print(f"{gib:>6.2f}" + "".join(f" {r[op]['cpu'] / gib:>15.3f}" for op in ops))
    if len(rows) > 1:
        a, b = rows[0], rows[-1]
        k = b["bytes"] / a["bytes"]
        print(
            f"\nfrom {a['bytes'] / 2**30:.2f} to {b['bytes'] / 2**30:.2f} GiB ({k:.1f}x the bytes):"
        )
        for op in ops:
            print(
                f"  {op:>15}: time x{b[op]['s'] / a[op]['s']:.1f}, "
                f"cpu x{b[op]['cpu'] / a[op]['cpu']:.1f} (kernel share "
                f"{a[op].get('sys', 0) / a[op]['cpu']:.0%} -> {b[op].get('sys', 0) / b[op]['cpu']:.0%}), extra memory x{max(b[op]['extra'], 1) / max(a[op]['extra'], 1):.1f}"
            )


if __name__ == "__main__":
    main()
