"""Everything about queues, with no MQTT library and no storage backend below it: topic grammar, writers, reads, delivery, GC, the engine (stores live in ecq.store)."""
