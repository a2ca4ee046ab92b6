"""Which broker of a cluster serves an SCQ shared group (issue 33 point 7, ``backend: jetstream``).

A group's members may connect to any broker; its one position (ecq.queue.groups) is served by one broker at a time,
the holder of the group's lease, so that each entry goes to one member of the whole group and one broker acks the
position. Without it each broker would make a group of its own members over the same stored position: an entry sent
to one member on each broker, and two brokers' ack saves overwriting each other.

The lease is a key of the JetStream KV bucket ``NS_group_leases`` (``NS`` being ``jetstream_namespace``, one value
per key, ``jetstream_replicas`` copies): key T(the group's position id, ecq.queue.groups.group_position_id), T being
:func:`ecq.store.jsapi.token`, value the holder's node name. The bucket's TTL is ``scq_group_lease``: a lease not
renewed within it lapses (its holder was killed or lost NATS), and the server then stores a marker (nats-server 2.11
subject delete markers) that watchers see.

- A broker where a member joins takes the lease with a KV update expecting the key's last revision (0: none; a
  deleted or lapsed lease's marker otherwise), which fails while another broker holds it.
- The holder renews it every third of ``scq_group_lease``, expecting the revision it holds. A renewal refused for its
  revision (another broker took a lapsed lease) stops the group's delivery here at once; a renewal NATS did not
  answer is tried again, and once ``scq_group_lease`` has passed since the last renewal delivery stops too.
- When its last member went away (an UNSUBSCRIBE: once its deliveries in flight ended) the holder stops the group's
  delivery, waits for its acks to be saved, and deletes the lease with the revision it holds.
- A broker whose members wait (standbys: subscribed, sent nothing) watches the key and takes the lease once it is
  deleted or lapses (or, no marker seen, after a lease time without a renewal). The group's consumer then starts at
  the stored position: what the old holder sent and no member acked comes again (at least once per group).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import KeyValueConfig
from nats.js.errors import BadRequestError, KeyWrongLastSequenceError

from ecq.config import EcqSettings
from ecq.store.jsapi import REQUEST_TIMEOUT_S, token
from ecq.store.link import NatsLink

log = logging.getLogger(__name__)

OPEN_TIMEOUT_S = 10.0    # how long a starting broker waits for the bucket
CLOSE_TIMEOUT_S = 5.0    # how long a stopping broker waits to hand its leases back
RETRY_FRACTION = 10      # a renewal or take NATS did not answer is tried again after a tenth of the lease


class GroupLeases:
    """The leases of the SCQ groups with members on this broker, over ``link`` (the bus's).

    Three callables of the broker's event loop, each given a group's position id: ``serve`` attaches the group's
    consumer to its members (this broker holds the lease), ``stop`` detaches it and returns once its acks are saved,
    ``wanted`` is True while the group has a member here (or deliveries in flight to one). Every method runs on the
    broker's loop but :meth:`start`.
    """

    def __init__(self, settings: EcqSettings, link: NatsLink, *, serve: Callable[[str], Awaitable[None]],
                 stop: Callable[[str], Awaitable[None]], wanted: Callable[[str], bool]) -> None:
        self._settings, self._link = settings, link
        self._serve, self._stop, self._wanted = serve, stop, wanted
        self._lease_s = settings.scq_group_lease
        self._node = settings.effective_node_name().encode()
        self._kv: Any = None
        self._held: set[str] = set()                   # position ids whose lease this broker holds
        self._tasks: dict[str, asyncio.Task] = {}      # position id -> the task taking, keeping and handing it back
        self._wakes: dict[str, asyncio.Event] = {}     # position id -> set when its members changed
        self._closing = False

    def start(self) -> None:
        """Open the bucket, created when missing or brought to this ``scq_group_lease`` (blocking: call it off the
        broker loop). Raises what NATS raised, or TimeoutError."""
        self._link.call(self._open(), OPEN_TIMEOUT_S)

    async def _open(self) -> None:
        js = self._link.nc.jetstream(timeout=REQUEST_TIMEOUT_S)
        name = f"{self._settings.jetstream_namespace}_group_leases"
        config = KeyValueConfig(bucket=name, history=1, ttl=self._lease_s, limit_marker_ttl=self._lease_s,
                                replicas=self._settings.jetstream_replicas)
        try:
            self._kv = await js.create_key_value(config)
        except BadRequestError:  # made by a broker with another scq_group_lease: the last one started sets it
            stream = (await js.stream_info(f"KV_{name}")).config
            stream.max_age = stream.subject_delete_marker_ttl = self._lease_s
            stream.duplicate_window = min(stream.duplicate_window or self._lease_s, self._lease_s)
            await js.update_stream(stream)
            self._kv = await js.key_value(name)

    def holds(self, position: str) -> bool:
        """True while this broker holds the lease of the group whose position id is ``position``."""
        return position in self._held

    def members_changed(self, position: str) -> None:
        """This broker's members of the group ``position`` changed: one joined (the lease is taken, then the group
        served, unless a take is under way) or left (the lease is handed back once the group is not ``wanted``)."""
        if self._closing:
            return
        if (wake := self._wakes.get(position)) is not None:
            wake.set()
            return
        self._wakes[position] = asyncio.Event()
        self._tasks[position] = asyncio.ensure_future(self._run(position))

    async def close(self) -> None:
        """Stop serving every group and hand each lease held back (its acks saved first), at most CLOSE_TIMEOUT_S:
        the other brokers' members take the groups over without waiting for the leases to lapse."""
        self._closing = True
        for wake in self._wakes.values():
            wake.set()
        if self._tasks:
            await asyncio.wait(list(self._tasks.values()), timeout=CLOSE_TIMEOUT_S)

    async def _run(self, position: str) -> None:
        key, last = token(position), 0
        try:
            while not self._closing and self._wanted(position):
                try:
                    last = await self._serve_while_held(position, key, last)
                except Exception:  # a store read failing in the attach: try again, the lease handed back
                    log.exception("ECQ serving SCQ group %s failed; trying again", position)
                    await self._woken(position, self._lease_s / RETRY_FRACTION)
                    last = 0
        finally:
            del self._tasks[position], self._wakes[position]

    async def _serve_while_held(self, position: str, key: str, last: int) -> int:
        """Take the lease (expecting revision ``last``) and serve the group while it is held and wanted, then hand
        it back; or wait while another broker holds it. Returns the revision the next take expects."""
        taken_at = asyncio.get_running_loop().time()
        revision = await self._take(position, key, last)
        if revision is None:
            return await self._until_free(position, key)
        self._held.add(position)
        try:
            await self._serve(position)
            revision = await self._keep(position, key, revision, taken_at)
        finally:
            self._held.discard(position)
            await self._stop(position)
            if revision is not None:
                await self._hand_back(position, key, revision)
        return 0

    async def _take(self, position: str, key: str, last: int) -> int | None:
        """The revision of the lease once taken, or None while another broker holds it (or NATS does not answer)."""
        try:
            return await self._link.submit(self._kv.update(key, self._node, last=last))
        except KeyWrongLastSequenceError:
            return None
        except Exception as exc:
            self._log_failure("take the lease", position, exc)
            await self._woken(position, self._lease_s / RETRY_FRACTION)
            return None

    async def _until_free(self, position: str, key: str) -> int:
        """Wait until the lease is deleted or lapses, or this broker's members of the group changed; return the
        revision a take expects then (the deletion's or lapse's marker, 0: none)."""
        free = self._link.submit(self._watch(key))
        woken = asyncio.ensure_future(self._wakes[position].wait())
        try:
            await asyncio.wait([free, woken], return_when=asyncio.FIRST_COMPLETED)
        finally:
            free.cancel()
            woken.cancel()
        self._wakes[position].clear()
        if not free.done() or free.cancelled():
            return 0
        if (exc := free.exception()) is not None:
            self._log_failure("watch the lease", position, exc)
            await self._woken(position, self._lease_s / RETRY_FRACTION)
            return 0
        return free.result()

    async def _watch(self, key: str) -> int:
        """(On the link's loop.) The revision of the marker once the lease ``key`` is deleted or lapses; 0 when none
        is stored, or when a lease time passed without a renewal (its marker was not seen)."""
        watcher = await self._kv.watch(key)
        try:
            held = False
            while True:
                try:
                    entry = await watcher.updates(timeout=self._lease_s)
                except NatsTimeout:
                    return 0
                if entry is None:  # the stored value, if any, came first
                    if not held:
                        return 0
                elif entry.operation is not None:  # deleted, or lapsed (nats-py: a MaxAge marker is a PURGE)
                    return entry.revision
                else:
                    held = True
        finally:
            await watcher.stop()

    async def _keep(self, position: str, key: str, revision: int, taken_at: float) -> int | None:
        """Renew the lease (taken by a request sent at ``taken_at``, the loop's time) every third of its time while
        the group is ``wanted`` here; the revision held once it is not, None once the lease is lost: a renewal
        refused (another broker took it), or none answered within the lease time since the last renewal was sent
        (NATS may have let it lapse: its age counts from when NATS stored it, no sooner than the request was sent)."""
        loop = asyncio.get_running_loop()
        renewed, due = taken_at, taken_at + self._lease_s / 3
        while True:
            await self._woken(position, due - loop.time())
            if self._closing or not self._wanted(position):
                return revision
            if loop.time() < due:
                continue
            sent, expires = loop.time(), renewed + self._lease_s
            try:
                renewal = self._link.submit(self._kv.update(key, self._node, last=revision))
                revision = await asyncio.wait_for(renewal, max(expires - sent, 0.0))
                renewed, due = sent, sent + self._lease_s / 3
            except KeyWrongLastSequenceError:
                log.warning("ECQ lost the lease of SCQ group %s to another broker: its members here wait", position)
                return None
            except Exception as exc:  # NATS away or slow, or no answer before the lease expires
                if loop.time() >= expires:
                    log.warning("ECQ could not renew the lease of SCQ group %s within %.1f s (%s): its members here "
                                "wait", position, self._lease_s, exc or type(exc).__name__)
                    return None
                due = min(loop.time() + self._lease_s / RETRY_FRACTION, expires)

    async def _hand_back(self, position: str, key: str, revision: int) -> None:
        try:
            await self._link.submit(self._kv.delete(key, last=revision))
        except KeyWrongLastSequenceError:  # it lapsed meanwhile, and another broker may hold it now
            pass
        except Exception as exc:  # it lapses after scq_group_lease
            self._log_failure("hand back the lease", position, exc)

    def _log_failure(self, what: str, position: str, exc: BaseException) -> None:
        """A warning while the link to NATS is up; during an outage (logged by the store's link) a debug line, as
        each group tries again every tenth of the lease."""
        level = logging.WARNING if self._link.connected else logging.DEBUG
        log.log(level, "ECQ could not %s of SCQ group %s: %s", what, position, exc or type(exc).__name__)

    async def _woken(self, position: str, seconds: float) -> None:
        """Wait ``seconds`` or until the group's members change, whichever comes first."""
        wake = self._wakes[position]
        try:
            await asyncio.wait_for(wake.wait(), max(seconds, 0.0))
        except asyncio.TimeoutError:
            pass
        wake.clear()
