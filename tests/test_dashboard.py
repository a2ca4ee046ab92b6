"""The live dashboard (issue 26): the page at the admin API's ``/`` in headless Chromium while writes flow, its
JSON (``/api/v1/dashboard``), its token rules, and the counter history behind its rates.

Chromium is Debian's (scripts/setup installs it), driven by the ``playwright`` package of the ``test`` extra
through ``executable_path``: playwright's own browser download is never used (these machines have no internet).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from ecq.ops.history import HISTORY_S, History
from ecq.ops.metrics import EcqMetrics
from ecq.queue.snapshots import Totals
from tests.harness import wait_until, write
from tests.test_operations import scrape
from tests.test_scq import FILTER, Q, read_all, scq_write

pytestmark = pytest.mark.timeout(120)

TOKEN = "dash-s3cret-7"
KEYS = 20                      # the consumer's queue is rewritten over these keys: its stored count stays put
BACKLOG = {"backlog-a": 15, "backlog-b": 5}   # queues nobody reads: pending entries that stay
PAYLOAD = b"x" * 32
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]
READ_PAGE = """() => {
  const fields = {};
  for (const el of document.querySelectorAll("[data-k]")) fields[el.dataset.k] = el.dataset.value;
  const rows = id => [...document.querySelectorAll(`#${id} tr`)].map(
    tr => [...tr.children].map(td => td.dataset.value ?? td.textContent));
  return {fields, at_ms: Number(document.getElementById("updated").dataset.value), top: rows("top"), refused: rows("refused"),
          scq: rows("scq"), panels: document.getElementById("panels").checkVisibility(),
          login: document.getElementById("login").checkVisibility(),
          lines: document.querySelectorAll("[data-series] polyline").length};
}"""


# --- the browser ---------------------------------------------------------------------------------------

@pytest.fixture
def browser(tmp_path):
    """Debian's headless chromium, launched by playwright with a fresh profile; the test fails without it.

    Function-scoped: playwright's sync API keeps an asyncio loop running in this thread while it is open, and
    fixtures torn down after the test (jetstream_options) call asyncio.run; request them before this one."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.fail("chromium is not installed: run scripts/setup test (it installs Debian's chromium)")
    from playwright.sync_api import sync_playwright
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=chromium, headless=True,
            args=CHROMIUM_FLAGS, viewport={"width": 1280, "height": 900}, timeout=60_000)
        yield context
        context.close()


@pytest.fixture
def page(browser):
    """A new tab; ``page.errors`` collects console errors and uncaught exceptions."""
    tab = browser.new_page()
    tab.errors = []
    tab.on("console", lambda m: tab.errors.append(f"console: {m.text} ({m.location.get('url')})") if m.type == "error" else None)
    tab.on("pageerror", lambda exc: tab.errors.append(f"pageerror: {exc}"))
    tab.set_default_timeout(20_000)
    yield tab
    tab.close()


