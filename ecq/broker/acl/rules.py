r"""The rule model of an ACL and its matching: who a rule applies to, on which actions and topics, and the
first-match decision. Semantics (EMQX ``emqx_authz_rule``, except where noted):

- Rules are tried in file order; the first rule whose WHO, ACTION and TOPICS all match decides ALLOW or
  DENY. When none matches the answer is NOMATCH and the caller applies its own default.
- Regexes are Python :mod:`re` patterns applied with :func:`re.search`, i.e. unanchored as EMQX's
  ``re:run``: write ``^...$`` to match the whole clientid or username.
- ``{ipaddr, "CIDR"}`` takes IPv4 or IPv6; a bare address means /32 or /128, host bits are ignored
  (``10.1.2.3/8`` is ``10.0.0.0/8``), and an IPv4-mapped client address (``::ffff:127.0.0.1``) is
  matched as its IPv4 address. A client without a known address matches no ``ipaddr`` condition.
- ``${clientid}`` and ``${username}`` in a topic are replaced by the client's values before matching,
  also inside ``eq`` topics (EMQX leaves ``eq`` topics as written; a rule for each client's own queue,
  ``"eq $ECQ/${clientid}/#"``, relies on it). A placeholder stands for exactly one topic level: the topic does not match when the value is missing
  (no username) or contains ``/``, ``+``, ``#`` or NUL, so a client cannot widen a rule by its choice of
  clientid or username (user ``alice/x`` must not match ``$ECQ/w/${username}/#`` on ``$ECQ/w/alice/x/k``,
  which is alice's queue).
- PUBLISH (MQTT 3.1.1 section 4.7): a rule's topic filter matches the topic name by MQTT rules: ``+``
  is one level, ``#`` the rest including the parent level, and a filter starting with a wildcard does
  not match a topic name starting with ``$``.
- SUBSCRIBE: a rule's topic filter matches a subscription's topic filter when every topic name the
  subscription can receive is also matched by the rule, compared level by level: rule ``sensors/#``
  matches ``sensors/+/temp``, rule ``sensors/+/temp`` does not match ``sensors/#``. (EMQX instead
  matches the subscription filter as if it were a topic name.)
- ``eq`` topics are compared as plain strings with the topic name or subscription filter.

The two-element ``{allow, all}.``/``{deny, all}.`` matches everything, ``$`` topics included (EMQX
compiles it to the filter ``#``, which leaves ``$`` topics unmatched).
"""

from __future__ import annotations

import enum
import ipaddress
import re
from dataclasses import dataclass
from typing import Literal, Protocol

Action = Literal["publish", "subscribe"]
ACTIONS: tuple[Action, ...] = ("publish", "subscribe")


class Decision(enum.Enum):
    """Outcome of :meth:`Acl.check`: the permission of the first matching rule, or NOMATCH."""

    ALLOW = "allow"
    DENY = "deny"
    NOMATCH = "nomatch"


@dataclass(frozen=True, slots=True)
class ClientInfo:
    """What the rules may test about a client: its clientid, username (None when the client sent none)
    and peer IP address as text (IPv4 or IPv6; None or unparsable when unknown)."""

    clientid: str
    username: str | None = None
    ipaddr: str | None = None


# --- conditions on the client (WHO) ---------------------------------------------------------------------


class ClientCondition(Protocol):
    """The WHO part of a rule."""

    def matches(self, client: ClientInfo) -> bool: ...


@dataclass(frozen=True, slots=True)
class Everyone:
    """WHO ``all``."""

    def matches(self, client: ClientInfo) -> bool:
        return True


@dataclass(frozen=True, slots=True)
class IdentityCondition:
    """WHO ``{clientid | username, "value"}`` (string equality) or ``{..., {re, "regex"}}`` (re.search)."""

    field: Literal["clientid", "username"]
    expected: str | re.Pattern[str]

    def matches(self, client: ClientInfo) -> bool:
        actual = getattr(client, self.field)
        if actual is None:
            return False
        if isinstance(self.expected, str):
            return actual == self.expected
        return self.expected.search(actual) is not None


@dataclass(frozen=True, slots=True)
class AddressCondition:
    """WHO ``{ipaddr, "CIDR"}``."""

    network: ipaddress.IPv4Network | ipaddress.IPv6Network

    def matches(self, client: ClientInfo) -> bool:
        address = _client_address(client.ipaddr)
        return address is not None and address in self.network


@dataclass(frozen=True, slots=True)
class AllOf:
    """WHO ``{'and', [WHO, ...]}``."""

    conditions: tuple[ClientCondition, ...]

    def matches(self, client: ClientInfo) -> bool:
        return all(condition.matches(client) for condition in self.conditions)


