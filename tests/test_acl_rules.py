"""ACL rule engine (ecq/broker/acl/): EMQX acl.conf syntax, first-match semantics, MQTT 3.1.1 section 4.7 matching."""

from __future__ import annotations

from pathlib import Path

import pytest

from ecq.broker.acl import AclError, ClientInfo, Decision, load_acl, parse_acl

ALLOW, DENY, NOMATCH = Decision.ALLOW, Decision.DENY, Decision.NOMATCH
ACL_DIR = Path(__file__).resolve().parent.parent / "acl"


def client(clientid: str = "c1", username: str | None = None, ipaddr: str | None = None) -> ClientInfo:
    return ClientInfo(clientid, username, ipaddr)


def decide(rules: str, who: ClientInfo, action: str, topic: str) -> Decision:
    return parse_acl(rules).check(who, action, topic)


# --- WHO ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("who", "matching", "other"), [
    ("all", client(), None),
    ('{user, "bob"}', client(username="bob"), client(username="bobby")),
    ('{username, "bob"}', client(username="bob"), client(username="alice")),
    ('{username, "bob"}', client(username="bob"), client(clientid="bob")),
    ('{username, {re, "^b.b$"}}', client(username="bob"), client(username="bobby")),
    ('{username, {re, "ob"}}', client(username="xobx"), client(username="bo")),
    ('{clientid, "c1"}', client("c1"), client("c10")),
    ('{clientid, {re, "^ecq-.+"}}', client("ecq-7"), client("ecq-")),
    ('{clientid, {re, "^dev-\\\\d+$"}}', client("dev-42"), client("dev-x")),
    ('{ipaddr, "10.0.0.0/8"}', client(ipaddr="10.200.3.4"), client(ipaddr="11.0.0.1")),
    ('{ipaddr, "10.1.2.3/8"}', client(ipaddr="10.9.9.9"), client(ipaddr="192.168.0.1")),
    ('{ipaddr, "127.0.0.1"}', client(ipaddr="127.0.0.1"), client(ipaddr="127.0.0.2")),
    ('{ipaddr, "127.0.0.1"}', client(ipaddr="::ffff:127.0.0.1"), client(ipaddr="::1")),
    ('{ipaddr, "2001:db8::/32"}', client(ipaddr="2001:db8:1::5"), client(ipaddr="2001:db9::1")),
    ('{ipaddr, "::1"}', client(ipaddr="::1"), client(ipaddr="::2")),
    ('{ipaddr, "0.0.0.0/0"}', client(ipaddr="8.8.8.8"), client(ipaddr=None)),
    ('{ipaddr, "0.0.0.0/0"}', client(ipaddr="8.8.8.8"), client(ipaddr="not-an-address")),
    ('{\'and\', [{clientid, "c1"}, {username, "bob"}]}', client("c1", "bob"), client("c1", "eve")),
    ('{and, [{clientid, "c1"}, {username, "bob"}]}', client("c1", "bob"), client("c2", "bob")),
    ('{\'or\', [{clientid, "c1"}, {username, "bob"}]}', client("c2", "bob"), client("c2", "eve")),
    ('{or, [{clientid, "c1"}, {ipaddr, "::1"}]}', client("c9", ipaddr="::1"), client("c9")),
])
def test_who_forms(who, matching, other):
    rules = f'{{deny, {who}, all, ["#"]}}.'
    assert decide(rules, matching, "publish", "t") is DENY
    if other is not None:
        assert decide(rules, other, "publish", "t") is NOMATCH


# --- ACTION ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("action", "publish", "subscribe"), [
    ("publish", DENY, NOMATCH),
    ("subscribe", NOMATCH, DENY),
    ("all", DENY, DENY),
    ("pubsub", DENY, DENY),
])
def test_actions(action, publish, subscribe):
    rules = f'{{deny, all, {action}, ["t"]}}.'
    assert decide(rules, client(), "publish", "t") is publish
    assert decide(rules, client(), "subscribe", "t") is subscribe


def test_check_refuses_an_unknown_action():
    with pytest.raises(ValueError, match="'publish' or 'subscribe'"):
        parse_acl("{allow, all}.").check(client(), "all", "t")


