"""A store in an S3-compatible bucket (AWS S3, MinIO, Ceph, R2, ...). Needs the `s3` extra.

boto3 is imported only when the first request is made, so the package imports without it.
Retries use botocore's adaptive mode, which backs off on 503 SlowDown; shard keys are
spread over 256 prefixes to stay under the per-prefix request rate.
"""

from __future__ import annotations

import threading
from typing import Any

from tandem.delta_sync.errors import NotFoundError, StoreError
from tandem.delta_sync.stores.base import Store, check_key


class S3Store(Store):
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region_name: str | None = None,
        retries: int = 5,
        connect_timeout: float = 10.0,
        read_timeout: float = 120.0,
        client: Any = None,
        **client_kwargs: Any,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        self.region_name = region_name
        self.retries = retries
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.client_kwargs = client_kwargs
        self._client = client
        self._lock = threading.Lock()

    def describe(self) -> str:
        where = f"s3://{self.bucket}/{self.prefix}"
        return f"{where} at {self.endpoint_url}" if self.endpoint_url else where

    @property
    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                try:
                    import boto3
                    from botocore.config import Config
                except ImportError:
                    raise StoreError(
                        "S3Store needs boto3: pip install 'tandem-delta-sync[s3]'"
                    ) from None
                config = Config(
                    retries={"max_attempts": self.retries, "mode": "adaptive"},
                    connect_timeout=self.connect_timeout,
                    read_timeout=self.read_timeout,
                    max_pool_connections=64,
                )
                self._client = boto3.client(
                    "s3",
                    endpoint_url=self.endpoint_url,
                    region_name=self.region_name,
                    config=config,
                    **self.client_kwargs,
                )
            return self._client

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _error(self, op: str, key: str, e: Exception) -> StoreError:
        response = getattr(e, "response", None) or {}  # None on some connection errors
        code = (response.get("Error") or {}).get("Code", "")
        if code in ("NoSuchKey", "404", "NotFound"):
            return NotFoundError(f"{key!r} not found in {self.describe()}")
        return StoreError(f"{op} {key!r} in {self.describe()} failed: {e}")

    def get(self, key: str) -> bytes:
        try:
            obj = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            body = obj["Body"].read()
        except StoreError:
            raise
        except Exception as e:  # botocore raises many unrelated types
            raise self._error("GET", key, e) from None
        if len(body) != obj.get("ContentLength", len(body)):
            raise StoreError(f"GET {key!r} in {self.describe()}: short read")
        return body

    def exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except StoreError:
            raise
        except Exception as e:
            err = self._error("HEAD", key, e)
            if isinstance(err, NotFoundError):
                return False
            raise err from None

    def put(self, key: str, data: bytes) -> None:
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
        except StoreError:
            raise
        except Exception as e:
            raise self._error("PUT", key, e) from None
