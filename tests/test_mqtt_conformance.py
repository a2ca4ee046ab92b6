"""Ordinary (non-``$ECQ``) topics behave as MQTT 3.1.1 says, where amqtt 0.12.1 alone does not.

Against a real `ecq broker` process over TCP. :class:`Mqtt` is a raw-socket MQTT 3.1.1 client so that
the tests can read what paho hides (RETAIN and DUP flags, packet ids, CONNACK session-present) and
withhold acknowledgements. Section numbers are those of the MQTT 3.1.1 standard.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from dataclasses import dataclass

from tests.census_plugin import ANSWER as CENSUS_ANSWER, ASK as CENSUS_ASK, PLUGIN_PATH as CENSUS
from tests.harness import RawClient, fixed_header, metrics_text, wait_until, write

PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP, SUBACK, PINGRESP = 3, 4, 5, 6, 7, 9, 13
SESSION_MONITOR_WAIT_S = 2.5  # amqtt's session monitor runs every 1 s; nothing a client sees tells it ran


@dataclass
class Publish:
    """One PUBLISH received by :class:`Mqtt`."""

    topic: str
    payload: bytes
    qos: int
    retain: bool
    dup: bool
    packet_id: int | None


def _utf8(text: str) -> bytes:
    data = text.encode()
    return struct.pack(">H", len(data)) + data


class Mqtt(RawClient):
    """A raw MQTT 3.1.1 client on a socket that reads flags and packet ids; it acknowledges nothing unless told to."""

    def __init__(self, port: int, client_id: str, clean: bool = True, keepalive: int = 60,
                 will: tuple[str, bytes] | None = None) -> None:
        self._held: list[Publish] = []  # PUBLISHes read while waiting for another packet
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        flags = 0x02 if clean else 0
        payload = _utf8(client_id)
        if will:
            flags |= 0x04  # Will flag, Will QoS 0, no Will retain
            payload += _utf8(will[0]) + struct.pack(">H", len(will[1])) + will[1]
        self.send(0x10, b"\x00\x04MQTT\x04" + bytes([flags]) + struct.pack(">H", keepalive) + payload)
        kind, body = self._recv()
        assert kind >> 4 == 2 and body[1] == 0, f"CONNECT refused: {kind:#x} {body!r}"
        self.session_present = bool(body[0] & 1)

    def subscribe(self, topic_filter: str, qos: int, packet_id: int = 1) -> int:
        """SUBSCRIBE and return the granted QoS; PUBLISHes that come first are kept for :meth:`next_publish`."""
        self.send(0x82, struct.pack(">H", packet_id) + _utf8(topic_filter) + bytes([qos]))
        kind, body = self._recv_skipping_publishes()
        assert kind >> 4 == SUBACK, f"expected SUBACK, got {kind:#x}"
        return body[2]

    def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False, packet_id: int = 1) -> None:
        """PUBLISH (QoS 0 or 1); for QoS 1 wait for the PUBACK."""
        body = _utf8(topic) + (struct.pack(">H", packet_id) if qos else b"") + payload
        self.send(0x30 | qos << 1 | int(retain), body)
        if qos:
            assert self._recv_skipping_publishes()[0] >> 4 == PUBACK

    def next_publish(self, timeout: float = 5.0) -> Publish:
        """The next PUBLISH (raises socket.timeout if none comes)."""
        if self._held:
            return self._held.pop(0)
        self.sock.settimeout(timeout)
        kind, body = self._recv()
        assert kind >> 4 == PUBLISH, f"expected PUBLISH, got {kind:#x}"
        return self._parse(kind, body)

    def nothing_within(self, seconds: float) -> bool:
        """True when no packet at all arrives within ``seconds``."""
        if self._held:
            return False
        self.sock.settimeout(seconds)
        try:
            self._recv()
        except socket.timeout:
            return True
        return False

    def ack(self, kind: int, packet_id: int) -> None:
        """Send PUBACK, PUBREC, PUBREL (with its required flags) or PUBCOMP for ``packet_id``."""
        self.send(kind << 4 | (0x02 if kind == PUBREL else 0), struct.pack(">H", packet_id))

    def expect(self, kind: int, timeout: float = 5.0) -> bytes:
        """The body of the next packet, which must be of type ``kind``."""
        self.sock.settimeout(timeout)
        got, body = self._recv()
        assert got >> 4 == kind, f"expected packet type {kind}, got {got:#x}"
        return body

    def ping(self) -> bool:
        self.send(0xC0, b"")
        return self.expect(PINGRESP) == b""

    def disconnect(self) -> None:
        self.send(0xE0, b"")
        self.sock.close()

    def closed_by_broker_within(self, seconds: float) -> bool:
        """True when the broker closes the connection within ``seconds`` (nothing may arrive before)."""
        self.sock.settimeout(seconds)
        try:
            return self.sock.recv(1) == b""
        except socket.timeout:
            return False
        except ConnectionResetError:
            return True

    def _recv_skipping_publishes(self) -> tuple[int, bytes]:
        self.sock.settimeout(5)
        while True:
            kind, body = self._recv()
            if kind >> 4 != PUBLISH:
                return kind, body
            self._held.append(self._parse(kind, body))

    @staticmethod
    def _parse(kind: int, body: bytes) -> Publish:
        qos = kind >> 1 & 3
        size = struct.unpack(">H", body[:2])[0]
        topic, rest = body[2:2 + size].decode(), body[2 + size:]
        packet_id = struct.unpack(">H", rest[:2])[0] if qos else None
        return Publish(topic, rest[2:] if qos else rest, qos, bool(kind & 1), bool(kind & 8), packet_id)


def metric(broker, name: str) -> float:
    """The value of one sample line of the broker's Prometheus exposition (0 when absent)."""
    for line in metrics_text(broker).splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


