"""Operating a running broker: the admin HTTP API, Prometheus metrics, what status and inspect report."""