# --- TOPICS: wildcards ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("rule_filter", "topic_name", "matches"), [
    ("a/b", "a/b", True),
    ("a/b", "a/b/c", False),
    ("a/+", "a/b", True),
    ("a/+", "a/b/c", False),
    ("a/+", "a", False),
    ("a/+", "a/", True),
    ("a/+/c", "a/b/c", True),
    ("a/#", "a", True),
    ("a/#", "a/b/c", True),
    ("a/#", "ab", False),
    ("#", "a/b", True),
    ("+/+", "/x", True),
    ("#", "$SYS/uptime", False),
    ("+/uptime", "$SYS/uptime", False),
    ("$SYS/#", "$SYS/uptime", True),
    ("$ECQ/w/#", "$ECQ/w/c1/k", True),
])
def test_publish_matches_topic_names_by_mqtt_rules(rule_filter, topic_name, matches):
    rules = f'{{allow, all, publish, ["{rule_filter}"]}}.'
    assert decide(rules, client(), "publish", topic_name) is (ALLOW if matches else NOMATCH)


@pytest.mark.parametrize(("rule_filter", "subscription", "matches"), [
    ("sensors/#", "sensors/+/temp", True),
    ("sensors/#", "sensors/#", True),
    ("sensors/#", "sensors", True),
    ("sensors/+/temp", "sensors/#", False),
    ("sensors/+/temp", "sensors/+/temp", True),
    ("sensors/+/temp", "sensors/kitchen/temp", True),
    ("sensors/kitchen/temp", "sensors/+/temp", False),
    ("sensors/+", "sensors/#", False),
    ("sensors/+/#", "sensors/#", False),
    ("#", "#", True),
    ("#", "+/x", True),
    ("#", "$SYS/#", False),
    ("+/#", "$SYS/#", False),
    ("$SYS/#", "$SYS/+/x", True),
    ("$SYS/#", "#", False),
])
def test_subscribe_matches_when_the_subscription_is_a_subset_of_the_rule(rule_filter, subscription, matches):
    rules = f'{{allow, all, subscribe, ["{rule_filter}"]}}.'
    assert decide(rules, client(), "subscribe", subscription) is (ALLOW if matches else NOMATCH)


# --- TOPICS: eq and placeholders ------------------------------------------------------------------------

@pytest.mark.parametrize("literal", ['"eq a/+"', '{eq, "a/+"}'])
def test_eq_compares_the_topic_as_a_plain_string(literal):
    rules = f"{{deny, all, all, [{literal}]}}."
    assert decide(rules, client(), "subscribe", "a/+") is DENY
    assert decide(rules, client(), "publish", "a/+") is DENY
    assert decide(rules, client(), "subscribe", "a/b") is NOMATCH
    assert decide(rules, client(), "publish", "a/b") is NOMATCH


def test_eq_hash_denies_only_the_subscription_to_everything():
    rules = '{deny, all, subscribe, [{eq, "#"}]}.'
    assert decide(rules, client(), "subscribe", "#") is DENY
    assert decide(rules, client(), "subscribe", "a/#") is NOMATCH


def test_clientid_placeholder():
    rules = '{allow, all, subscribe, ["eq $ECQ/${clientid}/#"]}.'
    assert decide(rules, client("client1"), "subscribe", "$ECQ/client1/#") is ALLOW
    assert decide(rules, client("client1"), "subscribe", "$ECQ/client2/#") is NOMATCH
    assert decide(rules, client("client1"), "subscribe", "$ECQ/client1/k") is NOMATCH


def test_username_placeholder():
    rules = '{allow, all, publish, ["users/${username}/#"]}.'
    assert decide(rules, client(username="bob"), "publish", "users/bob/x") is ALLOW
    assert decide(rules, client(username="bob"), "publish", "users/eve/x") is NOMATCH


def test_placeholders_combine_with_wildcards_and_each_other():
    rules = '{allow, all, publish, ["t/${clientid}/+/${username}"]}.'
    assert decide(rules, client("c1", "bob"), "publish", "t/c1/any/bob") is ALLOW
    assert decide(rules, client("c1", "bob"), "publish", "t/c1/any/eve") is NOMATCH