# --- 1. retained messages ----------------------------------------------------------------------------

def test_retained_message_goes_only_to_a_new_matching_subscription(broker, connect):
    """Section 3.3.1.3: a retained message goes to a new subscription matching it, with RETAIN=1 at
    min(granted QoS, message QoS). amqtt sent every connecting client the retained messages matching
    any client's subscriptions, at QoS 0, and sent a QoS 0 retained message at the subscription's QoS."""
    watcher = connect(broker.port, "watcher")
    assert watcher.subscribe("news/#", 1) == 1
    publisher = Mqtt(broker.port, "publisher")
    publisher.publish("news/today", b"sunny", qos=1, retain=True)
    publisher.publish("news/cheap", b"free", qos=0, retain=True)
    assert len(watcher.expect(2)) == 2

    newcomer = Mqtt(broker.port, "newcomer")
    assert newcomer.subscribe("other/#", 1) == 1
    assert newcomer.nothing_within(1.0), "got retained messages of another client's subscription"

    assert newcomer.subscribe("news/today", 1, packet_id=2) == 1
    got = newcomer.next_publish()
    assert (got.topic, got.payload, got.qos, got.retain) == ("news/today", b"sunny", 1, True)
    newcomer.ack(PUBACK, got.packet_id)

    assert newcomer.subscribe("news/cheap", 2, packet_id=3) == 2
    got = newcomer.next_publish()
    assert (got.topic, got.payload, got.qos, got.retain) == ("news/cheap", b"free", 0, True)
    assert newcomer.nothing_within(0.5)


def test_retained_message_is_not_sent_again_on_reconnect(broker):
    """Section 3.3.1.3: retained messages are sent when a subscription is made, not when a persistent
    session reconnects (amqtt sent them again, at QoS 0, on every connect)."""
    Mqtt(broker.port, "setter").publish("cfg/mode", b"eco", qos=1, retain=True)
    reader = Mqtt(broker.port, "reader", clean=False)
    assert reader.subscribe("cfg/#", 1) == 1
    got = reader.next_publish()
    assert (got.topic, got.retain) == ("cfg/mode", True)
    reader.ack(PUBACK, got.packet_id)
    assert reader.nothing_within(0.5)
    reader.disconnect()

    again = Mqtt(broker.port, "reader", clean=False)
    assert again.nothing_within(1.0), "a retained message was sent again on reconnect"


# --- 2. keepalive ------------------------------------------------------------------------------------

