"""Caches in S3 or an S3-compatible store, through obstore (the optional `[s3]` extra).

Why obstore (Zarr 3's `ObjectStore`) rather than s3fs (`FsspecStore`): one Rust wheel with no
botocore / aiohttp stack under it; many requests in flight from one Python thread without the
GIL; `get_ranges` coalesces adjacent byte ranges of one object into one request; and it exposes
S3's conditional writes (If-None-Match on create), which the commit protocol is built on.

Credentials and endpoint come from the standard places: the AWS_* environment variables
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION, AWS_ENDPOINT_URL),
then the profile (AWS_PROFILE, else 'default') of the shared credentials and config files
(AWS_SHARED_CREDENTIALS_FILE / AWS_CONFIG_FILE, default ~/.aws/), then the rest of obstore's
chain (pipeline/cache/s3_credentials.py, which also words the error when there are none). No
message ever prints a secret: errors name the bucket, the key and the server's error code only.
"""

from __future__ import annotations

import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Iterator

from pipeline.cache.location import STREAM_BLOCK, Location
from pipeline.cache.s3_credentials import explain, missing_credentials, profile_settings
from pipeline.errors import PipelineError

EXTRA_HINT = 'S3 caches need the optional extra: pip install "dflash-pipeline[s3]" (obstore)'
# How long one request is retried (with backoff) before the command gives up in one line.
RETRY_SECONDS_ENV = "DFLASH_S3_RETRY_SECONDS"
MAX_IN_FLIGHT = 32


def _obstore():
    try:
        import obstore
        import obstore.store
    except ImportError:
        raise PipelineError(EXTRA_HINT) from None
    return obstore


