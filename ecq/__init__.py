"""ECQ: exclusive compacted queues for MQTT, as an amqtt broker plugin backed by LevelDB."""
