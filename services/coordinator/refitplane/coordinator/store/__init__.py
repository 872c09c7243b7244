"""State stores: where the coordinator's state survives a restart."""

from __future__ import annotations

from typing import Any

from refitplane.coordinator.store.base import Store
from refitplane.coordinator.store.embedded import EmbeddedStore


def open_store(redis_url: str, *, prefix: str = "refit:", **redis_options: Any) -> Store:
    """Redis when a URL is given (`redis_options`: `RedisStore`'s pool and TTL settings),
    else the embedded in-process store."""
    if not redis_url:
        return EmbeddedStore()
    from refitplane.coordinator.store.redis_store import RedisStore

    return RedisStore(redis_url, prefix=prefix, **redis_options)


__all__ = ["EmbeddedStore", "Store", "open_store"]
