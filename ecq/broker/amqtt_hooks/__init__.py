"""Every place where ECQ owns amqtt 0.12.1's behaviour, and every use of its internals: this package is the
only code that touches amqtt internals (private attributes, replaced methods); the rest of ECQ uses amqtt's
public plugin API and the functions exported here.

Every correction replaces amqtt methods only through :mod:`.seam` (``replace(Owner, "name", replacement)``, gevent's
``patch_item``, or ``step(Owner, "name", ...)``), which keeps amqtt's original, records the corrections of each method
in order and, with :data:`.seam.PRIVATE_READS`, declares every private amqtt name ECQ reads; :func:`install` applies
the table :data:`CORRECTIONS` once per process, after checking that amqtt is the version they were written against
(:data:`.seam.AMQTT_VERSION`). ``seam.describe()`` prints what ECQ replaces, with its corrections in order. Each
correction finds the ECQ plugin in the broker's or handler's own PluginManager (:mod:`.target`), so several brokers in
one process work independently and a broker without the ECQ plugin behaves exactly as stock amqtt. The plugin is seen
only through the :class:`EcqHooksTarget` protocol and a session the cluster hands over through
:class:`.target.HandedOverSession`, so nothing here imports ``ecq.broker``'s modules above it (it may import amqtt,
``ecq.queue``, ``ecq.store.protocol``, ``ecq.config`` and ``ecq.broker.acl``). Each correction's docstring names the
amqtt behaviour it replaces. One module per concern:

- :mod:`.ecq_paths`: ECQ's own paths (PUBLISH and SUBSCRIBE under ``$ECQ/``), batched socket writes
  (:func:`send_soon`), the QoS 1 delivery and acknowledgement flows, connection accessors, listen backlog, a
  subscriptions map whose repr does not format every subscriber;
- :mod:`.acks`: an acknowledged message stays acknowledged; a persistent-session takeover closes only the
  old connection; a stopped connection's reader stops;
- :mod:`.bad_clients`: sockets closed on every path, CONNECT timeout, packet size and protocol checks
  before a body is read, ``$``-topics no longer end a client's loop, a bounded log of accept failures;
- :mod:`.ecq_guards`: nothing reaches ``$ECQ/<clientid>/...`` but ECQ's delivery (Wills, broadcasts,
  retained messages);
- :mod:`.conformance`: MQTT 3.1.1 for ordinary topics (what was read before a disconnect is routed, persistent sessions, without their dead connection's
  handler, retained messages, QoS of a fan-out, resend on reconnect, keepalive, with per-session bounds);
- :mod:`.fleet_scale`: a CONNECT, a SUBSCRIBE, a session's deletion and an idle second cost per client, not per
  fleet (no walk of every subscription, session or retained message);
- :mod:`.flow`: nothing unbounded in flow: a connection's outgoing sends bounded (drop, then close a stuck
  subscriber), a quick shutdown with stuck subscribers, a connection's PUBLISHes read ahead of their routing
  bounded, PINGREQ answered after the PUBLISHes before it were routed, acknowledgement timeouts logged in
  aggregate;
- :mod:`.shared_subscriptions`: ``$share/<ShareName>/<filter>`` (MQTT 5.0 section 4.8.2): each message to one
  member of the group, malformed ones refused, the ACL judging the filter read;
- :mod:`.stored_sends`: a QoS 1/2 message sent to a connected persistent session stays in the session store until
  its client acknowledges it;
- :mod:`.cluster`: ordinary MQTT messages forwarded to and from the other brokers of a cluster, retained messages
  and persistent sessions that follow the client across them;
- :mod:`.session_memory`: a session's state and queues in objects of a few bytes, not kilobytes;
- :mod:`.session_owners`: a persistent session is resumed only by the username that owns it;
- :mod:`.connection_cap`: ``max_connections``, the client ids one node serves across its listeners (CONNACK 0x03,
  MQTT 5 0x97 beyond it);
- :mod:`.start_up`: start-up failures are reported, not hidden;
- :mod:`.authentication`: a CONNECT authenticated before its client id's session is touched, a config without an
  authentication plugin warned of, each refused CONNECT logged with its reason (rate-limited);
- :mod:`.framer`: the packet reader (``fast_path``): buffered framing, ECQ writes and PUBACKs without amqtt's
  packet objects and tasks;
- :mod:`.drain`: the listeners closed, the connections listed and their reading stopped, to drain a node;
- :mod:`.websocket`: WebSocket listeners send what ECQ writes without a drain, end a packet cut by a close, and
  take the largest packet;
- :mod:`.mqtt5_edge`: MQTT 5.0 connections served by amqtt (which speaks 3.1.1) through translation at the
  connection edge: a level 5 CONNECT handed to amqtt as 3.1.1, what amqtt sends encoded as v5;
  :mod:`.mqtt5_framer`: the reader of those connections (v5 packets decoded, taken by ECQ or handed to amqtt as
  3.1.1); :mod:`.mqtt5_packets`: the v5 context of a connection and the v5 packets ECQ sends (refused writes'
  reason codes, deliveries with ``ecq-seqno``/``ecq-ts``); :mod:`.mqtt5_sessions`: the life of a v5 session
  (Session Expiry Interval per session, Will Delay Interval, Server Keep Alive, server DISCONNECT reason codes);
  :mod:`.mqtt5_messages`: a v5 PUBLISH's properties carried through amqtt in its payload object, subscription
  options, the v5 PUBLISH ECQ sends; :mod:`.mqtt5_routing`: deliveries on ordinary topics as a v5 client's
  subscriptions and CONNECT ask (expiry, No Local, Retain As Published and Handling, identifiers, size, window).

Several corrections correct the same amqtt method (``init_from_connect`` eight, ``_handle_disconnect`` seven): each
gives ``seam.step`` its parts (what it does before amqtt's call, with its result after it, in a ``finally``, or as
amqtt's body, the first one's) and the seam installs ONE wrapper per method running them in the order of
:data:`CORRECTIONS`, as a chain of wrappers would (the earlier correction inside, the later one's ``before`` first);
a comment beside an entry says where that order matters. A method a connection stays in for its whole life
(``Broker._client_connected``, ``_handle_client_session``) so holds one ECQ coroutine frame per connected client, not
one per correction (``scripts/benchlib/heapprobe.py`` at 2,000: see docs/benchmarks.md). A new
correction is a function that calls ``seam.replace`` (a method no other correction touches) or ``seam.step``, and an
entry in :data:`CORRECTIONS`; ``tests/test_seam.py`` fails on a method installed as a chain.
"""