@dataclass(frozen=True, slots=True)
class AnyOf:
    """WHO ``{'or', [WHO, ...]}``."""

    conditions: tuple[ClientCondition, ...]

    def matches(self, client: ClientInfo) -> bool:
        return any(condition.matches(client) for condition in self.conditions)


def _client_address(text: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    if text is None:
        return None
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


# --- conditions on the topic (TOPICS) -------------------------------------------------------------------


class TopicCondition(Protocol):
    """One entry of the TOPICS list; ``subject`` is a topic name (PUBLISH) or topic filter (SUBSCRIBE)."""

    def matches(self, client: ClientInfo, subject: str) -> bool: ...


@dataclass(frozen=True, slots=True)
class EveryTopic:
    """The implicit topic condition of the two-element ``{allow | deny, all}`` rule."""

    def matches(self, client: ClientInfo, subject: str) -> bool:
        return True


_NOT_IN_A_LEVEL = ("/", "+", "#", "\x00")  # a placeholder value holding one of these matches nothing


@dataclass(frozen=True, slots=True)
class RuleTopic:
    """A topic filter of a rule, or with ``literal`` an ``eq`` topic compared as a plain string.

    ``pieces`` alternates text and placeholder names (``ClientInfo`` fields): ``"a/${clientid}/#"`` is
    ``("a/", "clientid", "/#")``.
    """

    pieces: tuple[str, ...]
    literal: bool

    def matches(self, client: ClientInfo, subject: str) -> bool:
        rendered = self._render(client)
        if rendered is None:
            return False
        if self.literal:
            return subject == rendered
        return filter_covers(rendered, subject)

    def _render(self, client: ClientInfo) -> str | None:
        rendered = []
        for index, piece in enumerate(self.pieces):
            if index % 2 == 0:
                rendered.append(piece)
                continue
            value = getattr(client, piece)
            if value is None or any(character in value for character in _NOT_IN_A_LEVEL):
                return None
            rendered.append(value)
        return "".join(rendered)


def filter_covers(rule_filter: str, subject: str) -> bool:
    """True when every topic name matched by ``subject`` is matched by ``rule_filter`` (MQTT 3.1.1 4.7).

    A topic name is a filter that matches only itself, so this is both the PUBLISH test (subject is a
    topic name) and the SUBSCRIBE test (subject is a topic filter). It compares level by level and is
    conservative: rule ``+/#`` does not cover subscription ``#``, though both match every topic name.
    """
    rule_levels = rule_filter.split("/")
    subject_levels = subject.split("/")
    if subject.startswith("$") and rule_levels[0] in ("+", "#"):
        return False
    for index, rule_level in enumerate(rule_levels):
        if rule_level == "#":
            return True
        if index == len(subject_levels):
            return False
        subject_level = subject_levels[index]
        if subject_level == "#" or rule_level not in ("+", subject_level):
            return False
    return len(subject_levels) == len(rule_levels)


# --- rules and rule sets --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rule:
    """One parsed rule: what it decides, the conditions it tests (``actions`` is the set of actions it
    applies to), and for logs its ``location`` (``source:line`` of its first line) and ``text`` (the rule
    re-printed on one line)."""

    permission: Literal[Decision.ALLOW, Decision.DENY]
    who: ClientCondition
    actions: frozenset[Action]
    topics: tuple[TopicCondition, ...]
    source: str
    line: int
    text: str

    @property
    def location(self) -> str:
        """``"<source>:<line>"`` of the rule."""
        return f"{self.source}:{self.line}"

    def matches(self, client: ClientInfo, action: Action, topic: str) -> bool:
        """True when this rule applies to ``client`` doing ``action`` on ``topic``."""
        return (action in self.actions and self.who.matches(client)
                and any(condition.matches(client, topic) for condition in self.topics))


@dataclass(frozen=True, slots=True)
class Acl:
    """A parsed ACL file: ``rules`` in file order, ``source`` the file name used in messages."""

    rules: tuple[Rule, ...]
    source: str

    def first_match(self, client: ClientInfo, action: Action, topic: str) -> Rule | None:
        """The first rule that matches, or None.

        ``topic`` is the topic name of a PUBLISH or the topic filter of a SUBSCRIBE (without any
        ``$share/<group>/`` prefix). Raises ValueError for an action other than publish/subscribe.
        """
        if action not in ACTIONS:
            raise ValueError(f"action must be 'publish' or 'subscribe', not {action!r}")
        return next((rule for rule in self.rules if rule.matches(client, action, topic)), None)

    def check(self, client: ClientInfo, action: Action, topic: str) -> Decision:
        """ALLOW or DENY from the first matching rule, NOMATCH when none matches (see :meth:`first_match`)."""
        rule = self.first_match(client, action, topic)
        return rule.permission if rule is not None else Decision.NOMATCH