def test_a_missing_username_makes_the_topic_unmatched():
    rules = '{deny, all, publish, ["users/${username}/#"]}.'
    assert decide(rules, client(username=None), "publish", "users//x") is NOMATCH
    assert decide(rules, client(username=""), "publish", "users//x") is DENY


@pytest.mark.parametrize("clientid", ["+", "#", "a+b"])
def test_a_wildcard_in_a_placeholder_value_makes_the_topic_unmatched(clientid):
    rules = '{allow, all, all, ["$ECQ/${clientid}/#", "eq $ECQ/${clientid}/#"]}.'
    assert decide(rules, client(clientid), "subscribe", f"$ECQ/{clientid}/#") is NOMATCH
    assert decide(rules, client(clientid), "publish", "$ECQ/other/k") is NOMATCH


@pytest.mark.parametrize("value", ["alice/x", "alice/", "/alice", "alice+", "alice#", "alice\x00"])
@pytest.mark.parametrize("field", ["username", "clientid"])
def test_a_placeholder_value_must_be_one_topic_level(field, value):
    """User ``alice/x`` must not write into alice's queue through a rule meant for each user's own."""
    rules = f'{{allow, all, publish, ["$ECQ/w/${{{field}}}/#", "eq $ECQ/w/${{{field}}}/k"]}}.'
    who = client(clientid=value, username="u") if field == "clientid" else client(username=value)
    assert decide(rules, who, "publish", f"$ECQ/w/{value}/k") is NOMATCH
    assert decide(rules, who, "publish", "$ECQ/w/alice/x/k") is NOMATCH
    assert decide(rules, who, "publish", "$ECQ/w/alice/k") is NOMATCH
    one_level = client(clientid="alice", username="u") if field == "clientid" else client(username="alice")
    assert decide(rules, one_level, "publish", "$ECQ/w/alice/x/k") is ALLOW


# --- rule order, nomatch, catch-all ---------------------------------------------------------------------

def test_the_first_matching_rule_decides():
    rules = """
        {deny, {clientid, "c1"}, publish, ["a/#"]}.
        {allow, all, publish, ["a/b"]}.
        {deny, all, publish, ["#"]}.
    """
    acl = parse_acl(rules, "order.conf")
    assert acl.check(client("c1"), "publish", "a/b") is DENY
    assert acl.check(client("c2"), "publish", "a/b") is ALLOW
    assert acl.check(client("c2"), "publish", "x") is DENY
    assert acl.first_match(client("c2"), "publish", "x").location == "order.conf:4"


def test_no_matching_rule_gives_nomatch():
    acl = parse_acl('{deny, all, publish, ["a"]}.')
    assert acl.check(client(), "publish", "b") is NOMATCH
    assert acl.first_match(client(), "publish", "b") is None
    assert parse_acl("").check(client(), "subscribe", "#") is NOMATCH
    assert parse_acl("% only a comment\n").rules == ()


@pytest.mark.parametrize(("permission", "decision"), [("allow", ALLOW), ("deny", DENY)])
def test_the_two_element_rule_matches_everything(permission, decision):
    acl = parse_acl(f"{{{permission}, all}}.")
    for action, topic in [("publish", "a/b"), ("subscribe", "#"), ("publish", "$ECQ/w/c/k"),
                          ("subscribe", "$SYS/#")]:
        assert acl.check(client(), action, topic) is decision


def test_rules_record_where_they_start_and_their_text():
    acl = parse_acl('% header\n{allow,\n  {clientid, "c1"},\n  all,\n  ["a/#", {eq, "b"}]\n}.\n{deny, all}.\n',
                    "rules.conf")
    first, second = acl.rules
    assert (first.line, first.location) == (2, "rules.conf:2")
    assert first.text == '{allow, {clientid, "c1"}, all, ["a/#", {eq, "b"}]}.'
    assert (second.line, second.text, second.permission) == (7, "{deny, all}.", DENY)
    assert acl.source == "rules.conf"


