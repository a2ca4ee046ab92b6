"""The pieces of scripts/bench: load processes (loadgen), brokers under test (brokers), CPU/RSS sampling
(sampler), the scenarios (scenarios) and the printed table and JSON (report)."""