def test_silent_client_is_disconnected_after_one_and_a_half_keepalives_and_its_will_published(broker, connect):
    """Section 3.1.2.10: no packet within 1.5 x keepalive closes the connection; section 3.1.2.5: the Will
    is published. amqtt 0.12.1 ignored the read timeout."""
    watcher = connect(broker.port, "will-watcher")
    assert watcher.subscribe("wills/#", 0) == 0
    silent = Mqtt(broker.port, "silent", keepalive=1, will=("wills/silent", b"gone"))
    started = time.monotonic()
    assert silent.closed_by_broker_within(4.0), "the broker kept a silent client past 1.5 x keepalive"
    elapsed = time.monotonic() - started
    assert 1.2 <= elapsed <= 3.5, elapsed
    [will] = watcher.expect(1, timeout=5)
    assert (will.topic, will.payload) == ("wills/silent", b"gone")


def test_client_that_pings_within_keepalive_stays_connected(broker):
    """The keepalive check must not close a client that sends a packet at least every keepalive."""
    pinger = Mqtt(broker.port, "pinger", keepalive=1)
    deadline = time.monotonic() + 3.5
    while time.monotonic() < deadline:
        time.sleep(0.6)
        assert pinger.ping()


# --- 3. in-flight QoS 1 and 2 messages of a persistent session ---------------------------------------

def test_unacked_qos1_message_is_resent_with_dup_and_same_packet_id_on_reconnect(broker):
    """Section 4.4: on reconnect with CleanSession=0 unacknowledged PUBLISHes are sent again with their
    packet ids and DUP=1 (amqtt dropped them when the connection closed, its issue #401)."""
    sub = Mqtt(broker.port, "slow-sub", clean=False)
    assert sub.subscribe("jobs/#", 1) == 1
    Mqtt(broker.port, "jobber").publish("jobs/1", b"work", qos=1)
    first = sub.next_publish()
    assert (first.topic, first.qos, first.dup) == ("jobs/1", 1, False)
    sub.disconnect()  # without the PUBACK

    again = Mqtt(broker.port, "slow-sub", clean=False)
    resent = again.next_publish()
    assert (resent.topic, resent.payload, resent.qos, resent.dup, resent.packet_id) == (
        "jobs/1", b"work", 1, True, first.packet_id)
    again.ack(PUBACK, resent.packet_id)
    assert again.nothing_within(0.5)
    again.disconnect()
    assert Mqtt(broker.port, "slow-sub", clean=False).nothing_within(1.0), "an acked message came again"


def test_qos2_flow_resumes_on_reconnect_with_publish_then_pubrel(broker):
    """Section 4.4: an unacknowledged QoS 2 PUBLISH is resent with DUP=1; once PUBREC came, the PUBREL is
    resent instead."""
    sub = Mqtt(broker.port, "q2-sub", clean=False)
    assert sub.subscribe("exact/#", 2) == 2
    Mqtt(broker.port, "q2-pub").publish("exact/1", b"once", qos=1)
    first = sub.next_publish()
    assert first.qos == 1  # published at QoS 1: min(1, 2)
    sub.ack(PUBACK, first.packet_id)

    sub.send(0x34, _utf8("exact/2") + struct.pack(">H", 7) + b"twice")  # a QoS 2 PUBLISH from the client
    sub.expect(PUBREC)
    sub.ack(PUBREL, 7)
    sub.expect(PUBCOMP)
    # exact/2 is delivered back to the sender itself at QoS 2
    delivered = sub.next_publish()
    assert (delivered.topic, delivered.qos) == ("exact/2", 2)
    sub.disconnect()  # no PUBREC

    again = Mqtt(broker.port, "q2-sub", clean=False)
    resent = again.next_publish()
    assert (resent.topic, resent.qos, resent.dup, resent.packet_id) == ("exact/2", 2, True, delivered.packet_id)
    again.ack(PUBREC, resent.packet_id)
    assert again.expect(PUBREL) == struct.pack(">H", resent.packet_id)
    again.disconnect()  # no PUBCOMP

    third = Mqtt(broker.port, "q2-sub", clean=False)
    assert third.expect(PUBREL) == struct.pack(">H", resent.packet_id)
    third.ack(PUBCOMP, resent.packet_id)
    assert third.nothing_within(0.5)


