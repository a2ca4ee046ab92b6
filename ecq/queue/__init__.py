"""Everything about queues, with no MQTT library below it: topic grammar, storage, writers, reads, delivery, GC, the engine."""
