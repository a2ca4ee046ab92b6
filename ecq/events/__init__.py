"""Queue events: what happens to each queue, recorded by the broker and exported to a Parquet lake."""

from ecq.events.recorder import EventRecorder, LakeExporter

__all__ = ["EventRecorder", "LakeExporter"]