def test_puback_after_amqtts_five_seconds_settles_the_message(broker):
    """amqtt stops waiting for a PUBACK after 5 s; the message is then kept for a resend on reconnect, and a
    PUBACK that comes later settles it, so it is not sent again."""
    sub = Mqtt(broker.port, "late-acker", clean=False)
    assert sub.subscribe("late/#", 1) == 1
    Mqtt(broker.port, "late-pub").publish("late/1", b"x", qos=1)
    got = sub.next_publish()
    time.sleep(6)  # past amqtt's fixed 5 s PUBACK wait: what is under test is what happens after it
    sub.ack(PUBACK, got.packet_id)
    assert sub.ping()  # the PUBACK was read before this PINGRESP
    sub.disconnect()
    assert Mqtt(broker.port, "late-acker", clean=False).nothing_within(1.0), "a late-acked message came again"


def test_unacked_messages_kept_for_resend_are_bounded(make_broker):
    """``session_max_inflight``: beyond it the oldest unacked message is dropped (ecq_session_dropped_total)."""
    broker = make_broker(session_max_inflight=2)
    sub = Mqtt(broker.port, "hoarder", clean=False)
    assert sub.subscribe("h/#", 1) == 1
    sender = Mqtt(broker.port, "h-pub")
    for i in range(4):
        sender.publish(f"h/{i}", b"v", qos=1, packet_id=i + 1)
    assert sorted(sub.next_publish().topic for _ in range(4)) == ["h/0", "h/1", "h/2", "h/3"]
    sub.disconnect()  # acking none
    assert wait_until(lambda: metric(broker, 'ecq_session_dropped_total{reason="inflight_full"}') == 2)

    again = Mqtt(broker.port, "hoarder", clean=False)
    resent = [again.next_publish() for _ in range(2)]
    assert all(p.dup for p in resent)
    assert sorted(p.topic for p in resent) == ["h/2", "h/3"]


def test_ecq_delivery_is_not_resent_twice_on_reconnect(broker, connect):
    """ECQ redelivers its own queue messages; amqtt's resend must not send them a second time."""
    consumer = Mqtt(broker.port, "ecq-c", clean=False)
    assert consumer.subscribe("$ECQ/ecq-c/#", 1) == 1
    connect(broker.port, "producer").publish("$ECQ/w/ecq-c/k", b"v", qos=1)
    assert consumer.next_publish().topic == "$ECQ/ecq-c/k"
    consumer.disconnect()  # without the PUBACK

    again = Mqtt(broker.port, "ecq-c", clean=False)
    assert again.subscribe("$ECQ/ecq-c/#", 1) == 1
    redelivered = again.next_publish()
    assert (redelivered.topic, redelivered.payload) == ("$ECQ/ecq-c/k", b"v")
    again.ack(PUBACK, redelivered.packet_id)
    assert again.nothing_within(1.0), "the ECQ message was delivered twice"


# --- 4. persistent sessions under anonymous authentication --------------------------------------------

def test_persistent_anonymous_session_keeps_subscription_and_offline_messages(broker, connect):
    """Sections 3.1.2.4 and 3.2.2.2: a CleanSession=0 session outlives the connection, CONNACK says
    session-present, QoS 1 messages published meanwhile are delivered (with RETAIN=0: they were not
    published retained). amqtt's session monitor deleted every anonymous session within ~1 s."""
    sub = Mqtt(broker.port, "away", clean=False)
    assert not sub.session_present
    assert sub.subscribe("a/b", 1) == 1
    sub.disconnect()
    watcher = connect(broker.port, "a-watcher")
    assert watcher.subscribe("a/b", 1) == 1
    time.sleep(SESSION_MONITOR_WAIT_S)
    Mqtt(broker.port, "sender").publish("a/b", b"while away", qos=1)
    watcher.expect(1)  # the broker handles the subscriptions of a message in order: "away" came first

    back = Mqtt(broker.port, "away", clean=False)
    assert back.session_present
    got = back.next_publish()
    assert (got.topic, got.payload, got.qos, got.retain) == ("a/b", b"while away", 1, False)


def test_session_expiry_forgets_a_disconnected_session(make_broker):
    """``session_expiry`` bounds how long a disconnected persistent session is kept."""
    broker = make_broker(session_expiry="1s")
    sub = Mqtt(broker.port, "brief", clean=False)
    assert sub.subscribe("a/b", 1) == 1
    sub.disconnect()
    time.sleep(SESSION_MONITOR_WAIT_S + 1)  # expiry of 1 s, checked by amqtt's monitor every 1 s
    assert not Mqtt(broker.port, "brief", clean=False).session_present


