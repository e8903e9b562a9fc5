"""Bit-exact compressed weight deltas, published and pulled through object stores.

After every RL step the trainer publishes only what changed since the previous version;
inference engines anywhere pull, verify and apply it with a short pause. No torch needed:
numpy arrays and torch tensors (CPU or CUDA) are both accepted.

    pub = Publisher(LocalStore("/shared/run7"))            # or S3Store(...), per trainer
    pub.publish(step, model.state_dict())

    sub = Subscriber(HttpStore("http://relay:8080"), version=current)   # per engine
    prepared = sub.prepare()            # download + verify + decode while serving
    report = prepared.apply(weights)    # the pause: patch in place

Tied tensors (one tensor under two names) are stored once and restored as aliases;
`to_torch` / `materialize(as_torch=True)` give torch tensors bit for bit; and
`save_safetensors` / `load_safetensors` read and write safetensors files without torch.
"""

from importlib.metadata import version as _version

from tandem.delta_sync.codec.sparse import warm_up
from tandem.delta_sync.delta import apply_delta, decode_full, encode_delta, encode_full
from tandem.delta_sync.errors import (
    BaseMismatchError,
    DeltaSyncError,
    IntegrityError,
    NotFoundError,
    StoreError,
)
from tandem.delta_sync.manifest import Manifest
from tandem.delta_sync.prepared import Prepared
from tandem.delta_sync.publisher import Publisher
from tandem.delta_sync.reports import PayloadReport, PublishReport, PullReport
from tandem.delta_sync.safetensors_io import load_safetensors, save_safetensors
from tandem.delta_sync.stores import (
    HttpStore,
    LocalStore,
    RelayStore,
    S3Store,
    Store,
    open_store,
)
from tandem.delta_sync.subscriber import Subscriber
from tandem.delta_sync.torch_interop import to_torch

__version__ = _version("tandem-delta-sync")

__all__ = [
    "BaseMismatchError",
    "DeltaSyncError",
    "HttpStore",
    "IntegrityError",
    "LocalStore",
    "Manifest",
    "NotFoundError",
    "PayloadReport",
    "Prepared",
    "PublishReport",
    "Publisher",
    "PullReport",
    "RelayStore",
    "S3Store",
    "Store",
    "StoreError",
    "Subscriber",
    "__version__",
    "apply_delta",
    "decode_full",
    "encode_delta",
    "encode_full",
    "load_safetensors",
    "open_store",
    "save_safetensors",
    "to_torch",
    "warm_up",
]
