"""ECQ plugin options: one pydantic model with the reference defaults of SPEC.md section 1 ("Configuration").

Durations accept a number of seconds or a string with a unit: ``500ms``, ``5s``, ``10m``, ``1h``, ``7d``.
They are held as float seconds. A bad value raises :class:`pydantic.ValidationError`, whose message
names the option and the rule it broke; ``ecq broker`` prints it and exits before binding any port.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(value: Any) -> float:
    """Parse ``500ms`` / ``5s`` / ``10m`` / ``1h`` / ``7d`` / a bare number of seconds into float seconds.

    Raises ValueError (which pydantic reports against the option name) for anything else.
    """
    if isinstance(value, bool):
        raise ValueError("must be a duration such as 500ms, 5s, 1h or 7d")
    if isinstance(value, int | float):
        return float(value)
    match = _DURATION.match(str(value))
    if not match:
        raise ValueError(f"{value!r} is not a duration; use a number with ms, s, m, h or d (e.g. 5s, 7d)")
    number, unit = match.groups()
    return float(number) * _UNIT_SECONDS[unit]


PositiveDuration = Annotated[float, BeforeValidator(parse_duration), Field(gt=0)]


class EcqSettings(BaseModel):
    """Validated options of the ECQ plugin (the mapping under ``ecq.plugin.EcqPlugin`` in amqtt's ``plugins:``).

    Units: durations in seconds (parsed from strings as above), sizes in bytes.
    Unknown options are refused so that a typo cannot silently fall back to a default.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    data_dir: Path = Field(default=Path("storage"), description="LevelDB directory; created if missing")
    writer_pool_size: int = Field(default=0, ge=0, le=10240, description="writer agents; 0 = CPU count")
    data_retention: PositiveDuration = Field(default=7 * 86400.0, description="age after which GC deletes a write")
    gc_interval: PositiveDuration = Field(default=3600.0, description="time between GC passes")
    reader_batch_size: int = Field(default=5, ge=1, le=31, description="inflight window per consumer")
    write_timeout: PositiveDuration = Field(default=5.0, description="an append not committed in time fails")
    read_timeout: PositiveDuration = Field(default=5.0, description="a batch read not done in time is retried")
    heartbeat_interval: PositiveDuration = Field(default=5.0, description="re-poll of idle online consumers")
    max_payload_bytes: int = Field(default=1024 * 1024, ge=0, le=268_435_455, description="largest write payload")
    sync_writes: bool = Field(default=False, description="fsync each commit (survives power loss, slower)")

    def effective_pool_size(self) -> int:
        """Number of writer agents: ``writer_pool_size``, or the CPU count when it is 0 (SPEC.md section 1)."""
        return self.writer_pool_size or (os.cpu_count() or 1)
