"""ECQ plugin options: one pydantic model with the defaults of the ECQ reference plugin (EMQX ecq).

Durations accept a number of seconds or a string with a unit: ``500ms``, ``5s``, ``10m``, ``1h``, ``7d``.
They are held as float seconds. A bad value raises :class:`pydantic.ValidationError`, whose message
names the option and the rule it broke; ``ecq broker`` prints it and exits before binding any port.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import os
import re
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, SecretStr, StrictBool,
                      StrictInt, ValidationError, field_validator, model_validator)

from ecq.store import layout as storage_layout

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
MAX_REMAINING_LENGTH = 268_435_455  # the largest MQTT 3.1.1 packet body (section 2.2.3)
PUBLISH_HEADER_ROOM = 2 + 65_535 + 2  # a PUBLISH's topic length, longest topic and packet id, in bytes


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


LEVELDB_MAX_OPEN_FILES = 1000  # LevelDB's own default
MAX_DURATION_S = 10 * 365 * 86400.0  # ten years: anything longer is a typo, and timers need finite values
LEVELDB_WINDOW = 5     # default inflight window per consumer (reader_batch_size)
JETSTREAM_WINDOW = 16  # the same with backend jetstream, where each ack save is a quorum round trip
# options whose default stands for a value computed at start-up (EcqSettings.in_effect shows the value)
COMPUTED_OPTIONS = frozenset({"writer_pool_size", "max_packet_bytes", "lake_dir", "node_name", "reader_batch_size"})


def _bounded(minimum_s: float):
    """A duration option of at least ``minimum_s`` and at most ten years (NaN and infinity refused)."""
    def check(seconds: float) -> float:
        if not math.isfinite(seconds) or not minimum_s <= seconds <= MAX_DURATION_S:
            raise ValueError(f"must be a duration from {_show(minimum_s)} to 10 years, not {seconds!r} s")
        return seconds
    return Annotated[float, BeforeValidator(parse_duration), AfterValidator(check)]


def _show(seconds: float) -> str:
    return f"{seconds * 1000:g}ms" if seconds < 1 else f"{seconds:g}s"


Timer = _bounded(0.01)       # heartbeat, timeouts, export interval: a shorter timer only burns CPU
Lease = _bounded(3.0)        # renewed every third of it: at most once a second
GcInterval = _bounded(0.1)
Retention = _bounded(1.0)
Int = StrictInt              # YAML `true` is not 1


class EcqSettings(BaseModel):
    """Validated options of the ECQ plugin (the mapping under ``ecq.broker.plugin.EcqPlugin`` in amqtt's ``plugins:``).

    Units: durations in seconds (parsed from strings as above), sizes in bytes.
    Unknown options are refused so that a typo cannot silently fall back to a default.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    data_dir: Path = Field(default=Path("storage"), description="data directory, created if missing: LevelDB in "
                           "queues/, the event buffer in events/, the lake in lake/ (see ecq.store.layout)")
    writer_pool_size: Int = Field(default=0, ge=0, le=10240, description="writer agents; 0 = CPU count")
    data_retention: Retention = Field(default=7 * 86400.0, description="age after which GC deletes a write")
    tombstones: StrictBool = Field(default=True, description="an empty payload deletes its key: delivered once as an "
                                   "empty PUBLISH, then removed on its PUBACK or after tombstone_retention")
    tombstone_retention: Retention = Field(default=86400.0, description="age after which GC deletes a tombstone")
    max_queue_messages: Int = Field(default=0, ge=0, description="entries one queue may store, acked or not; "
                                    "0 = unlimited (a rewrite of a stored key is not a new entry)")
    max_queue_bytes: Int = Field(default=0, ge=0, description="payload bytes one queue may store; 0 = unlimited")
    quota_policy: Literal["drop_oldest", "refuse"] = Field(
        default="drop_oldest", description="a write over a queue quota deletes the queue's oldest entries "
                                           "(drop_oldest) or is refused with reason quota_exceeded (refuse)")
    max_store_bytes: Int = Field(default=0, ge=0, description="payload bytes all queues may store; above it writes "
                                                              "are refused with reason store_full; 0 = unlimited")
    state_retention: Retention = Field(default=30 * 86400.0, description="age after which GC forgets an empty "
                                       "queue's seqno and ack state (no consumer online, no write or ack since)")
    gc_interval: GcInterval = Field(default=3600.0, description="time between GC passes")
    reader_batch_size: Int = Field(default=LEVELDB_WINDOW, ge=1, le=31,
                                   description=f"inflight window per consumer; when not set, {LEVELDB_WINDOW}, or "
                                               f"{JETSTREAM_WINDOW} with backend jetstream")
    write_timeout: Timer = Field(default=5.0, description="an append not committed in time fails")
    read_timeout: Timer = Field(default=5.0, description="a batch read not done in time is retried")
    heartbeat_interval: Timer = Field(default=5.0, description="re-poll of idle online consumers")
    max_payload_bytes: Int = Field(default=1024 * 1024, ge=0, le=MAX_REMAINING_LENGTH, description="largest write payload")
    max_packet_bytes: Int | None = Field(default=None, ge=0, le=MAX_REMAINING_LENGTH,
                                         description="largest MQTT packet body; None = max_payload_bytes + 65539")
    connect_timeout: Timer = Field(default=10.0, description="a connection without CONNECT in time is closed")
    max_connections: Int = Field(default=0, ge=0, description="client ids connected to this node at once, over all "
                                 "its listeners (a takeover adds none); a CONNECT beyond it gets CONNACK 0x03, MQTT 5 "
                                 "0x97; 0 = no cap")
    leveldb_max_open_files: Int = Field(default=LEVELDB_MAX_OPEN_FILES, ge=20, le=65535,
                                        description="LevelDB table files kept open, and so memory-mapped (RSS)")
    leveldb_cache_bytes: Int = Field(default=8 * 1024 * 1024, ge=1024 * 1024,
                                     description="LevelDB block cache, bytes (uncompressed blocks read recently)")
    fast_path: StrictBool = Field(default=True, description="read MQTT packets with ECQ's buffered framer and take "
                                  "QoS 1 $ECQ/ PUBLISHes and PUBACKs of ECQ deliveries without amqtt's packet objects; "
                                  "false = amqtt's own reader")
    sync_writes: StrictBool = Field(default=False, description="fsync each commit (survives power loss, slower)")
    acl_file: Path | None = Field(default=None, description="EMQX-syntax ACL file; None = no ACL")
    scq_dispatch: Literal["round_robin", "least_inflight", "random"] = Field(
        default="round_robin", description="which connected member of a shared group ($share/<group>/$SCQ/<queue>/#) "
                                           "gets each entry (EMQX's strategy names); broker-wide")
    acl_nomatch: Literal["allow", "deny"] = Field(default="allow", description="decision when no ACL rule matches")
    admin_bind: str | None = Field(default="127.0.0.1:18083", description="HOST:PORT of the admin API; None = off")
    admin_token: SecretStr | None = Field(default=None, description="bearer token the admin API requires; "
                                          "shown as ********** in dumps, reprs and the admin API")
    events: StrictBool = Field(default=True, description="record queue events and export them to lake_dir")
    lake_dir: Path | None = Field(default=None, description="Parquet event lake; None = <data_dir>/lake")
    export_interval: Timer = Field(default=1.0, description="time between event exports")
    lake_file_rows: Int = Field(default=1_000, ge=1, le=10_000_000,
                                description="a lake file is written once this many events wait (at most this many)")
    lake_file_bytes: Int = Field(default=64 * 1024 * 1024, ge=1024, description="... or this many bytes of encoded "
                                 "events (at most events_max_bytes / 4 is used)")
    lake_file_age: Timer = Field(default=60.0, description="... or once the oldest waiting event is this old")
    events_max_bytes: Int = Field(default=256 * 1024 * 1024, ge=1024, description="event buffer bound, bytes")
    listen_backlog: Int = Field(default=1024, ge=1, le=65535,
                                description="accept queue of the broker's TCP listeners (kernel caps it at somaxconn)")
    session_max_queued: Int = Field(default=1000, ge=1,
                                    description="QoS 1/2 messages kept per disconnected persistent session")
    session_max_inflight: Int = Field(default=100, ge=1,
                                      description="unacked QoS 1/2 messages kept per persistent session for resend")
    max_queued_messages: Int = Field(default=1000, ge=1, description="messages of ordinary topics handed to one "
                                     "connection and not done (not yet written, or QoS 1/2 not yet acknowledged); "
                                     "beyond it a message to that connection is dropped")
    max_queued_bytes: Int = Field(default=64 * 1024 * 1024, ge=1024, description="... or this many bytes of them "
                                  "(topic and payload) with the connection's write buffer")
    stuck_subscriber_timeout: Timer = Field(default=60.0, description="a connection at max_queued_messages or "
                                            "max_queued_bytes for this long is closed")
    inbound_max_messages: Int = Field(default=1000, ge=1, description="PUBLISHes of ordinary topics read from one "
                                      "connection and not yet routed; beyond it the connection is not read until "
                                      "half of them are")
    inbound_max_bytes: Int = Field(default=16 * 1024 * 1024, ge=1024, description="... or this many bytes of them "
                                   "(topic and payload)")
    session_expiry: Timer = Field(default=7200.0,
                                             description="a disconnected persistent session is forgotten after this")
    max_keepalive: Int | None = Field(default=None, ge=1, le=65535,
                                      description="longest Keep Alive (seconds) an MQTT 5 client is held to, told in "
                                      "CONNACK's Server Keep Alive; None = the client's own")
    receive_maximum: Int = Field(default=1024, ge=1, le=65535,
                                 description="QoS 1/2 PUBLISHes an MQTT 5 client may have unacknowledged, told in "
                                 "CONNACK's Receive Maximum; one more gets DISCONNECT 0x93")
    topic_alias_maximum: Int = Field(default=64, ge=0, le=65535,
                                     description="Topic Aliases an MQTT 5 client may set, told in CONNACK's Topic Alias "
                                     "Maximum; 0 = none; an alias above it gets DISCONNECT 0x94")
    max_properties_bytes: Int = Field(default=128 * 1024, ge=0, le=MAX_REMAINING_LENGTH,
                                      description="bytes of properties one MQTT 5 packet may carry (a CONNECT's and "
                                      "its Will's together), checked before they are decoded; more gets DISCONNECT "
                                      "0x95 (CONNACK 0x95)")
    max_user_properties: Int = Field(default=1024, ge=0,
                                     description="User Properties one MQTT 5 packet may carry; more gets DISCONNECT "
                                     "0x95 (CONNACK 0x95)")

    backend: Literal["leveldb", "jetstream"] = Field(
        default="leveldb", description="queue storage: embedded LevelDB in data_dir, or a NATS JetStream cluster")
    nats_servers: list[str] = Field(default=["nats://127.0.0.1:4222"], min_length=1,
                                    description="NATS URLs (nats://HOST:PORT or tls://HOST:PORT) of the JetStream cluster")
    nats_user: str | None = Field(default=None, description="NATS user name (with nats_password)")
    nats_password: SecretStr | None = Field(default=None, description="NATS password")
    nats_token: SecretStr | None = Field(default=None, description="NATS authentication token")
    nats_tls_ca: Path | None = Field(default=None, description="PEM file of the CA(s) that signed the NATS servers' "
                                     "certificates: TLS to NATS, verified against it; None = plain TCP unless a "
                                     "URL is tls:// (then the system's CAs)")
    nats_tls_cert: Path | None = Field(default=None, description="PEM client certificate for NATS servers that "
                                       "verify clients (with nats_tls_key)")
    nats_tls_key: Path | None = Field(default=None, description="PEM private key of nats_tls_cert")
    jetstream_shards: Int = Field(default=16, ge=1, le=1024,
                                  description="JetStream streams the queues are spread over, by CRC32 of the clientid")
    jetstream_replicas: Int = Field(default=3, ge=1, le=5,
                                    description="copies of each stream on the NATS servers (1 for a single server)")
    jetstream_namespace: str = Field(default="ECQ", pattern=r"^[A-Za-z0-9_-]{1,32}$",
                                     description="prefix of ECQ's streams and subjects: one NATS cluster can host "
                                                 "several ECQ clusters")
    node_name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{1,64}$",
                                  description="this broker's name in the cluster; None = <hostname>-<pid>")
    scq_group_lease: Lease = Field(default=10.0, description="with backend jetstream, the lease by which one broker "
                                   "at a time serves an SCQ shared group: renewed every third of it; a holder killed "
                                   "is replaced after at most this long (the same on every broker)")

    @model_validator(mode="before")
    @classmethod
    def _window_for_backend(cls, data: Any) -> Any:
        """An ack is stored before the next delivery to its consumer, and on JetStream that save is a quorum
        round trip (~4 ms): one consumer delivers at most a window per save, so the cluster's default window is
        wider (one queue drains at >= 2,000/s, issue 24)."""
        if isinstance(data, dict) and data.get("reader_batch_size") is None:
            window = JETSTREAM_WINDOW if data.get("backend") == "jetstream" else LEVELDB_WINDOW
            return {**data, "reader_batch_size": window}
        return data

    @field_validator("nats_servers")
    @classmethod
    def _nats_urls(cls, value: list[str]) -> list[str]:
        for url in value:
            scheme, sep, rest = url.partition("://")
            if scheme not in ("nats", "tls") or not sep:
                raise ValueError(f"{url!r} is not a NATS URL: use nats://HOST:PORT or tls://HOST:PORT")
            split_host_port(rest.rpartition("@")[2].rstrip("/"))
        return value

    @field_validator("admin_bind")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value:
            split_host_port(value)
        return value or None

    @model_validator(mode="after")
    def _token_off_loopback(self) -> EcqSettings:
        if self.admin_bind and not self.admin_token and not is_loopback(split_host_port(self.admin_bind)[0]):
            raise ValueError(f"admin_bind {self.admin_bind!r} is not a loopback address: set admin_token")
        return self

    @model_validator(mode="after")
    def _packet_fits_payload(self) -> EcqSettings:
        if self.max_packet_bytes is not None and self.max_packet_bytes < self._write_packet_bytes():
            raise ValueError(f"max_packet_bytes {self.max_packet_bytes} is below max_payload_bytes + "
                             f"{PUBLISH_HEADER_ROOM} ({self._write_packet_bytes()}): a write of max_payload_bytes "
                             "would close its publisher's connection instead of being refused")
        return self

    @model_validator(mode="after")
    def _tls_files(self) -> EcqSettings:
        if (self.nats_tls_cert is None) != (self.nats_tls_key is None):
            raise ValueError("nats_tls_cert and nats_tls_key go together: give both or neither")
        for name in ("nats_tls_ca", "nats_tls_cert", "nats_tls_key"):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                raise ValueError(f"{name} {str(path)!r} is not a readable file")
        return self

    def nats_tls_wanted(self) -> bool:
        """True when ECQ speaks TLS to NATS: a TLS option is set or a ``nats_servers`` URL is ``tls://``."""
        return bool(self.nats_tls_ca or self.nats_tls_cert
                    or any(url.startswith("tls://") for url in self.nats_servers))

    @model_validator(mode="after")
    def _queue_quotas_on_leveldb(self) -> EcqSettings:
        if self.backend == "jetstream" and (self.max_queue_messages or self.max_queue_bytes):
            raise ValueError("max_queue_messages and max_queue_bytes need backend leveldb: JetStream keeps no "
                             "per-queue counts to check a quota in the write's own commit (max_store_bytes works "
                             "on both backends)")
        return self

    def effective_pool_size(self) -> int:
        """Number of writer agents: ``writer_pool_size``, or the CPU count when it is 0."""
        return self.writer_pool_size or (os.cpu_count() or 1)

    def admin_token_value(self) -> str | None:
        """The admin bearer token itself, or None when there is none (``admin_token`` hides it from output)."""
        return self.admin_token.get_secret_value() if self.admin_token else None

    def effective_node_name(self) -> str:
        """This broker's name among the cluster's nodes: ``node_name``, or ``<hostname>-<pid>``."""
        return self.node_name or f"{re.sub(r'[^A-Za-z0-9_-]', '-', socket.gethostname())}-{os.getpid()}"

    def effective_max_packet_bytes(self) -> int:
        """Largest remaining length (MQTT 3.1.1 section 2.2.3, bytes) of a packet the broker reads:
        ``max_packet_bytes``, or ``max_payload_bytes`` plus a PUBLISH's largest topic and packet id."""
        return self.max_packet_bytes if self.max_packet_bytes is not None else self._write_packet_bytes()

    def _write_packet_bytes(self) -> int:
        return min(MAX_REMAINING_LENGTH, self.max_payload_bytes + PUBLISH_HEADER_ROOM)

    def in_effect(self) -> dict[str, Any]:
        """Every option as the broker uses it, JSON-ready (durations in seconds, secrets as ``**********``):
        an option whose 0 or None stands for a computed value shows that value (COMPUTED_OPTIONS)."""
        return {**self.model_dump(mode="json"), "writer_pool_size": self.effective_pool_size(),
                "max_packet_bytes": self.effective_max_packet_bytes(), "lake_dir": str(self.effective_lake_dir()),
                "node_name": self.effective_node_name()}

    def describe(self, listeners: list[str]) -> str:
        """One line for the start-up log: the MQTT ``listeners`` (``host:port``), the admin API, where data and
        the event lake live, and how many writer agents run."""
        admin = f"http://{self.admin_bind}/" if self.admin_bind else "off"
        lake = self.effective_lake_dir() if self.events else "off (events: false)"
        queues = "queues in LevelDB" if self.backend == "leveldb" else (
            f"queues on JetStream at {', '.join(self.nats_servers)} (namespace {self.jetstream_namespace}, "
            f"{self.jetstream_shards} shards, {self.jetstream_replicas} replicas; node {self.effective_node_name()})")
        return (f"MQTT on {', '.join(listeners) or 'no TCP listener'} (listen backlog {self.listen_backlog}); "
                f"admin API {admin}; {queues}; data_dir {self.data_dir}; lake {lake}; "
                f"{self.effective_pool_size()} writer agents")

    def effective_lake_dir(self) -> Path:
        """Where exported events go: ``lake_dir``, or ``<data_dir>/lake``."""
        return self.lake_dir or self.data_dir / storage_layout.LAKE

    def queues_dir(self) -> Path:
        """LevelDB's directory (``backend: leveldb``): ``<data_dir>/queues``."""
        return self.data_dir / storage_layout.QUEUES

    def events_dir(self) -> Path:
        """The event buffer's directory: ``<data_dir>/events``."""
        return self.data_dir / storage_layout.EVENTS


