"""A cache's address as the user writes it (a path, `file://PATH`, `s3://BUCKET/PREFIX`) turned into
a `Location`: the one module that knows every backend, so the backends need not know each other."""

from __future__ import annotations

from pathlib import Path

from pipeline.cache.location import Location, LocalLocation
from pipeline.errors import PipelineError


def open_location(url: str | Path) -> Location:
    """A location from what the user wrote: a path, file://PATH or s3://BUCKET/PREFIX."""
    text = str(url)
    if text.startswith("s3://"):
        from pipeline.cache.object_store import S3Location  # an optional extra: imported when used
        return S3Location.from_url(text)
    if text.startswith("file://"):
        return LocalLocation(Path(text[len("file://"):]), url=text)
    scheme = text.split("://", 1)[0] if "://" in text else ""
    if scheme and scheme.replace("+", "").replace("-", "").isalnum():
        raise PipelineError(f"{text}: unsupported cache location scheme {scheme!r} (a path, file://PATH or "
                            "s3://BUCKET/PREFIX)")
    return LocalLocation(Path(text))