from __future__ import annotations

from collections.abc import Callable

from ecq.broker.amqtt_hooks import (acks, authentication, bad_clients, cluster, conformance, connection_cap,
                                    ecq_guards, ecq_paths, fleet_scale, flow, framer, mqtt5_edge, mqtt5_framer,
                                    mqtt5_routing, mqtt5_sessions, seam, session_memory, session_owners,
                                    shared_subscriptions, start_up, stored_sends, target, websocket)
from ecq.broker.amqtt_hooks.bad_clients import ProtocolViolation
from ecq.broker.amqtt_hooks.cluster import (HeldSession, PersistentSession, broadcast_from_cluster, discard_session,
                                           hand_over_session, persistent_session, persistent_sessions,
                                           set_retained_from_cluster)
from ecq.broker.amqtt_hooks.drain import close_listeners, open_connections, received_unread, stop_reading
from ecq.broker.amqtt_hooks.connection_cap import connections
from ecq.broker.amqtt_hooks.conformance import set_session_expiry
from ecq.broker.amqtt_hooks.ecq_paths import (acknowledge_soon, client_id, close_connection, connection_is_open,
                                              delivery_fits, listener_addresses, live_connection, publish_qos1,
                                              qos2_receipts, send_soon, set_listen_backlog, shorten_subscriptions_repr)
from ecq.broker.amqtt_hooks.fleet_scale import filters_held, session_deadlines
from ecq.broker.amqtt_hooks.flow import count_routed_publishes
from ecq.broker.amqtt_hooks.mqtt5_messages import Subscription, cluster_form, from_cluster_form
from ecq.broker.amqtt_hooks.mqtt5_packets import receive_maximum
from ecq.broker.amqtt_hooks.mqtt5_sessions import SERVER_SHUTTING_DOWN, SESSION_TAKEN_OVER
from ecq.broker.amqtt_hooks.mqtt5_sessions import tell as send_disconnect
from ecq.broker.amqtt_hooks.seam import AmqttSeamError
from ecq.broker.amqtt_hooks.target import EcqHooksTarget

__all__ = ["AmqttSeamError", "CORRECTIONS", "EcqHooksTarget", "HeldSession", "PersistentSession", "ProtocolViolation",
           "SERVER_SHUTTING_DOWN", "SESSION_TAKEN_OVER", "Subscription", "acknowledge_soon", "broadcast_from_cluster",
           "client_id", "close_connection", "close_listeners", "cluster_form", "connection_is_open", "connections",
           "count_routed_publishes", "delivery_fits", "discard_session", "filters_held", "from_cluster_form",
           "hand_over_session", "install", "listener_addresses", "live_connection", "open_connections",
           "persistent_session", "persistent_sessions", "publish_qos1", "qos2_receipts", "receive_maximum",
           "received_unread", "send_disconnect", "send_soon", "session_deadlines", "set_listen_backlog",
           "set_retained_from_cluster", "set_session_expiry", "shorten_subscriptions_repr", "stop_reading"]


