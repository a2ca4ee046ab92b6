"""The storage seam: where queues are kept, behind one protocol.

``protocol.py`` (the ``QueueStore`` protocol and its value types), ``leveldb.py`` with ``leveldb_files.py``,
``committed.py`` and ``layout.py`` (the embedded LevelDB store and its data directory), ``jetstream.py`` with
``jsapi.py`` and ``link.py`` (the cluster's store on NATS JetStream), and ``backends.open_store`` (the store a
broker's ``backend`` option names). The queue engine is handed an open store; it never imports a backend.
"""
