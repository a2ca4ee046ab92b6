"""Unit tests of the topic grammar in ecq/queue/topics.py."""

from __future__ import annotations

import pytest

from ecq.queue.topics import (
    MAX_SEQNO,
    BadWrite,
    RewindPoint,
    Write,
    delivery_topic,
    is_ecq_topic,
    is_position_id,
    is_scq_queue_id,
    parse_rewind_point,
    parse_rewind_target,
    parse_scq_filter,
    parse_target,
    parse_write,
    position_id,
    queue_filter,
    reading_filter,
    rewind_topic,
    scq_queue_id,
    scq_write_topic,
    write_topic,
)

LIMIT = 1024


def test_parse_write_splits_clientid_from_key():
    assert parse_write("$ECQ/w/car7/cfg/net/apn", 10, LIMIT) == Write("car7", "cfg/net/apn")


def test_payload_at_the_limit_is_accepted():
    assert parse_write("$ECQ/w/car7/k", LIMIT, LIMIT) == Write("car7", "k")


@pytest.mark.parametrize("topic, payload_size, reason", [
    ("$ECQ/car7/k", 1, "not_a_write"),
    ("$ECQ/w", 1, "not_a_write"),
    ("plain/topic", 1, "not_a_write"),
    ("$ECQ/w//k", 1, "empty_clientid"),
    ("$ECQ/w/", 1, "empty_clientid"),
    ("$ECQ/w/car7", 1, "empty_key"),
    ("$ECQ/w/car7/", 1, "empty_key"),
    ("$ECQ/w/car+/k", 1, "bad_clientid"),
    ("$ECQ/w/car#/k", 1, "bad_clientid"),
    ("$ECQ/w/car\x00/k", 1, "bad_clientid"),
    ("$ECQ/w/w/k", 1, "bad_clientid"),
    ("$ECQ/w/ctl/k", 1, "bad_clientid"),
    ("$ECQ/w/car7/k+", 1, "bad_key"),
    ("$ECQ/w/car7/a/#", 1, "bad_key"),
    ("$ECQ/w/car7/k\x00", 1, "bad_key"),
    ("$ECQ/w/car7/k", LIMIT + 1, "payload_too_large"),
])
def test_parse_write_refusals_name_their_reason(topic, payload_size, reason):
    with pytest.raises(BadWrite) as caught:
        parse_write(topic, payload_size, LIMIT)
    assert caught.value.reason == reason
    assert repr(topic) in str(caught.value)


def test_bad_write_is_a_value_error():
    assert issubclass(BadWrite, ValueError)


@pytest.mark.parametrize("topic, clientid", [
    ("$ECQ/w/car7/k", "car7"),
    ("$ECQ/w/car7", "car7"),
    ("$ECQ/w//k", None),
    ("$ECQ/w/", None),
    ("$ECQ/car7/k", None),
    ("other/w/car7/k", None),
    ("$ECQ/ctl/car7/rewind", "car7"),
    ("$ECQ/ctl//rewind", None),
])
def test_parse_target_reads_the_clientid_when_there_is_one(topic, clientid):
    assert parse_target(topic) == clientid


def test_queue_filter_and_delivery_topic():
    assert queue_filter("car7") == "$ECQ/car7/#"
    assert delivery_topic("car7", "cfg/net/apn") == "$ECQ/car7/cfg/net/apn"


def test_ecq_namespace():
    assert is_ecq_topic("$ECQ/w/car7/k") and is_ecq_topic("$ECQ/car7/#")
    assert not is_ecq_topic("$SYS/broker") and not is_ecq_topic("ecq/car7")


@pytest.mark.parametrize("clientid, key", [
    ("car7", "k"),
    ("car7", "cfg/net/apn"),
    ("car7", "/leading/and/trailing/"),
    ("car7", "a//b"),
    ("ünïcode", "clé/ß"),
])
def test_write_topic_round_trips_through_parse_write(clientid, key):
    topic = write_topic(clientid, key)
    assert topic == f"$ECQ/w/{clientid}/{key}"
    assert parse_write(topic, 0, LIMIT) == Write(clientid, key)
    assert parse_target(topic) == clientid


def test_write_topic_with_a_slash_in_the_clientid_parses_as_another_queue():
    assert parse_write(write_topic("a/b", "k"), 0, LIMIT) == Write("a", "b/k")


@pytest.mark.parametrize("payload, point", [
    ("0", RewindPoint("seqno", 0)),
    (b"42", RewindPoint("seqno", 42)),
    (str(MAX_SEQNO), RewindPoint("seqno", MAX_SEQNO)),
    ("earliest", RewindPoint("earliest")),
    (b"latest\n", RewindPoint("latest")),  # mosquitto_pub -l / -s send a trailing newline
    ("since:1700000000000", RewindPoint("since", 1_700_000_000_000)),
])
def test_rewind_payloads_parse_and_print_back(payload, point):
    assert parse_rewind_point(payload) == point
    assert parse_rewind_point(str(point)) == point


