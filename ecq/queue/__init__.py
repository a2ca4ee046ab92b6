"""Everything about queues, free of amqtt: topic grammar, the LevelDB tables, writers, reads, delivery, GC."""