def client_config(profile: dict[str, str]) -> dict[str, str]:
    """obstore S3 settings for what the environment does not set itself (obstore reads AWS_*)."""
    env = os.environ
    config: dict[str, str] = {}
    if not env.get("AWS_ACCESS_KEY_ID"):
        for ours, theirs in (("access_key_id", "aws_access_key_id"), ("secret_access_key", "aws_secret_access_key"),
                             ("token", "aws_session_token")):
            if profile.get(theirs):
                config[ours] = profile[theirs]
    if not (env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")):
        config["region"] = profile.get("region", "us-east-1")
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or profile.get("endpoint_url")
    if endpoint:
        config["endpoint"] = endpoint
        if endpoint.startswith("http://"):
            config["allow_http"] = "true"
    return config


def describe_error(e: Exception) -> str:
    """A short, secret-free reason from an obstore error."""
    text = str(e)
    code = re.search(r"<Code>([^<]+)</Code>", text)
    status = re.search(r"non-2xx status code: (\d{3} [A-Za-z ]+)", text)
    if code:
        return f"{code.group(1)} ({status.group(1).strip()})" if status else code.group(1)
    if "error sending request" in text or "Connection refused" in text or "dns error" in text:
        return "cannot reach the endpoint (is it running? AWS_ENDPOINT_URL)"
    if status:
        return status.group(1).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    return first[:200]


class S3Location(Location):
    remote = True

    def __init__(self, bucket: str, prefix: str, url: str):
        obstore = _obstore()
        self.bucket, self.prefix, self.url = bucket, prefix.strip("/"), url
        seconds = float(os.environ.get(RETRY_SECONDS_ENV, "60"))
        env = os.environ
        profile = {} if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_ENDPOINT_URL") else profile_settings()
        self._config = client_config(profile)
        # None when some credential source is configured; else what was looked for, for every error's line
        self._missing_credentials = missing_credentials(profile)
        self._retry = {"max_retries": 10, "retry_timeout": timedelta(seconds=seconds),
                       "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=5),
                                   "base": 2}}
        self.store = self._make_store(self.prefix)
        self._obstore = obstore
        self._pool: ThreadPoolExecutor | None = None
        self._stores: dict = {}
        self.requests = 0  # requests this client made for reads, listings, writes and deletes
        self._count_lock = threading.Lock()

    def _count(self, n: int = 1) -> None:
        with self._count_lock:
            self.requests += n

    def _make_store(self, prefix: str):
        import obstore.store
        return obstore.store.S3Store(self.bucket, prefix=prefix or None, config=self._config,
                                     retry_config=self._retry, client_options={"connect_timeout": "5s", "timeout": "120s"})

    @classmethod
    def from_url(cls, url: str) -> "S3Location":
        rest = url[len("s3://"):]
        bucket, _, prefix = rest.partition("/")
        if not re.fullmatch(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]", bucket or ""):
            raise PipelineError(f"{url}: {bucket!r} is not a valid S3 bucket name")
        return cls(bucket, prefix, url.rstrip("/"))

    def _fail(self, what: str, key: str, e: Exception) -> PipelineError:
        answer = f"{what} failed: {describe_error(e)}"
        if self._missing_credentials is not None:  # the real cause, which the client's error hides
            answer = explain(self._missing_credentials, answer, str(e))
        return PipelineError(f"{self.where(key)}: {answer}")

    def _call(self, what: str, key: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except PipelineError:
            raise
        except Exception as e:  # noqa: BLE001 - obstore raises its own hierarchy; one line for all
            raise self._fail(what, key, e) from None

    def read(self, key: str) -> bytes | None:
        self._count()
        try:
            return bytes(self._obstore.get(self.store, key).bytes())
        except (FileNotFoundError, self._obstore.exceptions.NotFoundError) as e:
            if "NoSuchBucket" in str(e):
                raise self._fail("read", key, e) from None
            return None
        except Exception as e:  # noqa: BLE001
            raise self._fail("read", key, e) from None

    def read_ranges(self, key: str, ranges: list[tuple[int, int]]) -> list[memoryview]:
        if not ranges:
            return []
        self._count()  # at least one: obstore coalesces adjacent ranges and may split far ones
        parts = self._call("range read", key, self._obstore.get_ranges, self.store, key,
                           starts=[a for a, _ in ranges], ends=[b for _, b in ranges])
        return [memoryview(p) for p in parts]

    def stream(self, key: str) -> Iterator[bytes]:
        self._count()
        result = self._call("read", key, self._obstore.get, self.store, key)
        try:
            for block in result.stream(min_chunk_size=STREAM_BLOCK):
                yield bytes(block)
        except Exception as e:  # noqa: BLE001
            raise self._fail("read", key, e) from None

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """S3's conditional PUT (If-None-Match: *): the store decides, for every writer at once."""
        self._count()
        try:
            self._obstore.put(self.store, key, data, mode="create")
            return True
        except self._obstore.exceptions.AlreadyExistsError:
            return False
        except Exception as e:  # noqa: BLE001
            raise self._fail("write", key, e) from None

    def listing(self, prefix: str = "") -> dict[str, int]:
        found = {}
        try:
            for page in self._obstore.list(self.store, prefix or None, chunk_size=1000):
                self._count()  # one LIST request a page of at most 1,000 keys
                for meta in page:
                    found[meta["path"]] = int(meta["size"])
        except Exception as e:  # noqa: BLE001
            raise self._fail("listing", prefix, e) from None
        return dict(sorted(found.items()))

    def some_keys(self, limit: int = 10) -> list[str]:
        self._count()
        try:
            page = next(iter(self._obstore.list(self.store, None, chunk_size=limit)), [])
        except Exception as e:  # noqa: BLE001
            raise self._fail("listing", "", e) from None
        return [meta["path"] for meta in page][:limit]

    def delete_prefix(self, prefix: str) -> None:
        keys = list(self.listing(prefix))
        for i in range(0, len(keys), 1000):
            self._count()
            self._call("delete", prefix, self._obstore.delete, self.store, keys[i:i + 1000])

    def delete(self, key: str) -> None:
        self._count()
        self._call("delete", key, self._obstore.delete, self.store, key)

    def zarr_store(self, prefix: str, *, read_only: bool):
        from zarr.storage import ObjectStore
        inner = "/".join(p for p in (self.prefix, prefix.strip("/")) if p)
        if inner not in self._stores:  # one client (and connection pool) per prefix, reused
            self._stores[inner] = self._make_store(inner)
        return ObjectStore(self._stores[inner], read_only=read_only)

    def ensure_root(self) -> None:
        """Fails in one line on a missing bucket, refused credentials or an unreachable endpoint."""
        self.check_reachable()

    def check_reachable(self) -> None:
        self._count()
        try:
            next(iter(self._obstore.list(self.store, None, chunk_size=1)), None)
        except Exception as e:  # noqa: BLE001
            raise self._fail("listing", "", e) from None

    def map(self, fn, items: list) -> list:
        """fn over items with a bounded number of requests in flight (order kept)."""
        if len(items) <= 1:
            return [fn(x) for x in items]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(MAX_IN_FLIGHT, thread_name_prefix="s3")
        return list(self._pool.map(fn, items))
