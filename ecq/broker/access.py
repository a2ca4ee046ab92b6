"""Who may do what: the ACL file (also the broker's topic filter for every other topic), the one-reader
rule of ``$ECQ/<clientid>/#`` subscriptions, the form of ``$SCQ/<queue>/#`` ones (which readers the ACL says),
and the refusal of Will topics at CONNECT."""

from __future__ import annotations

import logging

from amqtt.session import Session

from ecq.broker.acl import Acl, ClientInfo, Decision, load_acl
from ecq.config import EcqSettings
from ecq.queue.groups import SHARE_PREFIX
from ecq.queue.throttle import LogThrottle
from ecq.queue.topics import RESERVED_CLIENTIDS, is_ecq_topic, is_scq_topic, parse_scq_filter, queue_filter

log = logging.getLogger(__name__)

WILL_REFUSAL_LOG_INTERVAL_S, WILL_REFUSAL_LOG_BURST = 10.0, 10  # as the refusals of authentication


class AccessControl:
    """The ACL of ``settings.acl_file`` (none: everything allowed) with ``acl_nomatch`` for unmatched requests.
    Raises ecq.broker.acl.AclError for a bad ACL file."""

    def __init__(self, settings: EcqSettings) -> None:
        self._settings = settings
        self.acl: Acl | None = load_acl(settings.acl_file) if settings.acl_file else None
        self._will_refusal_log = LogThrottle(WILL_REFUSAL_LOG_INTERVAL_S, WILL_REFUSAL_LOG_BURST)

    def reload(self) -> int:
        """Read the ACL file again; returns its rule count. Raises AclError and keeps the old rules."""
        if not self._settings.acl_file:
            return 0
        self.acl = load_acl(self._settings.acl_file)
        log.info("ECQ ACL reloaded from %s: %d rules", self._settings.acl_file, len(self.acl.rules))
        return len(self.acl.rules)

    def allows(self, session: Session, action: str, topic: str) -> bool:
        """True when the ACL lets ``session`` (clientid, username, address) ``action`` (publish, subscribe) ``topic``."""
        if self.acl is None:
            return True
        client = ClientInfo(session.client_id or "", session.username, session.remote_address)
        rule = self.acl.first_match(client, action, topic)
        if rule is None:
            return self._settings.acl_nomatch == "allow"
        if rule.permission is Decision.DENY:
            log.info("ECQ ACL: %s of %s to %r denied by %s", action, client.clientid, topic, rule.location)
        return rule.permission is Decision.ALLOW

    @staticmethod
    def grant_subscription(clientid: str, topic_filter: str, qos: int) -> int | None:
        """QoS to grant for a SUBSCRIBE to an ``$ECQ/`` or ``$SCQ/`` filter, or None to refuse it (SUBACK 0x80), logged
        with its reason (:meth:`subscription_refusal`); QoS 2 is granted as QoS 1 (MQTT 3.1.1 section 3.9.3)."""
        reason = AccessControl.subscription_refusal(clientid, topic_filter, qos)
        if reason is not None:
            log.warning("ECQ refused SUBSCRIBE of %s to %r: %s", clientid, topic_filter, reason)
            return None
        return 1

    @staticmethod
    def subscription_refusal(clientid: str, topic_filter: str, qos: int) -> str | None:
        """Why a SUBSCRIBE of ``clientid`` to the ``$ECQ/`` filter ``topic_filter`` at ``qos`` is refused, None when
        it is granted: only ``<clientid>`` may subscribe to ``$ECQ/<clientid>/#``, at QoS 1 or 2; clients ``w`` and
        ``ctl`` own no queue (their filter would read the writes or control topics of every queue). The text is
        logged, and told to an MQTT 5 client as the SUBACK's Reason String. An ``$SCQ/`` filter must be exactly
        ``$SCQ/<queue>/#`` (``<queue>`` by the clientid rules), at QoS 1 or 2; who may read it is the ACL's to say
        (``topic_filtering``), as for every filter; no client id starting ``$share/`` reads one (its position would
        be a shared group's, ecq.queue.groups.group_position_id)."""
        if is_scq_topic(topic_filter):
            return _scq_refusal(clientid, topic_filter, qos)
        if clientid in RESERVED_CLIENTIDS:
            return (f"the clientids {' and '.join(sorted(RESERVED_CLIENTIDS))} cannot own an ECQ queue ($ECQ/w/ and "
                    "$ECQ/ctl/ are the write and control topics); connect with another clientid")
        if topic_filter != queue_filter(clientid):
            own = queue_filter(clientid)
            return f"{topic_filter!r} is not this client's queue: a client may only read its own, {own!r}"
        if qos == 0:
            return f"QoS 0 refused on {topic_filter!r}: ECQ queues are read at QoS 1"
        return None

    def will_refusal(self, session: Session) -> str | None:
        """Why a CONNECT carrying a Will must be refused (CONNACK 0x05), or None to accept it.

        Nothing may reach ``$ECQ/<clientid>/...`` except ECQ's delivery, so a Will topic under ``$ECQ/`` is
        always refused; any other Will topic must be allowed for publish by the ACL, checked with the
        CONNECT's clientid, username and address (EMQX checks the Will when it is published; ECQ refuses at
        CONNECT, so the client learns of it). The refusal is logged with the reason, at most
        ``WILL_REFUSAL_LOG_BURST`` lines per ``WILL_REFUSAL_LOG_INTERVAL_S`` (a client reconnecting in a loop floods
        no log), each saying how many were held back.
        """
        topic = session.will_topic or ""
        if is_ecq_topic(topic):
            reason = f"Will topic {topic!r} is under $ECQ/, where only ECQ delivers"
        elif not self.allows(session, "publish", topic):
            reason = f"Will topic {topic!r} is denied for publish by the ACL"
        else:
            return None
        if (held_back := self._will_refusal_log.due()) is not None:
            more = f" ({held_back} more refused since the last such line)" if held_back else ""
            log.warning("ECQ refused CONNECT of %r from %s: %s%s", session.client_id, session.remote_address, reason,
                        more)
        return reason


def _scq_refusal(clientid: str, topic_filter: str, qos: int) -> str | None:
    """Why a SUBSCRIBE of ``clientid`` to the ``$SCQ/`` filter ``topic_filter`` at ``qos`` is refused, None when its
    form is right."""
    if clientid.startswith(SHARE_PREFIX):
        return (f"the clientid {clientid!r} cannot read an SCQ: a position saved under a clientid starting "
                f"{SHARE_PREFIX} is a shared group's; connect with another clientid")
    if parse_scq_filter(topic_filter) is None:
        return (f"{topic_filter!r} does not read an SCQ: the filter is $SCQ/<queue>/#, <queue> one level without "
                "'+', '#' or NUL, not 'w' nor 'ctl'")
    if qos == 0:
        return f"QoS 0 refused on {topic_filter!r}: SCQ queues are read at QoS 1"
    return None
