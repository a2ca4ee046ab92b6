"""Property tests (hypothesis) of the two uses of ``ecq.queue.topic_tree.TopicTree``, each against amqtt 0.12.1's own
matcher (``Broker._matches``, MQTT 3.1.1 section 4.7: ``+`` one level, ``#`` this level and all below, a topic
starting with ``$`` not matched by a wildcard at the first level): ``stored_sessions.FilterIndex``, the tree of stored
sessions' filters each fan-out consults, matches a topic as amqtt matches it against each filter in turn, through
random sequences of adds and removes; ``amqtt_hooks.fleet_scale.RetainedTopics``, amqtt's retained table with a tree
of its topics, gives a filter the retained messages amqtt's walk of every retained topic would, through random
retains, replaces, deletes and clears. Removing every name prunes each tree back to nothing.

The model is a plain dict (filter, client id) -> granted QoS walked with amqtt's own matcher. For the filters and
topics drawn here (valid ones: a ``#`` only last, ``+`` and ``#`` whole levels, empty levels, ``$`` levels, no
wildcard in a topic) amqtt's matcher follows the rules of section 4.7, so it is the reference as it is.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from amqtt.broker import Broker, RetainedApplicationMessage
from ecq.broker.amqtt_hooks.fleet_scale import RetainedTopics
from ecq.broker.stored_sessions import FilterIndex

SETTINGS = settings(max_examples=400, deadline=None)

_AMQTT = SimpleNamespace(logger=logging.getLogger("amqtt.broker"))  # _matches reads only its logger
_TOPIC_LEVELS = st.sampled_from(["a", "b", "", "$s", "$"])
_FILTER_LEVELS = st.sampled_from(["a", "b", "", "$s", "+", "+"])

topics = st.lists(_TOPIC_LEVELS, min_size=1, max_size=4).map("/".join).filter(bool)
filters = st.builds(lambda levels, multi: "/".join(levels + ["#"] * multi),
                    st.lists(_FILTER_LEVELS, max_size=4), st.booleans()).filter(bool)
clients = st.sampled_from(["c1", "c2", "c3"])
adds = st.tuples(st.just("add"), filters, clients, st.integers(0, 2))
removes = st.tuples(st.just("remove"), filters, clients, st.just(None))
operations = st.lists(st.one_of(adds, adds, removes), max_size=30)


def amqtt_matches(topic: str, topic_filter: str) -> bool:
    return Broker._matches(_AMQTT, topic, topic_filter)


def walk(model: dict[tuple[str, str], int], topic: str) -> dict[str, int]:
    """client id -> highest QoS among its filters matching ``topic``, one filter at a time as amqtt's fan-out does."""
    found: dict[str, int] = {}
    for (topic_filter, clientid), qos in model.items():
        if amqtt_matches(topic, topic_filter):
            found[clientid] = max(qos, found.get(clientid, -1))
    return found


def apply(index: FilterIndex, model: dict[tuple[str, str], int], operation: tuple) -> None:
    kind, topic_filter, clientid, qos = operation
    if kind == "add":
        index.add(topic_filter, clientid, qos)
        model[topic_filter, clientid] = qos
    else:
        index.remove(topic_filter, clientid)
        model.pop((topic_filter, clientid), None)


@SETTINGS
@given(operations, st.lists(topics, min_size=1, max_size=8))
def test_match_agrees_with_amqtts_matcher_through_adds_and_removes(steps, probes):
    index, model = FilterIndex(), {}
    for step in steps:
        apply(index, model, step)
        for topic in probes:
            assert index.match(topic) == walk(model, topic), (step, topic)


@SETTINGS
@given(operations)
def test_removing_every_filter_leaves_an_empty_tree(steps):
    index, model = FilterIndex(), {}
    for step in steps:
        apply(index, model, step)
    for topic_filter, clientid in list(model):
        apply(index, model, ("remove", topic_filter, clientid, None))
    assert index._root == {}


def test_the_rules_of_section_4_7_hold_for_the_reference():
    """The reference itself, on the examples of MQTT 3.1.1 sections 4.7.1.2, 4.7.1.3 and 4.7.2."""
    assert amqtt_matches("sport/tennis/player1", "sport/tennis/player1/#")
    assert amqtt_matches("sport", "sport/#")
    assert amqtt_matches("sport/", "sport/+")
    assert not amqtt_matches("sport", "sport/+")
    assert amqtt_matches("/finance", "+/+") and amqtt_matches("/finance", "/+")
    assert not amqtt_matches("/finance", "+")
    assert not amqtt_matches("$SYS/x", "#") and not amqtt_matches("$SYS/monitor/Clients", "+/monitor/Clients")
    assert amqtt_matches("$SYS/x", "$SYS/#") and amqtt_matches("$SYS/monitor/Clients", "$SYS/monitor/+")


payloads = st.sampled_from([b"1", b"2"])
retains = st.tuples(st.just("retain"), topics, payloads)
deletes = st.tuples(st.sampled_from(["pop", "del"]), topics, st.just(None))
retained_operations = st.lists(st.one_of(retains, retains, deletes, st.just(("clear", None, None))), max_size=30)


def retain(table: RetainedTopics, model: dict[str, bytes], operation: tuple) -> None:
    """One write of amqtt's (``retain_message``: store or replace, ``del`` on an empty payload, ``clear`` at start and
    shutdown) or of the cluster's (``set_retained_from_cluster``: store, ``pop``)."""
    kind, topic, payload = operation
    if kind == "retain":
        table[topic] = RetainedApplicationMessage(None, topic, payload, 1)
        model[topic] = payload
    elif kind == "pop":
        table.pop(topic, None)
        model.pop(topic, None)
    elif kind == "del" and topic in model:
        del table[topic]
        del model[topic]
    elif kind == "clear":
        table.clear()
        model.clear()


@SETTINGS
@given(retained_operations, st.lists(filters, min_size=1, max_size=8))
def test_retained_topics_give_a_filter_what_amqtts_walk_gives(steps, probes):
    table, model = RetainedTopics({}), {}
    for step in steps:
        retain(table, model, step)
        for topic_filter in probes:
            got = {message.topic: message.data for message in table.matching(topic_filter)}
            assert got == {topic: data for topic, data in model.items() if amqtt_matches(topic, topic_filter)}, (
                step, topic_filter)
    assert dict(table) == {topic: table[topic] for topic in model}


@SETTINGS
@given(retained_operations)
def test_deleting_every_retained_topic_leaves_an_empty_tree(steps):
    table, model = RetainedTopics({}), {}
    for step in steps:
        retain(table, model, step)
    for topic in list(model):
        retain(table, model, ("pop", topic, None))
    assert table == {} and table._topics._root == {}


def test_retained_topics_refuse_a_write_that_would_bypass_their_tree():
    table = RetainedTopics({"a": RetainedApplicationMessage(None, "a", b"1", 0)})
    assert [message.topic for message in table.matching("#")] == ["a"]
    for write in (lambda: table.update(b=None), lambda: table.setdefault("b"), table.popitem):
        with pytest.raises(TypeError, match="topic tree"):
            write()
    assert list(table) == ["a"]