# --- memory bounds -----------------------------------------------------------------------------------

def test_offline_queue_keeps_the_newest_messages_and_counts_the_dropped(make_broker):
    """``session_max_queued``: a full offline queue drops its oldest message (metric ecq_session_dropped_total)."""
    broker = make_broker(session_max_queued=3)
    sub = Mqtt(broker.port, "bounded", clean=False)
    assert sub.subscribe("feed", 1) == 1
    sub.disconnect()
    sender = Mqtt(broker.port, "feeder")
    for i in range(5):
        sender.publish("feed", f"m{i}".encode(), qos=1, packet_id=i + 1)
    assert wait_until(lambda: metric(broker, 'ecq_session_dropped_total{reason="queue_full"}') == 2)

    back = Mqtt(broker.port, "bounded", clean=False)
    payloads = []
    for _ in range(3):
        got = back.next_publish()
        back.ack(PUBACK, got.packet_id)
        payloads.append(got.payload)
    assert sorted(payloads) == [b"m2", b"m3", b"m4"]
    assert back.nothing_within(0.5)


def test_a_reconnecting_session_gets_its_offline_queue_before_newer_messages(make_broker):
    """``session_max_queued`` and section 4.6 (ordered topics) across a reconnect. The session subscribes to its
    ECQ queue and to an ordinary topic in one segment, leaves one message unacked and goes away; 60 more come
    while it is offline (the newest 50 kept). While it reconnects, amqtt resends the unacked one and waits for its
    PUBACK before it sends the queue; a message published in that window was sent at once, ahead of the 50 queued
    and beyond the bound. It joins the queue instead: exactly the newest 50 come, in order, each once."""
    broker = make_broker(session_max_queued=50)
    sub = Mqtt(broker.port, "ps", clean=False)
    sub.send_raw(b"".join(fixed_header(0x82, 2 + len(_utf8(f)) + 1) + struct.pack(">H", pid) + _utf8(f) + b"\x01"
                          for pid, f in ((1, "$ECQ/ps/#"), (2, "plain/#"))))
    assert [sub.expect(SUBACK) for _ in range(2)] == [b"\x00\x01\x01", b"\x00\x02\x01"]
    sender, watcher = Mqtt(broker.port, "ps-pub"), Mqtt(broker.port, "ps-watch")
    assert watcher.subscribe("plain/#", 0) == 0
    sender.publish("plain/t", b"0", qos=1)
    assert sub.next_publish().payload == b"0"
    sub.disconnect()  # without its PUBACK: kept for a resend
    for i in range(1, 61):
        sender.publish("plain/t", str(i).encode(), qos=1, packet_id=i + 1)
    assert wait_until(lambda: metric(broker, 'ecq_session_dropped_total{reason="queue_full"}') == 10)

    back = Mqtt(broker.port, "ps", clean=False)
    resent = back.next_publish()
    assert (resent.payload, resent.dup) == (b"0", True)
    sender.publish("plain/t", b"61", qos=1, packet_id=62)  # while the resend waits for its PUBACK
    while watcher.next_publish().payload != b"61":  # fanned out to every subscriber by now
        pass
    back.ack(PUBACK, resent.packet_id)
    received = []
    for _ in range(50):
        message = back.next_publish()
        back.ack(PUBACK, message.packet_id)
        received.append(int(message.payload))
    assert received == list(range(12, 62))
    assert back.nothing_within(0.5)
    assert metric(broker, 'ecq_session_dropped_total{reason="queue_full"}') == 11


def test_overlapping_subscriptions_deliver_once_at_the_highest_qos(broker, connect):
    """Section 3.3.5: a message matching several subscriptions of one client is delivered respecting the
    highest granted QoS; this broker sends it once."""
    sub = Mqtt(broker.port, "overlap")
    assert sub.subscribe("s/#", 0) == 0
    assert sub.subscribe("s/+", 1, packet_id=2) == 1
    connect(broker.port, "s-pub").publish("s/x", b"one", qos=1)
    got = sub.next_publish()
    assert (got.topic, got.qos) == ("s/x", 1)
    sub.ack(PUBACK, got.packet_id)
    assert sub.nothing_within(1.0), "delivered more than once"


