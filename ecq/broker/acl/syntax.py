r"""The EMQX ``acl.conf`` syntax: reading a file into the rules of :mod:`ecq.broker.acl.rules`.

A file is a sequence of rules, each an Erlang term ended by a full stop; ``%`` starts a comment::

    {allow | deny, WHO, ACTION, TOPICS}.
    {allow | deny, all}.                       % catch-all: matches every client, action and topic

    WHO     all | {user | username, "name"} | {username, {re, "regex"}}
            | {clientid, "id"} | {clientid, {re, "regex"}} | {ipaddr, "CIDR"}
            | {'and', [WHO, ...]} | {'or', [WHO, ...]}          ('and'/'or' may be written unquoted)
    ACTION  publish | subscribe | all | pubsub                   (pubsub is EMQX's older name for all)
    TOPICS  ["topic filter" | "eq topic" | {eq, "topic"}, ...]

Strings are Erlang strings kept on one line; they take the escapes ``\\ \" \' \n \r \t \xHH``, so a
regex digit class is written ``"\\d"`` as in EMQX (the other Erlang escapes are refused). A topic may
hold the placeholders ``${clientid}`` and ``${username}``.

Refused at load time although EMQX accepts them: empty ``and``/``or``/TOPICS lists, topic filters with a
misplaced wildcard, placeholders other than the two above. Not supported: EMQX's ``{client, ...}`` and
``{ipaddrs, [...]}`` forms and its QoS/retain action options (``{publish, [{qos, 1}]}``).

Parsing runs in three steps: text to tokens, tokens to Erlang terms, terms to rules; the first problem
stops it with an :class:`AclError` naming ``file:line``.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from typing import Literal

from ecq.broker.acl.rules import (ACTIONS, Acl, Action, AddressCondition, AllOf, AnyOf, ClientCondition, Decision,
                                  Everyone, EveryTopic, IdentityCondition, Rule, RuleTopic)

class AclError(ValueError):
    """An ACL file that cannot be read or parsed.

    ``str(error)`` is ``"<source>:<line>: <reason>"`` with the 1-based line of the offending token, or
    ``"<source>: <reason>"`` when the file cannot be read. The parts are kept in ``source``, ``line``
    (None when the file cannot be read) and ``reason``.
    """

    def __init__(self, source: str, line: int | None, reason: str) -> None:
        super().__init__(f"{source}:{line}: {reason}" if line is not None else f"{source}: {reason}")
        self.source = source
        self.line = line
        self.reason = reason


def load_acl(path: str | os.PathLike[str]) -> Acl:
    """Read and parse the UTF-8 ACL file at ``path``; messages name the file as given.

    Raises AclError when the file cannot be read (``"<path>: cannot read ACL file: ..."``) or parsed.
    """
    source = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise AclError(source, None, f"cannot read ACL file: {reason}") from None
    return parse_acl(text, source)


def parse_acl(text: str, source: str = "<string>") -> Acl:
    """Parse ACL rules from ``text``; ``source`` names it in messages and in each rule's location.

    Raises AclError ``"<source>:<line>: <reason>"`` on the first problem: unexpected character,
    unterminated string, unsupported escape, missing ``.``, stray token, unknown permission, WHO or
    ACTION, bad regex (with the re.error), bad CIDR, unknown placeholder, invalid topic filter.
    """
    try:
        terms = _Parser(_tokenize(text)).rule_terms()
        return Acl(tuple(_rule(term, source) for term in terms), source)
    except _Problem as problem:
        raise AclError(source, problem.line, problem.reason) from None


# --- parsing, step 1: text to tokens (Erlang terms as far as acl.conf uses them) ------------------------


class _Problem(Exception):
    """A problem at a line of the text; parse_acl reports it as AclError with the source name."""

    def __init__(self, line: int, reason: str) -> None:
        super().__init__(reason)
        self.line = line
        self.reason = reason


@dataclass(frozen=True, slots=True)
class _Token:
    kind: Literal["punct", "atom", "string", "integer", "end"]
    value: str
    line: int


_TOKEN = re.compile(r"""
      (?P<space>\s+)
    | (?P<comment>%[^\n]*)
    | (?P<punct>[{}\[\],.])
    | (?P<atom>[a-z][A-Za-z0-9_@]*)
    | (?P<integer>[0-9]+)
    | (?P<string>"(?:[^"\\\n]|\\.)*")
    | (?P<quoted_atom>'(?:[^'\\\n]|\\.)*')
