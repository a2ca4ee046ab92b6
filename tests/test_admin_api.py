"""Admin API hardening over a live broker: no answer shows the token; state-changing
calls must name this API in Host (DNS rebinding) and, when sent, in Origin (cross-site requests)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.test_operations import ecq

TOKEN = "s3cret-token-4242"


def call(port: int, path: str, method: str = "GET", **headers: str) -> tuple[int, str]:
    """One request to the admin API on 127.0.0.1:``port``; returns (status, body)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.parametrize("which", ["origin", "inuse"])
def test_the_token_is_redacted_in_the_config(make_broker, which):
    broker = make_broker(admin_token=TOKEN)
    status, body = call(broker.admin_port, f"/api/v1/config?which={which}", Authorization=f"Bearer {TOKEN}")
    assert status == 200 and TOKEN not in body
    assert json.loads(body)["admin_token"] == "**********"
    shown = ecq("show-config", which, "--token", TOKEN, admin=broker.admin_port)
    assert shown.returncode == 0 and "**********" in shown.stdout and TOKEN not in shown.stdout
    assert TOKEN not in broker.log()


@pytest.mark.parametrize("path", ["/api/v1/gc", "/api/v1/acl/reload"])
@pytest.mark.parametrize("headers, why", [
    ({"Host": "evil.example:18083"}, "DNS rebinding"),
    ({"Origin": "http://evil.example"}, "cross-site"),
    ({"Origin": "null"}, "cross-site"),
])
def test_a_state_changing_call_from_another_site_gets_403(broker, path, headers, why):
    status, body = call(broker.admin_port, path, "POST", **headers)
    assert status == 403 and why in json.loads(body)["error"]
    assert "ECQ admin API refused POST" in broker.log()


def test_the_host_is_checked_even_with_the_right_token(make_broker):
    broker = make_broker(admin_token=TOKEN)
    status, _ = call(broker.admin_port, "/api/v1/gc", "POST", Host="evil.example", Authorization=f"Bearer {TOKEN}")
    assert status == 403


def test_same_site_calls_and_the_cli_still_work(broker):
    port = broker.admin_port
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", f"LOCALHOST:{port}"):
        assert call(port, "/api/v1/gc", "POST", Host=host) == (200, '{"deleted": 0}')
    assert call(port, "/api/v1/gc", "POST", Origin=f"http://127.0.0.1:{port}")[0] == 200
    assert call(port, "/api/v1/status", Host="evil.example")[0] == 200  # reads change nothing
    result = ecq("gc", "--json", admin=port)
    assert result.returncode == 0 and json.loads(result.stdout) == {"deleted": 0}
    via_name = ecq("gc", "--admin", f"localhost:{port}")
    assert via_name.returncode == 0, via_name.stderr
