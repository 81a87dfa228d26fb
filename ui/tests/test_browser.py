"""pg-once-ui in a real browser: Debian's Chromium, headless, driven by Playwright.

Run by scripts/test.sh (step 7, on PostgreSQL 15's preloaded server) as

    PG_ONCE_DSN=... PG_ONCE_PSQL=.../psql PG_ONCE_UI_BIN=.../pg-once-ui \
        PG_ONCE_UI_PORT=26590 python -m pytest ui/tests

against a server with pg_once where ui/tests/seed.sql has not run yet (it creates roles).
PG_ONCE_UI_SCREENSHOTS=docs/dashboard also writes a screenshot of each page there.
"""

import base64
import json
import os
import pathlib
import re
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
from playwright.sync_api import expect, sync_playwright

HERE = pathlib.Path(__file__).parent
DSN = os.environ["PG_ONCE_DSN"]
PSQL = os.environ.get("PG_ONCE_PSQL", "psql")
UI = os.environ["PG_ONCE_UI_BIN"]
PORT = int(os.environ.get("PG_ONCE_UI_PORT", "26590"))
SHOTS = os.environ.get("PG_ONCE_UI_SCREENSHOTS")
CHROMIUM = os.environ.get("PG_ONCE_CHROMIUM", "/usr/bin/chromium")
AUTH = ("ops", "s3cret-pass")
CSRF_SECRET = "ui-tests-" + base64.b64encode(os.urandom(12)).decode()


def psql(sql, dsn=DSN):
    return subprocess.run(
        [PSQL, dsn, "-X", "-q", "-At", "-v", "ON_ERROR_STOP=1", "-c", sql],
        check=True, capture_output=True, text=True,
    ).stdout.strip()


def dsn_as(role):
    return re.sub(r"user=\S+", f"user={role}", DSN)


class Dashboard:
    def __init__(self, port, dsn, *extra):
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [UI, "--dsn", dsn, "--bind", f"127.0.0.1:{port}", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            # One CSRF secret for every dashboard of the tests: a token taken from one
            # is valid for the others, so that --read-only is seen refusing a valid one.
            env={**os.environ, "PG_ONCE_UI_CSRF_SECRET": CSRF_SECRET},
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(self.url + "/static/style.css", timeout=1)
                break
            except urllib.error.HTTPError:
                break  # up, asking for credentials
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"pg-once-ui did not start: {self.proc.stdout.read()}")
                time.sleep(0.1)

    def stop(self):
        self.proc.terminate()
        try:
            out, _ = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return out


@pytest.fixture(scope="session")
def seeded():
    subprocess.run([PSQL, DSN, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-f", str(HERE / "seed.sql")],
                   check=True, capture_output=True, text=True)


@pytest.fixture(scope="session")
def admin(seeded):
    """The dashboard as the superuser of the DSN, behind basic auth."""
    d = Dashboard(PORT, DSN, "--basic-auth", ":".join(AUTH))
    yield d
    log = d.stop()
    # No secret in what it logs: the basic-auth password (and the DSN's, if any).
    assert AUTH[1] not in log, log


@pytest.fixture(scope="session")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser):
    ctx = browser.new_context(http_credentials={"username": AUTH[0], "password": AUTH[1]},
                              viewport={"width": 1280, "height": 800})
    pg = ctx.new_page()
    yield pg
    ctx.close()


def shot(page, name):
    if SHOTS:
        pathlib.Path(SHOTS).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(pathlib.Path(SHOTS) / f"{name}.png"), full_page=True)


