"""ECQ as a cluster: stateless broker nodes over a NATS JetStream core (issue 12)."""