def test_comments_and_strings_are_told_apart():
    acl = parse_acl('{allow, all, publish, ["50%/off"]}. % comment with "quote\n{deny, all}.')
    assert acl.check(client(), "publish", "50%/off") is ALLOW
    assert acl.check(client(), "publish", "50") is DENY


def test_string_escapes():
    acl = parse_acl(r'{allow, {clientid, {re, "^a\\.b\x21\"$"}}, publish, ["t"]}.')
    assert acl.check(client('a.b!"'), "publish", "t") is ALLOW
    assert acl.check(client('axb!"'), "publish", "t") is NOMATCH


# --- parse errors ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "message"), [
    ('{allow, {nobody, "x"}, all, ["t"]}.',
     "acl.conf:1: unknown WHO {nobody, \"x\"}: expected all, {user|username, ...}, {clientid, ...}, "
     "{ipaddr, \"CIDR\"}, {'and', [...]} or {'or', [...]}"),
    ('{allow, all,\n publish_all, ["t"]}.',
     "acl.conf:2: unknown ACTION publish_all: expected publish, subscribe, all or pubsub"),
    ('{allow, all, {publish, [{qos, 1}]}, ["t"]}.',
     "acl.conf:1: unknown ACTION {publish, [{qos, 1}]}: expected publish, subscribe, all or pubsub"),
    ('{permit, all}.', "acl.conf:1: unknown permission permit: expected allow or deny"),
    ('\n\n{allow, {clientid, {re, "^(ecq"}}, subscribe, ["t"]}.',
     'acl.conf:3: bad regex "^(ecq": missing ), unterminated subpattern at position 1'),
    ('{allow, {ipaddr, "10.0.0.300"}, all, ["t"]}.',
     "acl.conf:1: bad CIDR \"10.0.0.300\": '10.0.0.300' does not appear to be an IPv4 or IPv6 network"),
    ('{allow, {ipaddr, "10.0.0.0/33"}, all, ["t"]}.',
     "acl.conf:1: bad CIDR \"10.0.0.0/33\": '10.0.0.0/33' does not appear to be an IPv4 or IPv6 network"),
    ('{allow, all}.\n{deny, all, publish, ["t]}.\n{allow, all, publish, ["x"]}.\n',
     'acl.conf:2: unterminated string (no closing " on this line)'),
    ("{'and, all}.", "acl.conf:1: unterminated quoted atom (no closing ' on this line)"),
    ("{allow, all}\n{deny, all}.", "acl.conf:2: expected '.' after the rule that starts on line 1, found '{'"),
    ("{allow, all}", "acl.conf:1: expected '.' after the rule that starts on line 1, found end of file"),
    ('{allow, all}.\n}', "acl.conf:2: expected a rule '{...}.', found '}'"),
    ("allow.", "acl.conf:1: expected a rule '{...}.', found 'allow'"),
    ('{allow, all, publish ["t"]}.', "acl.conf:1: expected ',' or '}', found '['"),
    ('{allow, all, publish, ["t",]}.', "acl.conf:1: expected a term, found ']'"),
    ("{allow, all, publish}.",
     "acl.conf:1: a rule is {allow|deny, WHO, ACTION, TOPICS} or {allow|deny, all}, found 3 elements: "
     "{allow, all, publish}"),
    ('{allow, {clientid, "c"}}.',
     'acl.conf:1: a two-element rule must be {allow|deny, all}, found {allow, {clientid, "c"}}'),
    ('{allow, all, publish, "t"}.', 'acl.conf:1: TOPICS must be a non-empty list [...], found "t"'),
    ("{allow, all, publish, []}.", "acl.conf:1: TOPICS must be a non-empty list [...], found []"),
    ('{allow, all, publish, [{eq, t}]}.',
     'acl.conf:1: expected a topic filter "...", "eq ..." or {eq, "..."}, found {eq, t}'),
    ('{allow, all, publish, ["a/#/b"]}.', "acl.conf:1: invalid topic filter \"a/#/b\": '#' must be the last level"),
    ('{allow, all, publish, ["a/b+"]}.', 'acl.conf:1: invalid topic filter "a/b+": a wildcard must be a whole level'),
    ('{allow, all, publish, [""]}.', "acl.conf:1: empty topic filter"),
    ('{allow, all, publish, ["t/${peerhost}"]}.',
     'acl.conf:1: unknown placeholder ${peerhost} in "t/${peerhost}": use ${clientid} or ${username}'),
    ("{'and', all}.", "acl.conf:1: unknown permission and: expected allow or deny"),
    ('{allow, {\'and\', []}, all, ["t"]}.', "acl.conf:1: 'and' must be a non-empty list [...], found []"),
    ('{allow, {username, {regex, "x"}}, all, ["t"]}.',
     'acl.conf:1: expected "value" or {re, "regex"}, found {regex, "x"}'),
    ('{allow, all, publish, ["t"]}. # nope', "acl.conf:1: unexpected character '#'"),
    ('{allow, {clientid, {re, "^\\d+$"}}, all, ["t"]}.',
     "acl.conf:1: unsupported escape '\\d' (strings take \\\\ \\\" \\' \\n \\r \\t \\xHH); "
     "for the regex '\\d' write '\\\\d'"),
])
def test_parse_errors_name_the_file_and_line(text, message):
    with pytest.raises(AclError) as caught:
        parse_acl(text, "acl.conf")
    assert str(caught.value) == message


