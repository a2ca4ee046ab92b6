"""What ECQ brokers of one cluster tell each other over NATS core subjects (not JetStream: nothing here is
stored): ordinary MQTT messages, so that a subscriber on any broker gets a PUBLISH made on any other, and
session takeover, so that a clientid is connected to one broker of the cluster at a time.

Subjects, ``NS`` being ``jetstream_namespace`` and ``T(x)`` the subject token of :func:`ecq.store.jetstream.token`:

- ``NS.mqtt``: one NATS message per MQTT message broadcast on a broker (headers ``Ecq-Origin``: the broker's
  node name, ``Ecq-Topic``: T(topic), ``Ecq-Qos``, and ``Ecq-Mqtt5`` for an MQTT 5.0 message's properties and
  expiry, :func:`ecq.broker.amqtt_hooks.cluster_form`); every other broker broadcasts it to its own subscribers
  and forwards it no further. Like EMQX's forwarding between nodes, the hop is at most once: a message sent while
  the link is down is not sent again. Retained messages are in the cluster's KV (:mod:`ecq.broker.cluster_state`).
- ``NS.session.T(clientid)``: the broker holding a connection or a persistent session of ``clientid`` subscribes
  here. A broker where that clientid connects anew asks (JSON ``{"node": name, "clean": CleanSession}``), and the
  holder closes its connection, saves the consumer's last acks, hands over the session
  (:class:`ecq.broker.cluster_state.SessionState`, none for a clean CONNECT), drops its copy, unsubscribes and
  answers with it; no subscriber means nobody else holds it (NATS answers "no responders" at once).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from ecq.broker.amqtt_hooks import cluster_form, from_cluster_form
from ecq.broker.cluster_state import MQTT5_HEADER, SessionState
from ecq.config import EcqSettings
from ecq.store.jsapi import token, untoken
from ecq.store.link import NatsLink

log = logging.getLogger(__name__)

TAKEOVER_TIMEOUT_S = 2.0   # how long a connect waits for another broker to release its clientid


class ClusterBus:
    """This broker's end of the cluster's core-NATS subjects.

    ``deliver(topic, payload, qos)`` broadcasts a message from another broker to this one's subscribers;
    ``release(clientid, clean)`` closes this broker's connection of ``clientid``, returns once its consumer's acks
    are saved, with its session handed over (dropped here; an empty one when ``clean``, the CleanSession flag of
    the new CONNECT). Both are coroutines run on the broker's event loop (``loop``). Raises NatsUnavailable from
    :meth:`start` when NATS cannot be reached.
    """

    def __init__(self, settings: EcqSettings, loop: asyncio.AbstractEventLoop, *,
                 deliver: Callable[[str, bytes, int], Awaitable[None]],
                 release: Callable[[str, bool], Awaitable[SessionState]]) -> None:
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

    @property
    def link(self) -> NatsLink:
        """The NATS connection of the bus (shared with :class:`ecq.broker.cluster_state.ClusterState`)."""
        return self._link

    def holds(self, clientid: str) -> bool:
        """True while this broker answers for ``clientid`` (a connection or a persistent session of it)."""
        return clientid in self._held

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
        if (form := cluster_form(payload)) is not None:
            headers[MQTT5_HEADER] = form
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
            data = from_cluster_form(msg.data, headers.get(MQTT5_HEADER))
        except (KeyError, ValueError) as exc:
            log.warning("ECQ: ignored a malformed cluster message from %s: %s", headers.get("Ecq-Origin"), exc)
            return
        self.received += 1
        asyncio.run_coroutine_threadsafe(self._deliver(topic, data, qos), self._loop)

    # --- takeover across brokers --------------------------------------------------------------------

    async def claim(self, clientid: str, clean: bool = False) -> SessionState | None:
        """Make this broker the one holding ``clientid`` (call on the broker loop when it connects, ``clean`` its
        CleanSession flag): any other broker's connection of it is closed and its consumer's acks saved first
        (bounded by 2 s). Returns the session the other broker handed over, or None when no broker answered
        (nobody else held it, it died, or this broker holds it already)."""
        return await self._link.submit(self._claim(clientid, clean))

    async def _claim(self, clientid: str, clean: bool) -> SessionState | None:
        if clientid in self._held:
            return None
        if not self._link.connected:  # nobody to ask: serve it here (logged once per outage by the store)
            return None
        subject = self._session_subject(clientid)
        handed_over = None
        request = json.dumps({"node": self._node, "clean": clean}).encode()
        try:
            answer = await self._link.nc.request(subject, request, timeout=TAKEOVER_TIMEOUT_S)
            handed_over = SessionState.from_bytes(answer.data)
        except NoRespondersError:
            pass  # nobody else holds it
        except NatsTimeout:
            log.warning("ECQ takeover of %s: the broker holding it did not answer within %.0f s",
                        clientid, TAKEOVER_TIMEOUT_S)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ECQ takeover of %s: the session handed over is unreadable (%s); it starts empty",
                        clientid, exc)
        except Exception as exc:  # NATS away: the clientid is served here anyway
            log.warning("ECQ takeover of %s could not ask the cluster: %s", clientid, exc)
        if clientid not in self._held:
            try:
                self._held[clientid] = await self._link.nc.subscribe(subject, cb=self._on_takeover)
            except Exception as exc:  # the link is closing or away: another broker's connect will not reach us
                log.warning("ECQ could not register %s with the cluster for takeover: %s", clientid, exc)
        return handed_over

    async def disown(self, clientid: str) -> None:
        """This broker no longer holds a connection nor a session of ``clientid``."""
        await self._link.submit(self._unhold(clientid))

    async def _unhold(self, clientid: str) -> None:
        if (sub := self._held.pop(clientid, None)) is not None:
            await sub.unsubscribe()

    async def _on_takeover(self, msg: Any) -> None:
        clientid = untoken(msg.subject.rsplit(".", 1)[1])
        try:
            request = json.loads(msg.data)
            node, clean = str(request["node"]), bool(request["clean"])
        except (ValueError, KeyError, TypeError):
            log.warning("ECQ takeover of %s: unreadable request %r; its session is handed over", clientid, msg.data)
            node, clean = msg.data.decode(errors="replace"), False
        log.info("ECQ takeover: %s connected to broker %s; closing its connection here", clientid, node)
        held = self._held.pop(clientid, None)
        state = SessionState(False)
        try:
            release = asyncio.run_coroutine_threadsafe(self._release(clientid, clean), self._loop)
            state = await asyncio.wrap_future(release)
        finally:
            await msg.respond(state.to_bytes())
            if held is not None:  # last: nats-py's unsubscribe cancels the task running this very callback
                await held.unsubscribe()

    def _session_subject(self, clientid: str) -> str:
        return f"{self._settings.jetstream_namespace}.session.{token(clientid)}"