""", re.VERBOSE)

# The Erlang string escapes that acl.conf files need. Erlang's others are refused (\d is DEL, \b a
# backspace, \s a space): in a regex they are almost always meant for re, which needs them written \\d.
_ESCAPE = re.compile(r"\\(?:x(?P<hex>[0-9A-Fa-f]{2})|(?P<char>.))")
_QUOTES = {'"': "string", "'": "quoted atom"}
_SIMPLE_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "'": "'"}


def _tokenize(text: str) -> list[_Token]:
    tokens = []
    position, line = 0, 1
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None:
            character = text[position]
            if character in _QUOTES:
                raise _Problem(line, f"unterminated {_QUOTES[character]} (no closing {character} on this line)")
            raise _Problem(line, f"unexpected character {character!r}")
        kind, lexeme = match.lastgroup, match.group()
        if kind == "string":
            tokens.append(_Token("string", _unescape(lexeme[1:-1], line), line))
        elif kind == "quoted_atom":
            tokens.append(_Token("atom", _unescape(lexeme[1:-1], line), line))
        elif kind in ("punct", "atom", "integer"):
            tokens.append(_Token(kind, lexeme, line))
        line += lexeme.count("\n")
        position = match.end()
    tokens.append(_Token("end", "", line))
    return tokens


def _unescape(body: str, line: int) -> str:
    def replace(match: re.Match[str]) -> str:
        if match["hex"]:
            return chr(int(match["hex"], 16))
        escape = match["char"]
        if escape in _SIMPLE_ESCAPES:
            return _SIMPLE_ESCAPES[escape]
        raise _Problem(line, f"unsupported escape '\\{escape}' (strings take \\\\ \\\" \\' \\n \\r \\t \\xHH); "
                             f"for the regex '\\{escape}' write '\\\\{escape}'")

    return _ESCAPE.sub(replace, body)


# --- parsing, step 2: tokens to terms -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Term:
    kind: Literal["atom", "string", "integer", "tuple", "list"]
    value: str | tuple[_Term, ...]
    line: int

    def is_atom(self, *names: str) -> bool:
        return self.kind == "atom" and self.value in names

    def __str__(self) -> str:
        if self.kind == "tuple":
            return "{" + ", ".join(map(str, self.value)) + "}"
        if self.kind == "list":
            return "[" + ", ".join(map(str, self.value)) + "]"
        if self.kind == "string":
            return '"' + self.value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        return str(self.value)


def _describe(token: _Token) -> str:
    if token.kind == "end":
        return "end of file"
    if token.kind == "string":
        return str(_Term("string", token.value, token.line))
    return f"'{token.value}'"


class _Parser:
    """Recursive descent over: file = (term '.')*; term = atom | string | integer | tuple | list."""

    def __init__(self, tokens: list[_Token]) -> None:
        self._tokens = tokens
        self._next = 0

    def rule_terms(self) -> list[_Term]:
        terms = []
        while self._peek().kind != "end":
            if not self._peek_is("{"):
                raise _Problem(self._peek().line, f"expected a rule '{{...}}.', found {_describe(self._peek())}")
            term = self._term()
            end = self._take()
            if not (end.kind == "punct" and end.value == "."):
                raise _Problem(end.line, f"expected '.' after the rule that starts on line {term.line}, "
                                         f"found {_describe(end)}")
            terms.append(term)
        return terms

    def _term(self) -> _Term:
        token = self._take()
        if token.kind in ("atom", "string", "integer"):
            return _Term(token.kind, token.value, token.line)
        if token.kind == "punct" and token.value == "{":
            return _Term("tuple", self._items("}"), token.line)
        if token.kind == "punct" and token.value == "[":
            return _Term("list", self._items("]"), token.line)
        raise _Problem(token.line, f"expected a term, found {_describe(token)}")

    def _items(self, closing: str) -> tuple[_Term, ...]:
        if self._peek_is(closing):
            self._take()
            return ()
        items = [self._term()]
        while not self._peek_is(closing):
            separator = self._take()
            if not (separator.kind == "punct" and separator.value == ","):
                raise _Problem(separator.line, f"expected ',' or '{closing}', found {_describe(separator)}")
            items.append(self._term())
        self._take()
        return tuple(items)

    def _peek(self) -> _Token:
        return self._tokens[self._next]

    def _peek_is(self, punctuation: str) -> bool:
        return self._peek().kind == "punct" and self._peek().value == punctuation

    def _take(self) -> _Token:
        token = self._tokens[self._next]
        if token.kind != "end":
            self._next += 1
        return token


# --- parsing, step 3: terms to rules --------------------------------------------------------------------

_PLACEHOLDER = re.compile(r"\$\{([^}]*)\}")
_PLACEHOLDER_FIELDS = ("clientid", "username")
_WHO_FORMS = "all, {user|username, ...}, {clientid, ...}, {ipaddr, \"CIDR\"}, {'and', [...]} or {'or', [...]}"
_ACTIONS_BY_NAME: dict[str, frozenset[Action]] = {
    "publish": frozenset({"publish"}),
    "subscribe": frozenset({"subscribe"}),
    "all": frozenset(ACTIONS),
    "pubsub": frozenset(ACTIONS),
}


def _rule(term: _Term, source: str) -> Rule:
    items = term.value
    if len(items) not in (2, 4):
        raise _Problem(term.line, f"a rule is {{allow|deny, WHO, ACTION, TOPICS}} or {{allow|deny, all}}, "
                                  f"found {len(items)} elements: {term}")
    permission = _permission(items[0])
    text = f"{term}."
    if len(items) == 2:
        if not items[1].is_atom("all"):
            raise _Problem(items[1].line, f"a two-element rule must be {{allow|deny, all}}, found {term}")
        return Rule(permission, Everyone(), frozenset(ACTIONS), (EveryTopic(),), source, term.line, text)
    who, action, topics = items[1:]
    return Rule(permission, _who(who), _action(action), _topics(topics), source, term.line, text)


def _permission(term: _Term) -> Literal[Decision.ALLOW, Decision.DENY]:
    if term.is_atom("allow"):
        return Decision.ALLOW
    if term.is_atom("deny"):
        return Decision.DENY
    raise _Problem(term.line, f"unknown permission {term}: expected allow or deny")


def _who(term: _Term) -> ClientCondition:
    if term.is_atom("all"):
        return Everyone()
    if term.kind == "tuple" and len(term.value) == 2 and term.value[0].kind == "atom":
        kind, argument = term.value
        if kind.is_atom("user", "username"):
            return IdentityCondition("username", _identity(argument))
        if kind.is_atom("clientid"):
            return IdentityCondition("clientid", _identity(argument))
        if kind.is_atom("ipaddr"):
            return AddressCondition(_network(argument))
        if kind.is_atom("and", "or"):
            conditions = tuple(_who(item) for item in _nonempty_list(argument, f"'{kind.value}'"))
            return AllOf(conditions) if kind.value == "and" else AnyOf(conditions)
    raise _Problem(term.line, f"unknown WHO {term}: expected {_WHO_FORMS}")


def _identity(term: _Term) -> str | re.Pattern[str]:
    if term.kind == "string":
        return term.value
    if term.kind == "tuple" and len(term.value) == 2 and term.value[0].is_atom("re") \
            and term.value[1].kind == "string":
        pattern = term.value[1]
        try:
            return re.compile(pattern.value)
        except re.error as exc:
            raise _Problem(pattern.line, f"bad regex {pattern}: {exc}") from None
    raise _Problem(term.line, f"expected \"value\" or {{re, \"regex\"}}, found {term}")


def _network(term: _Term) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    if term.kind != "string":
        raise _Problem(term.line, f"expected a CIDR string such as \"10.0.0.0/8\", found {term}")
    try:
        return ipaddress.ip_network(term.value, strict=False)
    except ValueError as exc:
        raise _Problem(term.line, f"bad CIDR {term}: {exc}") from None


def _action(term: _Term) -> frozenset[Action]:
    if term.kind == "atom" and term.value in _ACTIONS_BY_NAME:
        return _ACTIONS_BY_NAME[term.value]
    raise _Problem(term.line, f"unknown ACTION {term}: expected publish, subscribe, all or pubsub")


def _topics(term: _Term) -> tuple[RuleTopic, ...]:
    return tuple(_topic(item) for item in _nonempty_list(term, "TOPICS"))


def _topic(term: _Term) -> RuleTopic:
    if term.kind == "string" and term.value.startswith("eq "):
        return _rule_topic(term, term.value[len("eq "):], literal=True)
    if term.kind == "string":
        return _rule_topic(term, term.value, literal=False)
    if term.kind == "tuple" and len(term.value) == 2 and term.value[0].is_atom("eq") \
            and term.value[1].kind == "string":
        return _rule_topic(term, term.value[1].value, literal=True)
    raise _Problem(term.line, f"expected a topic filter \"...\", \"eq ...\" or {{eq, \"...\"}}, found {term}")


def _rule_topic(term: _Term, topic: str, literal: bool) -> RuleTopic:
    pieces = tuple(_PLACEHOLDER.split(topic))
    for name in pieces[1::2]:
        if name not in _PLACEHOLDER_FIELDS:
            raise _Problem(term.line, f"unknown placeholder ${{{name}}} in {term}: use ${{clientid}} or ${{username}}")
    if not topic:
        raise _Problem(term.line, "empty topic filter")
    if not literal:
        _check_wildcards(term, topic)
    return RuleTopic(pieces, literal)


def _check_wildcards(term: _Term, topic_filter: str) -> None:
    levels = topic_filter.split("/")
    for index, level in enumerate(levels):
        if level not in ("+", "#") and ("+" in level or "#" in level):
            raise _Problem(term.line, f"invalid topic filter {term}: a wildcard must be a whole level")
        if level == "#" and index != len(levels) - 1:
            raise _Problem(term.line, f"invalid topic filter {term}: '#' must be the last level")


def _nonempty_list(term: _Term, what: str) -> tuple[_Term, ...]:
    if term.kind != "list" or not term.value:
        raise _Problem(term.line, f"{what} must be a non-empty list [...], found {term}")
    return term.value
