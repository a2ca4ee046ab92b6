"""Opening the store a broker's ``backend`` option names."""

from __future__ import annotations

import logging

from ecq.store import layout as storage_layout
from ecq.config import EcqSettings
from ecq.store.protocol import QueueQuota, QueueStore

log = logging.getLogger(__name__)


def open_store(settings: EcqSettings) -> QueueStore:
    """The store ``settings.backend`` names: LevelDB in ``<data_dir>/queues`` (an old layout's LevelDB files in
    ``data_dir`` moved there first, see ecq.store.layout; checked block by block), or the JetStream streams of
    the NATS cluster. Raises StoreError (ecq.store.layout.LayoutError when the old layout cannot be moved), or
    NatsUnavailable (a ConnectionError)."""
    if settings.backend == "jetstream":
        from ecq.store.jetstream import JetStreamStore  # needs the [cluster] extra
        store: QueueStore = JetStreamStore(settings)
        entries, seconds = store.verify()
        log.info("ECQ store: JetStream namespace %s, %d shards, %d entries (%.2f s to check)",
                 settings.jetstream_namespace, settings.jetstream_shards, entries, seconds)
        return store
    from ecq.store.leveldb import LevelDbStore
    storage_layout.migrate(settings.data_dir)
    quota = QueueQuota(settings.max_queue_messages, settings.max_queue_bytes, settings.quota_policy)
    store = LevelDbStore(settings.queues_dir(), sync=settings.sync_writes, quota=quota,
                         max_open_files=settings.leveldb_max_open_files, cache_bytes=settings.leveldb_cache_bytes)
    rows, seconds = store.verify()
    log.info("ECQ store checked: %d rows read with checksums in %.2f s", rows, seconds)
    return store