def test_parse_error_parts():
    with pytest.raises(AclError) as caught:
        parse_acl("{allow, all}.\n\n{deny, nobody, all, [\"t\"]}.", "f.conf")
    error = caught.value
    assert (error.source, error.line) == ("f.conf", 3)
    assert error.reason.startswith("unknown WHO nobody")


def test_a_missing_file_is_an_acl_error(tmp_path):
    missing = tmp_path / "none.conf"
    with pytest.raises(AclError) as caught:
        load_acl(missing)
    assert str(caught.value) == f"{missing}: cannot read ACL file: No such file or directory"
    assert caught.value.line is None


def test_load_acl_names_the_file_in_rules_and_errors(tmp_path):
    path = tmp_path / "mine.conf"
    path.write_text('{deny, all, publish, ["t"]}.\n{allow, all, bogus, ["t"]}.\n')
    with pytest.raises(AclError, match=r"mine\.conf:2: unknown ACTION bogus"):
        load_acl(path)
    path.write_text('{deny, all, publish, ["t"]}.\n')
    assert load_acl(str(path)).rules[0].location == f"{path}:1"


# --- the shipped files ----------------------------------------------------------------------------------

def test_default_acl_file():
    acl = load_acl(ACL_DIR / "acl.conf")
    remote, local = client("client1", ipaddr="192.0.2.7"), client("client1", ipaddr="127.0.0.1")
    assert acl.check(remote, "subscribe", "$ECQ/client1/#") is ALLOW
    assert acl.check(remote, "subscribe", "$SYS/#") is DENY
    assert acl.check(remote, "subscribe", "$SYS/broker/uptime") is DENY
    assert acl.check(remote, "subscribe", "#") is DENY
    assert acl.check(remote, "subscribe", "sensors/#") is ALLOW
    assert acl.check(remote, "publish", "$ECQ/w/client2/k") is ALLOW
    assert acl.check(local, "subscribe", "$SYS/#") is ALLOW
    assert acl.check(local, "subscribe", "#") is ALLOW
    assert acl.check(client("tool", ipaddr="::1"), "subscribe", "#") is ALLOW
    assert acl.first_match(remote, "subscribe", "#").text == '{deny, all, subscribe, ["$SYS/#", {eq, "#"}]}.'
    assert acl.rules[-1].text == "{allow, all}."


def test_writers_example_acl_file():
    acl = load_acl(ACL_DIR / "acl-writers.example.conf")
    for writer in (client("backend-1"), client("svc", username="backend")):
        assert acl.check(writer, "publish", "$ECQ/w/client1/k") is ALLOW
    for other in (client("client1"), client("my-backend-1"), client("svc", username="backend2")):
        assert acl.check(other, "publish", "$ECQ/w/client1/k") is DENY
        assert acl.check(other, "publish", "sensors/t") is ALLOW
    assert acl.check(client("client1"), "subscribe", "$ECQ/client1/#") is ALLOW
    assert acl.rules[-1].text == "{allow, all}."