def read_when(page, predicate, timeout: float = 20.0) -> dict:
    """The page's fields once ``predicate(read)`` holds (AssertionError with the last read after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        read = page.evaluate(READ_PAGE)
        if read["panels"] and predicate(read):
            return read
        if time.monotonic() > deadline:
            raise AssertionError(f"the page never showed what was awaited: {read}")
        page.wait_for_timeout(100)


def number(read: dict, key: str) -> float:
    return float(read["fields"][key])


# --- the broker ----------------------------------------------------------------------------------------

def api(broker, path: str, token: str | None = None) -> tuple[int, object]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"http://127.0.0.1:{broker.admin_port}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
            return response.status, json.loads(body) if "json" in response.headers["Content-Type"] else body
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@contextmanager
def traffic(producer):
    """Writes to the queue ``dash`` over its KEYS keys, one at a time (each waits for its PUBACK), until the
    block ends; raises what a write raised."""
    stop, failed = threading.Event(), []

    def run():
        n = 0
        try:
            while not stop.is_set():
                write(producer, "dash", f"k{n % KEYS}", PAYLOAD)
                n += 1
                stop.wait(0.005)
        except Exception as exc:
            failed.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(15)
    assert not failed, failed


def fill(broker, connect):
    """Queues ``dash`` (its consumer online, acking) with KEYS entries and BACKLOG's with nobody reading them,
    and one refused write (not_a_write)."""
    producer = connect(broker.port, "producer")
    consumer = connect(broker.port, "dash")
    consumer.subscribe("$ECQ/dash/#")
    for clientid, count in {"dash": KEYS, **BACKLOG}.items():
        for i in range(count):
            write(producer, clientid, f"k{i}", PAYLOAD)
    producer.publish("$ECQ/dash/no-w", "refused")
    assert wait_until(lambda: scrape(broker)["ecq_acks_total"] >= KEYS, 10)
    return producer


# --- the page while writes flow ---------------------------------------------------------------------------

def test_the_page_follows_the_broker_while_writes_flow(make_broker, connect, page, tmp_path):
    broker = make_broker()
    producer = fill(broker, connect)
    with traffic(producer):
        page.goto(f"http://127.0.0.1:{broker.admin_port}/")
        first = read_when(page, lambda r: r["fields"]["totals.writes"] and r["lines"] > 0)
        second = read_when(page, lambda r: number(r, "totals.writes") > number(first, "totals.writes"))
        _, status = api(broker, "/api/v1/status")
        _, top = api(broker, "/api/v1/top")
        counters = scrape(broker)
        after_ms = time.time() * 1000

    for key in ("totals.writes", "totals.deliveries", "totals.acks", "totals.compactions"):
        assert number(second, key) > number(first, key), key
    assert number(second, "rates.writes") > 0 and number(second, "rates.acks") > 0

    # steady while writes flow (each rewrites a key of dash): the same as /api/v1/status
    assert number(second, "store.queues") == status["queues"] == 1 + len(BACKLOG)
    assert number(second, "store.messages") == status["messages"] == KEYS + sum(BACKLOG.values())
    assert number(second, "store.bytes") == status["bytes"] == status["messages"] * len(PAYLOAD)
    assert number(second, "store.consumers_online") == status["consumers_online"] == 1
    # moving: the page's counters are older than the scrape, its pending count moved at most by what came since
    assert number(second, "totals.writes") <= counters["ecq_writes_accepted_total"]
    since = (counters["ecq_writes_accepted_total"] + counters["ecq_acks_total"]
             - number(second, "totals.writes") - number(second, "totals.acks"))
    assert abs(number(second, "lag.pending") - top["pending"]) <= since
    assert number(second, "lag.pending") >= sum(BACKLOG.values())
    page_age, api_age = number(second, "lag.oldest_pending_age_s"), top["oldest_pending_age_s"]
    assert 0 < page_age <= api_age <= page_age + (after_ms - second["at_ms"]) / 1000 + 0.01
    assert second["top"][0][:2] == ["backlog-a", str(BACKLOG["backlog-a"])]
    assert second["refused"] == [["not_a_write", second["refused"][0][1], "1"]]

    assert page.errors == []
    screenshot = tmp_path / "dashboard.png"
    page.screenshot(path=str(screenshot), full_page=True)
    assert_not_blank(screenshot)
    print(f"dashboard screenshot: {screenshot}")


def test_the_scq_panel_lists_each_scq_with_its_readers_and_slowest_readers(make_broker, connect, page, tmp_path):
    """Two SCQs: ``fleet`` read by a reader that acks everything and one that acks one of three, then both offline
    for a fourth write; ``ota`` read by a group that went away before its third write. The panel lists both by
    pending entries over their readers, with readers, lagging readers, the oldest pending age and the slowest
    readers, the figures ``/api/v1/top?scq=Q`` gives."""
    broker = make_broker()
    producer = connect(broker.port, "producer")
    for key in ("a", "b", "c"):
        scq_write(producer, key, PAYLOAD)
    assert len(read_all(connect, broker.port, "fast", 3)) == 3
    slow = connect(broker.port, "slow", manual_ack=True)
    assert slow.subscribe(FILTER) == 1
    slow.ack(slow.expect(3)[0])
    member = connect(broker.port, "worker-1")
    assert member.subscribe("$share/workers/$SCQ/ota/#") == 1
    for key in ("x", "y"):
        scq_write(producer, key, PAYLOAD, queue_name="ota")
    assert len(member.expect(2)) == 2
    member.close()
    slow.close()
    scq_write(producer, "d", PAYLOAD)
    scq_write(producer, "z", PAYLOAD, queue_name="ota")
    assert wait_until(lambda: api(broker, f"/api/v1/top?scq={Q}")[1]["pending"] == 4
                      and api(broker, "/api/v1/top?scq=ota")[1]["pending"] == 1)

    page.goto(f"http://127.0.0.1:{broker.admin_port}/")
    read = read_when(page, lambda r: [row[:4] for row in r["scq"]] == [[Q, "2", "2", "4"], ["ota", "1", "1", "1"]])
    fleet_top = api(broker, f"/api/v1/top?scq={Q}")[1]
    slowest = ", ".join(f"{r['reader']} {r['pending']}" for r in fleet_top["queues"])
    assert read["scq"][0][5] == "slow 3, fast 1" == slowest
    assert read["scq"][1][5] == "$share/workers 1"
    assert 0 < float(read["scq"][0][4]) <= fleet_top["oldest_pending_age_s"]
    assert page.errors == []
    page.locator("#panel-scq").screenshot(path=str(tmp_path / "dashboard-scq.png"))


def assert_not_blank(png: Path) -> None:
    pixels = np.asarray(Image.open(png).convert("L"))
    assert pixels.shape[0] >= 600 and pixels.shape[1] == 1280
    inked = np.count_nonzero(pixels < 128) / pixels.size
    assert 0.005 < inked < 0.5, f"the screenshot is blank or a solid block: {inked:.1%} dark"


# --- the token ------------------------------------------------------------------------------------------

def test_with_a_token_the_page_asks_for_it_and_the_data_stays_behind_it(make_broker, page, tmp_path):
    broker = make_broker(admin_token=TOKEN, events=False)
    for path in ("/", "/dashboard.js", "/dashboard.css"):  # the shell holds no data
        assert api(broker, path)[0] == 200, path
    for path in ("/api/v1/dashboard", "/api/v1/status", "/metrics", "/dashboard.js/../api/v1/status"):
        assert api(broker, path)[0] == 401, path
    assert api(broker, "/api/v1/dashboard", TOKEN)[0] == 200

    page.goto(f"http://127.0.0.1:{broker.admin_port}/")
    page.wait_for_selector("#login-form", state="visible")
    assert page.evaluate(READ_PAGE)["panels"] is False
    assert page.errors == []  # it asked without trying the API first

    page.fill("#token", "wrong")
    page.click("button[type=submit]")
    page.wait_for_function('() => document.getElementById("login-error").textContent.includes("refused")')
    assert all("401" in error for error in page.errors), page.errors  # the refused request, nothing else
    assert not page.is_visible("#panels")
    page.screenshot(path=str(tmp_path / "dashboard-login.png"))
    page.errors.clear()

    page.fill("#token", TOKEN)
    page.click("button[type=submit]")
    read = read_when(page, lambda r: r["fields"]["store.queues"] == "0")
    assert read["login"] is False and page.errors == []
    assert page.evaluate('() => sessionStorage.getItem("ecq-admin-token")') == TOKEN
    assert TOKEN not in page.url
    assert page.is_visible("#events-off") and not page.is_visible("#events-on")  # events: false
    page.reload()  # the token stays for the tab
    read_when(page, lambda r: r["fields"]["store.queues"] == "0")
    assert page.errors == []


def test_the_shell_may_not_be_framed_nor_run_other_scripts(broker):
    with urllib.request.urlopen(f"http://127.0.0.1:{broker.admin_port}/", timeout=10) as response:
        headers, body = response.headers, response.read().decode()
    assert headers["X-Frame-Options"] == "DENY" and "frame-ancestors 'none'" in headers["Content-Security-Policy"]
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    assert "http://" not in body and "https://" not in body  # nothing from elsewhere (no CDN)
    assert 'data-auth="open"' in body


# --- the JSON ---------------------------------------------------------------------------------------------

def test_the_json_gives_history_gc_progress_and_no_cluster_on_leveldb(broker, connect):
    producer = connect(broker.port, "producer")
    write(producer, "j", "k", "v")
    status, data = api(broker, "/api/v1/dashboard")
    assert status == 200
    assert data["cluster"] is None and data["backend"] == "leveldb" and data["health"] == {"status": "ok"}
    assert data["store"]["queues"] == 1 and data["store"]["disk_bytes"] > 0
    assert data["lag"]["queues"] == [{"clientid": "j", "pending": 1, "pending_bytes": 1,
                                      "oldest_pending_age_s": data["lag"]["queues"][0]["oldest_pending_age_s"],
                                      "kind": "ecq"}]
    assert data["oldest"][0]["clientid"] == "j" and data["events"]["recorded"] >= 1
    assert data["gc"]["passes"] == 0 and data["gc"]["pass_started_ms"] is None

    request = urllib.request.Request(f"http://127.0.0.1:{broker.admin_port}/api/v1/gc", method="POST")
    urllib.request.urlopen(request, timeout=10).read()
    assert wait_until(lambda: api(broker, "/api/v1/dashboard")[1]["gc"]["pass_started_ms"] is not None, 10)
    _, data = api(broker, "/api/v1/dashboard")
    assert data["gc"]["passes"] == 1 and data["gc"]["pass_deleted"] == 0 and data["gc"]["running"] is False
    history = data["history"]
    assert len(history["t_ms"]) >= 2 and history["t_ms"] == sorted(history["t_ms"])
    assert all(len(rates) == len(history["t_ms"]) - 1 for rates in history["rates"].values())
    assert all(len(values) == len(history["t_ms"]) for values in history["gauges"].values())


# --- the history (no broker) ---------------------------------------------------------------------------------

def fake_engine():
    lag = SimpleNamespace(totals=lambda: (7, 1.5))
    return SimpleNamespace(totals=lambda: Totals(3, 10, 100, 2, 1), lag=lag, gc_lock=SimpleNamespace(locked=lambda: False),
                           settings=SimpleNamespace(gc_interval=60.0))


def test_the_history_keeps_ten_minutes_and_gives_rates(monkeypatch):
    clock = [1_000_000]
    monkeypatch.setattr("ecq.ops.history.now_ms", lambda: clock[0])
    metrics = EcqMetrics({})
    history = History(fake_engine(), metrics, lambda: {})
    for _ in range(400):
        metrics.writes_accepted.inc(20)  # 10 per second
        metrics.writes_refused.labels("empty_key").inc()
        history.take()
        clock[0] += 2000
    assert len(history.samples) == HISTORY_S / 2 + 1
    assert history.samples[-1].t_ms - history.samples[0].t_ms == HISTORY_S * 1000
    series = history.series()
    assert set(series["rates"]["writes"]) == {10.0} and set(series["rates"]["refused:empty_key"]) == {0.5}
    assert series["gauges"]["pending"][-1] == 7 and series["gauges"]["messages"][-1] == 10
    counters = history.samples[-1].counters | {"writes": history.samples[-1].counters["writes"] + 10}
    now = history.rates_now(counters, clock[0])
    assert now["window_s"] == 60.0 and now["writes"] == round((29 * 20 + 10) / 60, 3)  # samples 60 s .. 2 s ago


def test_the_history_follows_a_gc_pass(monkeypatch):
    clock = [1_000_000]
    monkeypatch.setattr("ecq.ops.history.now_ms", lambda: clock[0])
    metrics = EcqMetrics({})
    history = History(fake_engine(), metrics, lambda: {})
    history.take()
    metrics.gc_deleted.inc(5)  # before the pass: not its own
    clock[0] += 2000
    history.take()
    metrics.gc_runs.inc()
    metrics.gc_deleted.inc(40)
    clock[0] += 2000
    history.take()
    gc = history.gc(history.samples[-1].counters)
    assert gc == {"running": False, "passes": 1, "deleted": 45, "interval_s": 60.0, "pass_started_ms": 1_002_000,
                  "pass_deleted": 40}


# --- a cluster ------------------------------------------------------------------------------------------------

def test_on_a_cluster_the_page_shows_nats_and_the_stream_leaders(jetstream_options, cluster_nodes, page, tmp_path):
    [node] = [n.start() for n in cluster_nodes(1)]
    assert wait_until(lambda: api(node, "/api/v1/health")[0] == 200, 20), api(node, "/api/v1/health")
    page.goto(f"http://127.0.0.1:{node.admin_port}/")
    page.wait_for_selector("#panel-cluster", state="visible")
    read_when(page, lambda r: r["fields"]["cluster.writable"] == "true")
    _, status = api(node, "/api/v1/status")
    streams = page.evaluate('() => [...document.querySelectorAll("#cluster-streams tr")].map('
                            'tr => [...tr.children].map(td => td.dataset.value))')
    expected = sorted([name, s["leader"], f'{s["replicas_current"]} of {s["replicas"]}', ", ".join(s["lagging"]) or "none"]
                      for name, s in status["cluster"]["streams"].items())
    assert streams == expected and len(streams) == 3  # 2 shards and the acks stream
    servers = page.evaluate('() => [...document.querySelectorAll("#cluster-servers tr")].map('
                            'tr => [...tr.children].map(td => td.dataset.value))')
    assert servers == sorted([server, str(len(names))] for server, names in status["cluster"]["leaders"].items())
    fields = page.evaluate(READ_PAGE)["fields"]
    assert fields["node"] == "node-1" and fields["cluster.connected"] == "true"
    assert page.errors == []
    page.screenshot(path=str(tmp_path / "dashboard-cluster.png"), full_page=True)
    print(f"dashboard screenshot: {tmp_path / 'dashboard-cluster.png'}")