def test_pages_show_keys_in_every_state(admin, page):
    page.goto(admin.url + "/")
    for state in ("queued", "running", "done", "failed"):
        count = int(page.locator(f"[data-count={state}] .n").inner_text())
        assert count >= 1, state
    expect(page.locator("#queues tr[data-queue=ui-emails]")).to_contain_text("5")
    expect(page.locator("body")).to_have_attribute("data-live", "connected")
    shot(page, "overview")

    page.goto(admin.url + "/keys?state=running&prefix=ui/")
    row = page.locator('tr[data-key="ui/site/slow/report"]')
    expect(row).to_contain_text("psql")          # owner
    expect(row).to_contain_text(re.compile(r"\d+ min"))   # lease left, claim age
    shot(page, "keys-running")

    page.goto(admin.url + "/keys?state=failed&prefix=ui/")
    row = page.locator('tr[data-key="ui/site/broken"]')
    expect(row).to_contain_text("upstream returned 503")
    expect(row).to_contain_text(re.compile(r"(59|60) min"))   # retry in
    page.goto(admin.url + "/keys?state=queued&queue=ui-emails")
    expect(page.locator("tbody tr")).to_have_count(5)
    page.goto(admin.url + "/keys?prefix=ui/site/page/")
    expect(page.locator("tbody tr[data-state=done]")).to_have_count(12)
    shot(page, "keys")

    page.goto(admin.url + "/keys/ui/job/dead/1")
    expect(page.locator("#row [data-field=error]")).to_have_text("division by zero")
    expect(page.locator("#attempts")).to_contain_text("failed")
    shot(page, "key")

    page.goto(admin.url + "/queues")
    expect(page.locator("tr[data-queue=ui-fragile]")).to_be_visible()
    shot(page, "queues")

    page.goto(admin.url + "/dead-letters")
    expect(page.locator('tr[data-key="ui/job/dead/1"]')).to_contain_text("division by zero")
    shot(page, "dead-letters")

    # The JSON API says the same.
    api = page.request.get(admin.url + "/api/keys?state=running&prefix=ui/site/").json()
    assert [r["key"] for r in api["rows"]] == ["ui/site/slow/report"]
    assert page.request.get(admin.url + "/api/keys/ui%2Fsite%2Fbroken").json()["row"]["state"] == "failed"
    assert any(q["queue"] == "ui-emails" and q["depth"] == 5
               for q in page.request.get(admin.url + "/api/queues").json()["queues"])
    assert page.request.get(admin.url + "/api/overview").json()["stats"]["running"] >= 2
    assert any(r["key"] == "ui/job/dead/1"
               for r in page.request.get(admin.url + "/api/dead-letters").json()["rows"])


def test_basic_auth_is_required(admin):
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(admin.url + "/api/overview")
    assert e.value.code == 401
    req = urllib.request.Request(admin.url + "/api/overview", headers={
        "Authorization": "Basic " + base64.b64encode(f"{AUTH[0]}:wrong".encode()).decode()})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    assert e.value.code == 401


def test_a_completion_appears_live_without_reload(admin, page):
    page.goto(admin.url + "/keys?prefix=ui/live/")
    expect(page.locator("body")).to_have_attribute("data-live", "connected")
    row = page.locator('tr[data-key="ui/live/one"]')
    expect(row).to_have_attribute("data-state", "running")
    page.evaluate("window.notReloaded = true")
    other = page.context.new_page()    # a second viewer of another page, live too
    other.goto(admin.url + "/keys/ui/live/one")
    expect(other.locator("body")).to_have_attribute("data-live", "connected")

    psql("SELECT once.complete_key('ui/live/one', token, '{\"done\": true}') "
         "FROM once.entries WHERE key = 'ui/live/one'")
    started = time.monotonic()
    expect(row).to_have_attribute("data-state", "done", timeout=1000)
    expect(other.locator("#row [data-field=state]")).to_have_text("done", timeout=1000)
    print(f"completion shown after {time.monotonic() - started:.3f} s")
    assert page.evaluate("window.notReloaded") is True

    # A key of a namespace is announced by its digest: its page follows that too.
    other.goto(admin.url + "/keys/ui-tenant-a/live")
    expect(other.locator("body")).to_have_attribute("data-live", "connected")
    expect(other.locator("#row [data-field=state]")).to_have_text("running")
    psql("SELECT once.complete_key('ui-tenant-a/live', token, '{}') "
         "FROM once.entries WHERE key = 'ui-tenant-a/live'")
    expect(other.locator("#row [data-field=state]")).to_have_text("done", timeout=1000)


