"""Queue events: what happens to each queue, recorded by the broker and exported to a Parquet lake.

`schema` defines an event and its encoding, `recorder` buffers events on disk in a ReplayQ (`replayq`,
with its file format in `segments` and its options in `replayq_config`), `lake` exports the buffer to
Parquet files exactly once, and `atomic` is the one atomic file write that ReplayQ and the lake share.
"""

from ecq.events.lake import LakeExporter
from ecq.events.recorder import EventRecorder

__all__ = ["EventRecorder", "LakeExporter"]
