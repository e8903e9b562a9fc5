"""Fixtures: stores on loopback (own HTTP server, moto's S3 server) and Adam-like states."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator

import ml_dtypes
import numpy as np
import pytest
import structlog

from tandem.delta_sync.server import StoreServer
from tandem.delta_sync.stores import HttpStore, LocalStore, S3Store


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def _structlog_defaults() -> Iterator[None]:
    """The CLI configures structlog for its process (logs to the stderr it sees): put the
    defaults back so that no later test logs into a closed captured stream."""
    yield
    structlog.reset_defaults()


@pytest.fixture
def local_store(tmp_path) -> LocalStore:
    return LocalStore(tmp_path / "store")


@pytest.fixture
def served(tmp_path) -> Iterator[tuple[LocalStore, HttpStore, StoreServer]]:
    """A LocalStore (the origin) and an HttpStore reading it through `delta-sync serve`."""
    origin = LocalStore(tmp_path / "origin")
    origin.root.mkdir()
    server = StoreServer(origin.root).start()
    try:
        yield origin, HttpStore(server.url, retries=1, backoff=0.01, timeout=10), server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3_store(s3_endpoint) -> S3Store:
    import boto3

    bucket = f"b-{uuid.uuid4().hex[:12]}"
    creds = {
        "aws_access_key_id": "test",
        "aws_secret_access_key": "test",
        "region_name": "us-east-1",
    }
    boto3.client("s3", endpoint_url=s3_endpoint, **creds).create_bucket(Bucket=bucket)
    return S3Store(bucket, "runs/7", endpoint_url=s3_endpoint, retries=1, **creds)


class AdamLikeTrainer:
    """fp32 master weights nudged by ~lr each step (Adam's normalised step), bf16 snapshots."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.master = {k: self.rng.normal(0, 0.02, s).astype(np.float32) for k, s in shapes.items()}

    def step(self, lr: float = 2e-6) -> dict[str, np.ndarray]:
        for w in self.master.values():
            w -= lr * np.sign(self.rng.standard_normal(w.shape)).astype(np.float32)
        return self.snapshot()

    def snapshot(self) -> dict[str, np.ndarray]:
        return {k: w.astype(ml_dtypes.bfloat16) for k, w in self.master.items()}


SHAPES = {
    "embed": (256, 96),
    "layers.0.attn.qkv": (288, 96),
    "layers.0.experts.w1": (4, 64, 96),
    "layers.0.norm": (96,),
}


@pytest.fixture
def trainer() -> AdamLikeTrainer:
    return AdamLikeTrainer(SHAPES)


@pytest.fixture
def big_trainer() -> AdamLikeTrainer:
    """~1.5 MB of bf16: with a high learning rate one delta spans several 64 KiB shards."""
    return AdamLikeTrainer({"a": (512, 1024), "experts": (4, 128, 512)}, seed=3)


def bits(a) -> np.ndarray:
    """Bit patterns of a numpy array or a (CPU or CUDA) torch tensor, as a flat uint array."""
    if type(a).__module__.startswith("torch"):
        import torch

        width = a.element_size()
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
        a = a.detach().contiguous().view(ints).cpu().numpy()
    a = np.ascontiguousarray(a)
    return a.reshape(-1).view(f"u{a.itemsize}")


@pytest.fixture
def same_bits():
    """assert two states are equal bit for bit."""

    def check(a: dict, b: dict) -> None:
        assert set(a) == set(b)
        for k in a:
            assert np.array_equal(bits(a[k]), bits(b[k])), f"tensor {k} differs"

    return check