def test_an_action_needs_the_token_and_a_confirmation(admin, page):
    assert psql("SELECT state FROM once.entries WHERE key = 'ui/site/page/1'") == "done"
    page.goto(admin.url + "/keys?prefix=ui/site/page/")
    # Bulk selection: "select all" ticks every key of the page.
    page.locator("#all").check()
    assert page.locator("input[name=key]:checked").count() == 12
    page.locator("#all").uncheck()
    assert page.locator("input[name=key]:checked").count() == 0
    page.locator('tr[data-key="ui/site/page/1"] input[name=key]').check()
    page.locator('tr[data-key="ui/site/page/2"] input[name=key]').check()
    page.locator("button[value=invalidate]").click()
    # Nothing happened yet: a confirmation first.
    expect(page.locator("h1")).to_have_text("Confirm: invalidate")
    expect(page.locator("ul.keys li")).to_have_count(2)
    shot(page, "confirm")
    assert psql("SELECT count(*) FROM once.entries WHERE key IN ('ui/site/page/1', 'ui/site/page/2')") == "2"
    page.locator("#confirm").click()
    expect(page.locator("#results")).to_contain_text("ui/site/page/1")
    expect(page.locator("#results")).to_contain_text("true")
    assert psql("SELECT count(*) FROM once.entries WHERE key IN ('ui/site/page/1', 'ui/site/page/2')") == "0"

    # Without the token, or with another one: refused, and nothing changes.
    form = {"action": "invalidate", "key": "ui/site/page/3", "confirmed": "yes"}
    assert page.request.post(admin.url + "/action", form=form).status == 403
    assert page.request.post(admin.url + "/action", form={**form, "csrf": "AAAA"}).status == 403
    # Nor through GET.
    assert page.request.get(admin.url + "/action").status == 405
    assert psql("SELECT state FROM once.entries WHERE key = 'ui/site/page/3'") == "done"

    # Retry a dead letter (once.enqueue_key with its payload), from the dead-letters page.
    page.goto(admin.url + "/dead-letters?queue=ui-fragile")
    page.locator('tr[data-key="ui/job/dead/1"] input[name=key]').check()
    page.locator("button[value=retry]").click()
    page.locator("#confirm").click()
    expect(page.locator("#results")).to_contain_text("requeued")
    assert psql("SELECT state || ' ' || payload FROM once.entries WHERE key = 'ui/job/dead/1'") == 'queued {"x": 1}'

    # Release gives back only a claim whose owner is gone: this one's lease runs for an hour.
    page.goto(admin.url + "/keys/ui/site/slow/report")
    page.locator("button[value=release]").click()
    page.locator("#confirm").click()
    expect(page.locator("#results")).to_contain_text("not released")
    assert psql("SELECT state FROM once.entries WHERE key = 'ui/site/slow/report'") == "running"

    # Reap the claims of gone owners (once.reap_stale), from the overview.
    page.goto(admin.url + "/")
    page.locator("button[value=reap]").click()
    expect(page.locator("h1")).to_have_text("Confirm: reap")
    page.locator("#confirm").click()
    expect(page.locator("#results")).to_contain_text(re.compile(r"reclaimed \d+, expired \d+, history \d+"))


def test_read_only_refuses_every_action(admin, page, browser):
    # A valid token, from the dashboard that allows actions (same CSRF secret).
    page.goto(admin.url + "/keys?prefix=ui/site/page/")
    token = page.locator("input[name=csrf]").first.get_attribute("value")
    d = Dashboard(PORT + 1, DSN, "--read-only")
    try:
        ctx = browser.new_context()
        ro = ctx.new_page()
        ro.goto(d.url + "/keys?prefix=ui/site/page/")
        expect(ro.locator("tbody tr").first).to_be_visible()
        assert ro.locator("input[name=key], button[name=action], input[name=csrf]").count() == 0
        for confirmed in ("", "yes"):
            r = ro.request.post(d.url + "/action", form={
                "action": "invalidate", "key": "ui/site/page/3", "confirmed": confirmed, "csrf": token})
            assert r.status == 403
            assert "This dashboard is read-only" in r.text()
        assert psql("SELECT state FROM once.entries WHERE key = 'ui/site/page/3'") == "done"
        # The same token and form on the other dashboard: a confirmation page.
        r = page.request.post(admin.url + "/action", form={
            "action": "invalidate", "key": "ui/site/page/3", "csrf": token})
        assert r.status == 200 and "Confirm: invalidate" in r.text()
        ctx.close()
    finally:
        d.stop()


def test_an_action_acts_on_the_key_shown_whatever_its_line_breaks(admin, page):
    # A browser submits a form's line breaks as CRLF (and its parser reads a CR in the
    # page as LF): a key with a line break in a form's value came back as another key.
    # Invalidating "a<LF>b" from its page invalidated "a<CR><LF>b", which any role could
    # have planted beside it, and answered true.
    psql("SELECT once.complete_key(k, token, '1') FROM (VALUES (E'ui/nl\\nkey'), (E'ui/nl\\r\\nkey'),"
         " (E'ui/cr\\rkey')) v(k), once.claim_key(k)")
    for shown in ("ui/nl\nkey", "ui/cr\rkey"):
        page.goto(admin.url + "/keys/" + urllib.parse.quote(shown, safe=""))
        page.locator("button[value=invalidate]").click()
        page.locator("#confirm").click()
        expect(page.locator("#results")).to_contain_text("true")
    left = psql("SELECT string_agg(replace(replace(key, E'\\r', '<CR>'), E'\\n', '<LF>'), ' ' ORDER BY key)"
                " FROM once.entries WHERE key LIKE 'ui/nl%' OR key LIKE 'ui/cr%'")
    assert left == "ui/nl<CR><LF>key", left


