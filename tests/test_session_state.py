"""The JSON a broker hands a persistent session to another broker in (ecq.broker.session_state.SessionState)."""

from __future__ import annotations

import json

import pytest

from ecq.broker.session_state import SessionState


def test_a_handed_over_session_keeps_the_qos2_releases_it_owes():
    state = SessionState(True, [("t/#", 2, None)], [("t/a", 1, b"queued")], "alice", releases=[7, 65535])
    again = SessionState.from_bytes(state.to_bytes())
    assert (again.subscriptions, again.messages, again.username, again.releases) == (
        [("t/#", 2, None)], [("t/a", 1, b"queued")], "alice", [7, 65535])


def test_a_session_from_a_broker_before_releases_owes_none():
    older = json.dumps({"present": True, "username": "bob", "subscriptions": [["t/#", 1]], "messages": []}).encode()
    assert SessionState.from_bytes(older).releases == []


@pytest.mark.parametrize("packet_id", [0, 65536, "7", None])
def test_a_release_without_a_packet_id_is_refused(packet_id):
    bad = json.dumps({"present": True, "username": None, "subscriptions": [], "messages": [],
                      "releases": [packet_id]}).encode()
    with pytest.raises(ValueError, match="packet id"):
        SessionState.from_bytes(bad)