# Every correction of amqtt, in the order of wrapping: where two correct the same method, the later one's steps run
# outside the earlier one's, in that method's one wrapper (the comments say where that order matters).
CORRECTIONS: tuple[Callable[[], None], ...] = (
    session_memory.light_session_state,
    session_memory.small_session_queues,
    session_memory.one_waiter_per_connection,
    session_memory.lean_drain_waiters,
    fleet_scale.connect_without_walking_every_filter,  # first: the body of _handle_client_session's one wrapper
    fleet_scale.index_subscriptions_by_client,
    fleet_scale.expire_sessions_from_their_deadlines,
    fleet_scale.subscribe_without_walking_every_retained_message,
    fleet_scale.no_write_timer_per_connection,
    ecq_paths.take_ecq_publishes,
    ecq_paths.release_ecq_qos2_writes,
    ecq_paths.grant_ecq_subscriptions,
    ecq_paths.accept_ecq_wildcards,
    flow.count_publishes_read,  # outside take_ecq_publishes: sees every PUBLISH as it is read
    flow.pace_amqtt_readers,
    flow.answer_pings_after_routing,
    flow.limit_ack_timeout_log,
    acks.resolve_pubacks_at_once,
    acks.read_to_the_end_after_a_reset,
    acks.keep_the_new_connection_on_persistent_takeover,
    acks.stop_readers_that_missed_their_cancel,
    bad_clients.close_abandoned_connections,
    bad_clients.time_limit_connect,
    bad_clients.check_fixed_headers,
    bad_clients.close_on_nul_in_connect,
    bad_clients.check_publish_headers,
    bad_clients.check_subscribe_payloads,
    bad_clients.keep_serving_after_reserved_topics,
    bad_clients.limit_accept_error_log,
    ecq_guards.refuse_forbidden_wills,
    ecq_guards.keep_ecq_out_of_broadcasts,
    ecq_guards.keep_ecq_out_of_retained_store,
    cluster.forward_broadcasts_to_the_cluster,  # inside conformant_fan_out's step: gets the PUBLISH's QoS
    authentication.authenticate_before_the_session,  # inside adopt_sessions: a refused CONNECT reaches no session;
    connection_cap.cap_connections,  # right outside it: counts authenticated CONNECTs, refuses before any session
    conformance.keep_persistent_sessions,  # ...outside its _authenticate: judges the session amqtt resumes or creates
    conformance.release_handlers_of_offline_sessions,
    conformance.retained_only_for_new_subscriptions,
    conformance.offline_messages_not_retained,
    conformance.offline_queue_first_on_reconnect,  # outside offline_messages_not_retained's body
    conformance.route_what_was_read_before_the_disconnect,  # outside keep_the_new_connection's: on takeovers too
    conformance.end_clean_sessions_with_their_connection,
    conformance.conformant_fan_out,
    conformance.store_persistent_sessions_before_their_acknowledgements,
    shared_subscriptions.take_shared_subscriptions,  # its fan-out side is conformance._subscribers'
    conformance.resend_unacked_on_reconnect,
    stored_sends.delete_stored_copies_at_acknowledgement,  # outside resend_unacked's handle_puback: every PUBACK
    conformance.enforce_keepalive,
    cluster.replicate_retained_messages,  # outside keep_ecq_out_of_retained_store: $ECQ/ never reaches it
    cluster.adopt_sessions_from_the_cluster,  # outside authenticate_before_the_session's: refused, claims nothing
    session_owners.resume_sessions_only_for_their_owner,  # outside adopt_sessions: judges a handed-over session too
    cluster.store_offline_queues_in_the_cluster,  # outermost: sees the queue before it is taken
    mqtt5_edge.translate_level_5_connects,  # outside adopt_sessions: every CONNECT step sees a 3.1.1 CONNECT
    mqtt5_edge.send_mqtt5_packets,  # what amqtt sends (CONNACK, SUBACK, UNSUBACK, PUBLISH) encoded as v5
    mqtt5_routing.deliver_as_mqtt5_clients_ask,  # expiry, No Local, Retain As Published, ids, size, window
    authentication.warn_when_no_authentication_plugin,  # inside raise_pre_start_failure: a failed start warns not
    authentication.log_refused_connects,
    start_up.raise_pre_start_failure,
    start_up.quiet_start_failure_traceback,
    framer.read_with_the_framer,
    mqtt5_framer.read_mqtt5_with_the_framer,  # outside the framer's: a v5 connection is read by Mqtt5Framer
    websocket.correct_websocket_adapters,  # after close_abandoned_connections: its checks see these adapters
    websocket.take_websocket_messages_of_the_largest_packet,
    mqtt5_sessions.expire_sessions_one_by_one,  # outside end_clean_sessions' and the takeover's _handle_disconnect
    mqtt5_sessions.publish_wills_after_their_delay,  # outside expire_sessions_one_by_one: sees the offline session
    mqtt5_sessions.tell_v5_clients_why_they_are_closed,  # outside enforce_keepalive's handle_read_timeout
    cluster.hand_offline_sessions_to_the_store,  # outermost _handle_disconnect: the Will and expiry settled first
)


def install(plugin_class: type[EcqHooksTarget]) -> None:
    """Apply :data:`CORRECTIONS` once per process (:func:`.seam.apply`); ``plugin_class`` is the class to dispatch to (a
    later call with any class does nothing). Raises :class:`AmqttSeamError` when the installed amqtt is not the one
    they were written for (:data:`.seam.AMQTT_VERSION`) or lacks a name one of them replaces."""
    if not target.register(plugin_class):
        return
    seam.apply(CORRECTIONS)
