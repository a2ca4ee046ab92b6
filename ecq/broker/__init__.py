"""The amqtt side: the ECQ plugin, the one module that touches amqtt internals, and the ACL."""