def did_you_mean(name: Any, known: Iterable[str], form: str = ": did you mean {}?") -> str:
    """``form`` filled with the name in ``known`` closest to ``name`` (difflib's similarity ratio of at least
    0.6), ``""`` when none is that close."""
    close = difflib.get_close_matches(str(name), sorted(known), n=1)
    return form.format(close[0]) if close else ""


def explain_errors(exc: ValidationError) -> str:
    """One line for a ValidationError of :class:`EcqSettings`: its problems joined by ``; ``, each as
    ``option: rule``, or ``unknown option X: did you mean Y?`` for an option EcqSettings does not have."""
    problems = []
    for error in exc.errors():
        where = ".".join(map(str, error["loc"])) or "options"
        if error["type"] == "extra_forbidden":
            problems.append(f"unknown option {where}{did_you_mean(where, EcqSettings.model_fields)}")
        else:
            problems.append(f"{where}: {error['msg']}")
    return "; ".join(problems)


def split_host_port(value: Any) -> tuple[str, int]:
    """``"127.0.0.1:18083"`` / ``"[::1]:18083"`` -> (host, port), an IPv6 host without its brackets. The host is
    required (``0.0.0.0`` for every IPv4 interface, ``[::]`` for every IPv6 one); an IPv6 address must be in
    brackets (RFC 3986 section 3.2.2), so that its last group cannot be taken for the port. Raises ValueError
    naming the rule."""
    host, sep, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    bracketed = host.startswith("[") and host.endswith("]")
    host = host[1:-1] if bracketed else host
    if not sep or not host or "[" in host or "]" in host or bracketed != _is_ipv6(host) \
            or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{value!r} is not HOST:PORT with a host and a port from 1 to 65535 (an IPv6 address "
                         f"in brackets: [::1]:1883)")
    return host, int(port)


def _is_ipv6(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address)
    except ValueError:
        return False


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ``::1``), without brackets."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