def test_a_request_for_another_host_name_is_refused(seeded):
    # DNS rebinding: a page of another site, whose name its owner makes resolve to the
    # dashboard's address, is the same origin as the dashboard for the browser, which lets
    # it read every page (the CSRF token included) and post actions; without basic auth
    # (the default, on loopback) nothing else stops it. Its requests name its own host.
    def status(d, host):
        req = urllib.request.Request(d.url + "/api/keys", headers={"Host": host})
        try:
            return urllib.request.urlopen(req).status
        except urllib.error.HTTPError as e:
            return e.code

    d = Dashboard(PORT + 1, DSN)
    try:
        assert status(d, f"rebound.example:{PORT + 1}") == 421
        for host in (f"127.0.0.1:{PORT + 1}", f"localhost:{PORT + 1}", f"[::1]:{PORT + 1}"):
            assert status(d, host) == 200, host
    finally:
        d.stop()
    # Behind a reverse proxy that forwards its own name: that name is given.
    d = Dashboard(PORT + 1, DSN, "--allowed-host", "dashboard.example")
    try:
        assert status(d, "Dashboard.Example") == 200
        assert status(d, "rebound.example") == 421
    finally:
        d.stop()


@pytest.mark.skipif(not os.environ.get("PG_ONCE_TLS_DSN"), reason="no TLS server (PG_ONCE_TLS_DSN)")
def test_tls_as_the_rust_client_does_it(seeded):
    # A role that may connect only over TLS, verified against a private CA (lib.sh's
    # cluster_tls): pages and the LISTEN connection both get through.
    tls = os.environ["PG_ONCE_TLS_DSN"]
    d = Dashboard(PORT + 4, tls)
    try:
        overview = json.load(urllib.request.urlopen(d.url + "/api/overview"))
        assert overview["role"] == "once_tls"
        assert overview["listener"]["connected"] is True
    finally:
        d.stop()
    # Without TLS the server refuses the role, and the dashboard says why and exits.
    plain = re.sub(r"sslmode=\S+", "sslmode=disable", tls)
    out = subprocess.run([UI, "--dsn", plain, "--bind", f"127.0.0.1:{PORT + 4}"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "pg_hba.conf" in out.stderr, out.stderr


def test_a_namespaced_key_is_invisible_outside_it(seeded, browser):
    b = Dashboard(PORT + 2, dsn_as("ui_tenant_b"))
    a = Dashboard(PORT + 3, dsn_as("ui_tenant_a"))
    try:
        ctx = browser.new_context()
        page = ctx.new_page()
        page.goto(b.url + "/dead-letters")
        expect(page.locator('tr[data-key="ui/job/dead/2"]')).to_be_visible()   # shared: seen
        expect(page.locator("#keys")).not_to_contain_text("ui-tenant-a/")
        page.goto(b.url + "/keys")
        # once.entries is not readable by application roles: their keys are read from
        # once.keys, which shows the shared keys in every state and none of tenant a's.
        expect(page.locator(".notice")).to_contain_text("Read from once.keys")
        expect(page.locator("#keys")).not_to_contain_text("ui-tenant-a/")
        shot(page, "keys-unprivileged")
        # Looked up by key (a page lists keys in hash order, among whatever else the
        # database holds): a shared running key is there, tenant a's keys are not.
        shared = page.request.get(b.url + "/api/keys/ui%2Fsite%2Fslow%2Freport").json()
        assert shared["source"] == "once.keys" and shared["row"]["state"] == "running", shared
        assert page.request.get(b.url + "/api/keys/ui-tenant-a%2Fresult").json()["row"] is None
        assert page.request.get(b.url + "/api/keys/ui-tenant-a%2Fsecret%2F1").json()["row"] is None
        dead = [r["key"] for r in page.request.get(b.url + "/api/dead-letters").json()["rows"]]
        assert "ui/job/dead/2" in dead and not any(k.startswith("ui-tenant-a/") for k in dead)
        overview = page.request.get(b.url + "/api/overview").json()
        assert overview["role"] == "ui_tenant_b" and overview["caps"]["entries"] is False
        assert overview["caps"]["keys"] is True
        assert not any(q["queue"] == "ui-tenant-a-jobs" for q in
                       page.request.get(b.url + "/api/queues").json()["queues"])
        # Acting on it through the dashboard: pg_once refuses the role (42501).
        page.goto(b.url + "/keys/ui-tenant-a/secret/1")
        expect(page.locator("#absent")).to_be_visible()
        page.locator("button[value=invalidate]").click()
        page.locator("#confirm").click()
        expect(page.locator("#results")).to_contain_text("42501")

        # Its owner sees it, and its other keys too (once.keys; an earlier test may have
        # completed ui-tenant-a/live, so its state is not asserted).
        page.goto(a.url + "/dead-letters")
        expect(page.locator('tr[data-key="ui-tenant-a/secret/1"]')).to_contain_text("tenant a failure")
        assert page.request.get(a.url + "/api/keys/ui-tenant-a%2Fresult").json()["row"]["state"] == "done"
        assert page.request.get(a.url + "/api/keys/ui-tenant-a%2Flive").json()["row"] is not None
        assert any(q["queue"] == "ui-tenant-a-jobs" for q in
                   page.request.get(a.url + "/api/queues").json()["queues"])
        ctx.close()
    finally:
        a.stop()
        b.stop()
