"""What ECQ brokers of one cluster tell each other over NATS core subjects (not JetStream: nothing here is
stored): ordinary MQTT messages, so that a subscriber on any broker gets a PUBLISH made on any other, and
session takeover, so that a clientid is connected to one broker of the cluster at a time.

Subjects, ``NS`` being ``jetstream_namespace`` and ``T(x)`` the subject token of :func:`ecq.store.jetstream.token`:

- ``NS.mqtt``: one NATS message per MQTT message broadcast on a broker (headers ``Ecq-Origin``: the broker's
  node name, ``Ecq-Topic``: T(topic), ``Ecq-Qos``); every other broker broadcasts it to its own subscribers
  and forwards it no further. Like EMQX's forwarding between nodes, the hop is at most once: a message sent while
  the link is down is not sent again. Retained messages stay on the broker that took them.
- ``NS.session.T(clientid)``: the broker holding a connection of ``clientid`` subscribes here. A broker where
  that clientid connects anew asks, and the holder closes its connection, saves the consumer's last acks,
  unsubscribes and answers; no subscriber means nobody else holds it (NATS answers "no responders" at once).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from ecq.store.jsapi import token, untoken
from ecq.store.link import NatsLink
from ecq.config import EcqSettings

log = logging.getLogger(__name__)

TAKEOVER_TIMEOUT_S = 2.0   # how long a connect waits for another broker to release its clientid


class ClusterBus:
    """This broker's end of the cluster's core-NATS subjects.

    ``deliver(topic, payload, qos)`` broadcasts a message from another broker to this one's subscribers;
    ``release(clientid)`` closes this broker's connection of ``clientid`` and returns once its consumer's acks
    are saved. Both are coroutines run on the broker's event loop (``loop``). Raises NatsUnavailable from
    :meth:`start` when NATS cannot be reached.
    """

    def __init__(self, settings: EcqSettings, loop: asyncio.AbstractEventLoop, *,
                 deliver: Callable[[str, bytes, int], Awaitable[None]],
                 release: Callable[[str], Awaitable[None]]) -> None:
        self._settings, self._loop = settings, loop
        self._deliver, self._release = deliver, release
        self._node = settings.effective_node_name()
        self._mqtt_subject = f"{settings.jetstream_namespace}.mqtt"
        self._link = NatsLink(settings, report_outages=False)  # the queue store's link reports them
        self._held: dict[str, Any] = {}  # clientid -> its NATS subscription (link loop only)
        self.forwarded = self.received = 0

    @property
    def connected(self) -> bool:
        """True while the link to NATS is up."""
        return self._link.connected

    def start(self) -> None:
        """Connect and listen to the other brokers' messages."""
        self._link.start()
        self._link.call(self._link.nc.subscribe(self._mqtt_subject, cb=self._on_mqtt), 10.0)

    def close(self) -> None:
        """Leave the cluster's subjects and close the link."""
        self._link.close()

    # --- ordinary MQTT messages ---------------------------------------------------------------------

    def forward(self, topic: str, payload: bytes, qos: int) -> None:
        """Send a message broadcast here to every other broker (returns at once; at most once)."""
        headers = {"Ecq-Origin": self._node, "Ecq-Topic": token(topic), "Ecq-Qos": str(qos)}
        self.forwarded += 1
        asyncio.run_coroutine_threadsafe(self._publish(payload, headers), self._link.loop)

    async def _publish(self, payload: bytes, headers: dict[str, str]) -> None:
        try:
            await self._link.nc.publish(self._mqtt_subject, payload, headers=headers)
        except Exception as exc:  # the link is down or closing: the hop is at most once
            log.debug("ECQ: message not forwarded to the cluster: %s", exc)

    async def _on_mqtt(self, msg: Any) -> None:
        headers = msg.headers or {}
        if headers.get("Ecq-Origin") == self._node:
            return
        try:
            topic, qos = untoken(headers["Ecq-Topic"]), int(headers.get("Ecq-Qos", "0"))
        except (KeyError, ValueError) as exc:
            log.warning("ECQ: ignored a malformed cluster message from %s: %s", headers.get("Ecq-Origin"), exc)
            return
        self.received += 1
        asyncio.run_coroutine_threadsafe(self._deliver(topic, msg.data, qos), self._loop)

    # --- takeover across brokers --------------------------------------------------------------------

    async def claim(self, clientid: str) -> None:
        """Make this broker the one holding ``clientid`` (call on the broker loop when it connects): any other
        broker's connection of it is closed and its consumer's acks saved first (bounded by 2 s)."""
        await self._link.submit(self._claim(clientid))

    async def _claim(self, clientid: str) -> None:
        if clientid in self._held:
            return
        if not self._link.connected:  # nobody to ask: serve it here (logged once per outage by the store)
            return
        subject = self._session_subject(clientid)
        try:
            await self._link.nc.request(subject, self._node.encode(), timeout=TAKEOVER_TIMEOUT_S)
        except NoRespondersError:
            pass  # nobody else holds it
        except NatsTimeout:
            log.warning("ECQ takeover of %s: the broker holding it did not answer within %.0f s",
                        clientid, TAKEOVER_TIMEOUT_S)
        except Exception as exc:  # NATS away: the clientid is served here anyway
            log.warning("ECQ takeover of %s could not ask the cluster: %s", clientid, exc)
        if clientid not in self._held:
            try:
                self._held[clientid] = await self._link.nc.subscribe(subject, cb=self._on_takeover)
            except Exception as exc:  # the link is closing or away: another broker's connect will not reach us
                log.warning("ECQ could not register %s with the cluster for takeover: %s", clientid, exc)

    async def disown(self, clientid: str) -> None:
        """This broker no longer holds a connection of ``clientid`` (it disconnected)."""
        await self._link.submit(self._unhold(clientid))

    async def _unhold(self, clientid: str) -> None:
        if (sub := self._held.pop(clientid, None)) is not None:
            await sub.unsubscribe()

    async def _on_takeover(self, msg: Any) -> None:
        clientid = untoken(msg.subject.rsplit(".", 1)[1])
        log.info("ECQ takeover: %s connected to broker %s; closing its connection here", clientid,
                 msg.data.decode(errors="replace"))
        held = self._held.pop(clientid, None)
        try:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._release(clientid), self._loop))
        finally:
            await msg.respond(b"released")
            if held is not None:  # last: nats-py's unsubscribe cancels the task running this very callback
                await held.unsubscribe()

    def _session_subject(self, clientid: str) -> str:
        return f"{self._settings.jetstream_namespace}.session.{token(clientid)}"
