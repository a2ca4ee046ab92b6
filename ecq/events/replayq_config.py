"""ReplayQ's options (`ReplayQConfig`) and how they turn items into frame payloads and sizes (`ItemCodec`).

Kept apart from ecq/events/replayq.py so the queue module holds only the queue's verbs and rules.

Modes (chosen by `ReplayQConfig`):

* memory only (``dir=None``): volatile, same API and overload protection.
* disk (``dir=...``): every item is written to a segment file before `ReplayQ.append` returns.
* offload (``offload=True``): items collect in RAM until `bytes()` reaches ``seg_bytes``, then the tail
  spills to segment files. What reached disk survives a crash; RAM items (popped-but-unacked ones
  included) are dumped to a segment file by `ReplayQ.close`.
* volatile offload (``offload="volatile"``): as offload, but old segments are wiped on open and RAM is
  never dumped on close; the disk is only overflow space.

fsync. ``fsync="always"`` (default) fsyncs the segment on each append, COMMIT on each ack that moves
it, and the directory when a file is created or renamed: what `append` returned from survives power
loss. ``fsync="never"`` only flushes to the OS: it survives a crash of the process, not of the machine.
Measured cost (``scripts/bench_replayq``, 2-core VM, ext4, one item per append): ``always`` adds about
0.25 ms per append. Disk mode appended 3.9 k items/s with ``always`` against 182 k/s with ``never``
for 256 B items (47x slower), 3.5 k/s against 91 k/s for 4 KiB items (26x); popping batches of 100,
each acked, ran at 109 k against 187 k items/s (256 B). Memory only appended 427 k items/s. Figures
depend on the storage: rerun the script on the target machine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

import psutil
from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from ecq.events.segments import MAX_ITEM_BYTES


def used_memory_percent() -> float:
    """The machine's memory use in percent (psutil), the default ``mem_probe``."""
    return psutil.virtual_memory().percent


class ReplayQConfig(BaseModel):
    """Options of a ReplayQ. Bad values raise pydantic.ValidationError naming the option.

    - dir: segment directory, created if missing; None means memory only.
    - seg_bytes: a new segment starts once the current one holds at least this many bytes; in offload
      mode also the RAM threshold. Default 10 MiB.
    - offload: False (disk mode), True (offload) or "volatile" (volatile offload); needs dir.
    - max_total_bytes: overload limit on `ReplayQ.bytes`. Default 2 GiB: plan it as the bytes you can
      spare divided by the number of queues.
    - mem_only: True forces memory only; must not be combined with dir.
    - fsync: "always" or "never" (see the module docstring for the semantics and the measured cost).
    - sizer: item -> size estimate in bytes (non-negative int, deterministic); default: payload length.
    - marshaller: (encode, decode) for items that are not bytes, e.g. (pickle.dumps, pickle.loads).
    - high_mem_percent: machine memory use in percent (0-100] at which each append drops from the head.
    - mem_probe: () -> memory use in percent; default psutil.virtual_memory().percent.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    dir: Path | None = None
    seg_bytes: int = Field(default=10 * 2**20, gt=0)
    offload: StrictBool | Literal["volatile"] = False
    max_total_bytes: int = Field(default=2 * 2**30, gt=0)
    mem_only: bool = False
    fsync: Literal["always", "never"] = "always"
    sizer: Callable[[Any], int] | None = None
    marshaller: tuple[Callable[[Any], bytes], Callable[[bytes], Any]] | None = None
    high_mem_percent: float | None = Field(default=None, gt=0, le=100)
    mem_probe: Callable[[], float] | None = None

    @model_validator(mode="after")
    def _check_mode(self) -> ReplayQConfig:
        if self.mem_only and self.dir is not None:
            raise ValueError("mem_only=True conflicts with dir; use dir=None for a memory-only queue")
        if self.offload is not False and self.dir is None:
            raise ValueError(f"offload={self.offload!r} needs a dir to spill to")
        return self


class ItemCodec:
    """Items to frame payloads and back, with their size estimates, as ``config``'s marshaller and sizer say.

    Without a marshaller items are bytes (bytearray and memoryview are copied to bytes); the size of an
    item is ``sizer(item)``, or its payload length.
    """

    def __init__(self, config: ReplayQConfig) -> None:
        self._encode, self._decode = config.marshaller or (None, None)
        self._size_fn = config.sizer

    def entry(self, item: Any) -> tuple[Any, bytes, int]:
        """(item as stored in RAM, payload, size). Encoding up front means a later spill or dump cannot fail.
        Raises TypeError as `payload` does, ValueError for a payload over `MAX_ITEM_BYTES`."""
        payload = self.payload(item)
        if len(payload) > MAX_ITEM_BYTES:
            raise ValueError(f"item of {len(payload)} bytes is over the {MAX_ITEM_BYTES}-byte frame limit")
        if self._encode is None:
            item = payload
        return item, payload, self._size_fn(item) if self._size_fn else len(payload)

    def payload(self, item: Any) -> bytes:
        """The frame payload of ``item``. Raises TypeError for an item that is not bytes without a
        marshaller, or a marshaller that does not return bytes."""
        if self._encode is not None:
            payload = self._encode(item)
            if not isinstance(payload, bytes):
                raise TypeError(f"marshaller encode returned {type(payload).__name__}, not bytes")
            return payload
        if isinstance(item, bytes):
            return item
        if isinstance(item, (bytearray, memoryview)):
            return bytes(item)
        raise TypeError(f"ReplayQ items must be bytes (or configure a marshaller), not {type(item).__name__}")

    def item(self, payload: memoryview) -> tuple[Any, int]:
        """(item, size) of a frame payload read from a segment file."""
        item = self._decode(bytes(payload)) if self._decode else bytes(payload)
        return item, self._size_fn(item) if self._size_fn else len(payload)

    def items(self, payloads: list[memoryview]) -> Iterable[tuple[Any, int]]:
        """`item` of each of ``payloads``, in order; without a marshaller and a sizer by C calls alone."""
        if self._decode is None and self._size_fn is None:
            return zip(map(bytes, payloads), map(len, payloads))
        return map(self.item, payloads)

    def size(self, payload: memoryview) -> int:
        """The size of the item in a frame payload; decodes it only when a sizer needs the item."""
        return self.item(payload)[1] if self._size_fn else len(payload)