@pytest.mark.parametrize("payload", ["", "-1", "+1", "1.5", "0x10", "Latest", "earliest please", "since:", "since:-1",
                                     "since: 5", str(MAX_SEQNO + 1), "\u0663", b"\xff", b"x" * 100_000])
def test_malformed_rewind_payloads_are_bad_rewind(payload):
    with pytest.raises(BadWrite) as caught:
        parse_rewind_point(payload)
    assert caught.value.reason == "bad_rewind"
    assert len(str(caught.value)) < 200  # a large payload is not copied into the log line


def test_the_owner_may_rewind_its_queue():
    assert rewind_topic("car7") == "$ECQ/ctl/car7/rewind"
    assert parse_rewind_target("$ECQ/ctl/car7/rewind", "car7") == "car7"


@pytest.mark.parametrize("topic, publisher, reason", [
    ("$ECQ/ctl/car7/rewind", "car8", "not_owner"),
    ("$ECQ/ctl/car7/rewind", "", "not_owner"),
    ("$ECQ/ctl/car7/reset", "car7", "not_a_write"),
    ("$ECQ/ctl/car7/rewind/x", "car7", "not_a_write"),
    ("$ECQ/ctl/car7", "car7", "not_a_write"),
    ("$ECQ/car7/rewind", "car7", "not_a_write"),
    ("$ECQ/ctl//rewind", "", "empty_clientid"),
    ("$ECQ/ctl/c+r/rewind", "c+r", "bad_clientid"),
    ("$ECQ/ctl/w/rewind", "w", "bad_clientid"),
    ("$ECQ/ctl/ctl/rewind", "ctl", "bad_clientid"),
])
def test_rewind_topic_refusals_name_their_reason(topic, publisher, reason):
    with pytest.raises(BadWrite) as caught:
        parse_rewind_target(topic, publisher)
    assert caught.value.reason == reason


# --- SCQ (issue 33) -------------------------------------------------------------------------------------------------

def test_scq_write_goes_to_the_queue_id():
    assert parse_write(scq_write_topic("fleet", "cfg/apn"), 3, LIMIT) == Write(scq_queue_id("fleet"), "cfg/apn")
    assert scq_queue_id("fleet") == "$SCQ/fleet"


@pytest.mark.parametrize("topic, reason", [
    ("$SCQ/fleet/k", "not_a_write"),
    ("$SCQ/ctl/fleet/rewind", "not_a_write"),
    ("$SCQ/w//k", "empty_clientid"),
    ("$SCQ/w/fleet", "empty_key"),
    ("$SCQ/w/fl+eet/k", "bad_clientid"),
    ("$SCQ/w/fl#/k", "bad_clientid"),
    ("$SCQ/w/fl\x00/k", "bad_clientid"),
    ("$SCQ/w/w/k", "bad_clientid"),
    ("$SCQ/w/ctl/k", "bad_clientid"),
    ("$SCQ/w/fleet/k#", "bad_key"),
])
def test_scq_write_refusals_follow_the_clientid_rules(topic, reason):
    with pytest.raises(BadWrite) as caught:
        parse_write(topic, 1, LIMIT)
    assert caught.value.reason == reason


@pytest.mark.parametrize("topic_filter, queue_id", [
    ("$SCQ/fleet/#", "$SCQ/fleet"),
    ("$SCQ/fleet", None),
    ("$SCQ/fleet/+", None),
    ("$SCQ/+/#", None),
    ("$SCQ/#", None),
    ("$SCQ/w/#", None),
    ("$SCQ/ctl/#", None),
    ("$SCQ/a/b/#", None),
    ("$ECQ/fleet/#", None),
])
def test_parse_scq_filter(topic_filter, queue_id):
    assert parse_scq_filter(topic_filter) == queue_id


def test_scq_ids_never_meet_ecq_ids():
    """A reader's position id, an SCQ's queue id and an ECQ clientid are told apart (none holds another's form)."""
    position = position_id("$SCQ/fleet", "car/7")
    assert position == "$SCQ/fleet/car/7" and is_position_id(position) and not is_scq_queue_id(position)
    assert is_scq_queue_id("$SCQ/fleet") and not is_position_id("$SCQ/fleet")
    assert not is_position_id("car7") and not is_scq_queue_id("car7")
    assert delivery_topic("$SCQ/fleet", "k/x") == "$SCQ/fleet/k/x"
    assert reading_filter("$SCQ/fleet/k/x") == "$SCQ/fleet/#" and reading_filter("$ECQ/car/k") == "$ECQ/car/#"
    assert parse_target("$SCQ/w/fleet/k") == "$SCQ/fleet"
    assert parse_target("$SCQ/ctl/fleet/rewind") == "$SCQ/fleet"  # a refused rewind's event names its queue