def test_qos_of_a_delivery_is_the_lower_of_publish_and_subscription(broker):
    """Section 3.8.4: a QoS 0 PUBLISH reaches a QoS 2 subscriber at QoS 0 (amqtt used the subscription's QoS)."""
    sub = Mqtt(broker.port, "downgrade")
    assert sub.subscribe("d/#", 2) == 2
    Mqtt(broker.port, "d-pub").publish("d/x", b"zero", qos=0)
    got = sub.next_publish()
    assert (got.topic, got.qos) == ("d/x", 0)


def test_paho_persistent_subscriber_gets_message_sent_while_offline(broker, connect):
    """The same with paho-mqtt on both sides."""
    sub = connect(broker.port, "paho-away", clean_session=False)
    assert sub.subscribe("p/q", 1) == 1
    sub.close()
    watcher = connect(broker.port, "p-watcher")
    assert watcher.subscribe("p/q", 1) == 1
    time.sleep(SESSION_MONITOR_WAIT_S)
    connect(broker.port, "paho-pub").publish("p/q", b"hello", qos=1)
    watcher.expect(1)  # so the message was handled while "paho-away" was offline
    back = connect(broker.port, "paho-away", clean_session=False)
    [got] = back.expect(1)
    assert (got.topic, got.payload, got.qos) == ("p/q", b"hello", 1)


def census(asker, connected: int) -> dict:
    """The census plugin's counts, once its handler count settles at ``connected`` (closing connections end
    asynchronously); the last answer if it never does within 10 s."""
    answer: dict = {}

    def settled() -> bool:
        nonlocal answer
        asker.publish(CENSUS_ASK, b"")
        answer = json.loads(asker.expect(1)[0].payload)
        return answer["referenced"]["handlers"] == connected

    wait_until(settled, 10, 0.2)
    return answer


def test_a_subscribe_does_not_format_every_subscriber(broker_with_plugin, connect):
    """amqtt 0.12.1 formatted its whole subscription map after every SUBSCRIBE (for a debug line, even with debug
    logging off): N consumers subscribing cost O(N^2) Session reprs, 1,890 for these 30 (60 SUBSCRIBEs)."""
    broker = broker_with_plugin(CENSUS)
    asker = connect(broker.port, "asker")
    assert asker.subscribe(CENSUS_ANSWER) == 1
    before = census(asker, connected=1)["session_reprs"]
    for n in range(30):
        subscriber = connect(broker.port, f"s{n}")
        assert subscriber.subscribe(f"$ECQ/s{n}/#") == 1 and subscriber.subscribe(f"t/{n}") == 1
    assert census(asker, connected=31)["session_reprs"] - before < 30


def test_an_offline_persistent_session_keeps_its_subscriptions_but_not_its_closed_connection(
        broker_with_plugin, connect):
    """Section 3.1.2.4 keeps a CleanSession=0 session, not its connection: amqtt 0.12.1 kept each offline
    session's protocol handler (queues, streams, socket objects, reader task) until the session expired, and
    a closed connection's stream reader waited for Python's cyclic GC."""
    broker = broker_with_plugin(CENSUS)
    asker = connect(broker.port, "asker")
    assert asker.subscribe(CENSUS_ANSWER) == 1
    for n in range(20):
        away = Mqtt(broker.port, f"away{n}", clean=False)
        assert away.subscribe("a/b", 1) == 1
        assert away.subscribe(f"$ECQ/away{n}/#", 1) == 1
        if n % 2:
            away.disconnect()
        else:  # no DISCONNECT: the connection fails
            away.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            away.sock.close()

    counts = census(asker, connected=1)
    assert counts["referenced"]["handlers"] == 1
    # The asker's reader, and the readiness probe's (it closed before CONNECT; the failed read's traceback keeps its
    # reader until a cyclic GC): without the fix every closed connection's reader was there, 22.
    assert counts["live"]["stream_readers"] <= 2
    assert counts["referenced"]["sessions"] == 1  # the asker's: the offline sessions are kept in the store only

    Mqtt(broker.port, "sender").publish("a/b", b"while away", qos=1)
    write(asker, "away3", "k", b"queued")
    back = Mqtt(broker.port, "away3", clean=False)
    assert back.session_present
    got = sorted((p.topic, p.payload) for p in (back.next_publish(), back.next_publish()))
    assert got == [("$ECQ/away3/k", b"queued"), ("a/b", b"while away")]
