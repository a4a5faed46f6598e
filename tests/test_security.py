"""Keys, tenants and browser protection: the Guard on parsed requests, the key file and its reload on
SIGHUP, start-up refusals, and 401/403/415 on every route family of a running server, in each API's
error shape."""
import asyncio
import http.client
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest

import mashbox
from mashbox import ApiError, Guard, KeyFileError, Keys
from tests.harness import HOST, ROUTES, WAIT_S, error_of, start_server
from tests.fake_worker import MODEL_ID, FakeArgs

CLIENTS = Path(__file__).resolve().parent.parent.parent / "shared" / "fixtures" / "clients"


class Req:
    """Just what the guard reads of a request."""

    def __init__(self, method="POST", headers=None, query=None):
        self.method = method
        self.query = query or {}
        self._h = {k.lower(): v for k, v in (headers or {}).items()}

    def header(self, name):
        return self._h.get(name)


JSON = {"content-type": "application/json", "host": "127.0.0.1:8000"}


def guard(keys=None, host="127.0.0.1", allowed=()):
    return Guard(keys or Keys([]), host, allowed)


def refused(g, req, needs_key=True) -> ApiError:
    with pytest.raises(ApiError) as e:
        g.check(req, needs_key)
    return e.value


# ---- the key file --------------------------------------------------------------------------------

def test_key_file_names_tenants_and_ignores_comments(tmp_path):
    """Guards against a key file format that is not what the README documents."""
    f = tmp_path / "keys"
    f.write_text("# team keys\nsk-alpha-0001 team-a\nsk-alpha-0002 team-a  # second\n\nsk-solo-0003\n"
                 "sk-hash#in-key\n")
    keys = Keys.load(str(f), None)
    assert keys.tenant_for("sk-alpha-0001") == keys.tenant_for("sk-alpha-0002") == "team-a"
    assert keys.tenant_for("sk-solo-0003") == "line 5"
    assert keys.tenant_for("sk-hash#in-key") == "line 6"          # '#' inside a key is the key's
    assert keys.tenant_for("sk-wrong") is None and keys.tenant_for(None) is None
    assert len(keys) == 4 and keys.tenants == 3


def test_the_environment_key_is_its_own_tenant_next_to_the_file(tmp_path):
    """Guards against MASHBOX_API_KEY replacing the file's keys, or sharing a file tenant's queue."""
    f = tmp_path / "keys"
    f.write_text("sk-file-key-1 default\n")
    keys = Keys.load(str(f), "sk-env-key-01")
    assert keys.tenant_for("sk-file-key-1") == "default"
    assert keys.tenant_for("sk-env-key-01") == mashbox.ENV_TENANT != "default"


@pytest.mark.parametrize("text, line, why", [
    ("sk-good-key-1\nsk-bad key with spaces\n", 2, "fields"),
    ("sk-good-key-1\nshort\n", 2, "at least 8"),
    ("sk-good-key-1 a\n\nsk-good-key-1 b\n", 3, "same key as line 1"),
    ("sk-good-key-1 team/a\n", 1, "tenant name"),
    ("sk-good-key-1\nsk-k\u00e9y-0002\n", 2, "visible ASCII"),
])
def test_a_malformed_key_file_names_its_line(tmp_path, text, line, why):
    """Guards against a server that starts with half its keys, or an error that says not where."""
    f = tmp_path / "keys"
    f.write_text(text, encoding="utf-8")
    with pytest.raises(KeyFileError, match=f":{line}: .*{why}"):
        Keys.load(str(f), None)


def test_a_key_file_that_is_not_text_or_empty_or_missing_is_refused(tmp_path):
    """Guards against a server that runs with no keys (open) although a key file was given."""
    f = tmp_path / "keys"
    f.write_bytes(b"sk-good-key-1\n\xff\xfe\n")
    with pytest.raises(KeyFileError, match=":2: not UTF-8"):
        Keys.load(str(f), None)
    f.write_text("# nothing but comments\n\n")
    with pytest.raises(KeyFileError, match="no keys"):
        Keys.load(str(f), None)
    with pytest.raises(KeyFileError, match="missing"):
        Keys.load(str(tmp_path / "missing"), None)


def test_start_up_refuses_a_bad_key_file_and_an_open_non_loopback_host(tmp_path, monkeypatch, capsys):
    """Guards against a server reachable from the network with no key, or started with a broken key file."""
    monkeypatch.delenv("MASHBOX_API_KEY", raising=False)
    assert mashbox.main(["run", "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "not loopback" in capsys.readouterr().err
    f = tmp_path / "keys"
    f.write_text("sk-good-key-1\nsk-bad key line\n")
    assert mashbox.main(["run", "--api-key-file", str(f), "--port", "0"]) == 2
    assert f"{f}:2:" in capsys.readouterr().err


def test_queue_and_connection_limits_are_flags_with_the_spec_defaults():
    """Guards against limits that cannot be changed, or defaults that drift from the spec's 32 and 256."""
    config = mashbox.config_from_args(["run"])
    assert (config.max_waiting, config.max_waiting_per_tenant) == (256, 32)
    assert config.max_connections == mashbox.MAX_CONNECTIONS
    config = mashbox.config_from_args(["run", "--max-waiting", "9", "--max-waiting-per-tenant", "3",
                                       "--max-connections", "50"])
    assert (config.max_waiting, config.max_waiting_per_tenant, config.max_connections) == (9, 3, 50)


# ---- the guard on one request --------------------------------------------------------------------

def test_no_keys_means_one_tenant_and_any_key_is_ignored():
    """Guards against refusing clients that send dummy keys to a loopback server."""
    assert guard().check(Req(headers={**JSON, "authorization": "Bearer sk-dummy"}), True) == "default"


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer nope-nope"}, {"x-api-key": "nope-nope"},
                                     {"authorization": "Basic c2stc2VjcmV0LTAx"},
                                     {"authorization": "Bearer sk-secret-01x"}, {"x-api-key": "sk-secret-0"}])
def test_missing_or_wrong_key_is_401(headers):
    """Guards against open /v1 routes when keys are configured (a prefix of a key is a wrong key too)."""
    g = guard(Keys([(b"sk-secret-01", "a")]))
    e = refused(g, Req(headers={**JSON, **headers}))
    assert e.status == 401 and "sk-secret" not in e.message


def test_a_key_in_the_query_string_is_401_and_says_why():
    """Guards against reading keys from URLs (they land in logs), or a 401 that leaves the user guessing."""
    g = guard(Keys([(b"sk-secret-01", "a")]))
    e = refused(g, Req(headers=JSON, query={"api_key": "sk-secret-01"}))
    assert e.status == 401 and "api_key=" in e.message and "sk-secret" not in e.message


@pytest.mark.parametrize("headers", [{"authorization": "Bearer sk-secret-01"}, {"x-api-key": "sk-secret-01"},
                                     {"authorization": "bearer  sk-secret-01 "}])
def test_either_key_header_is_accepted(headers):
    """Guards against breaking the Anthropic SDK (Bearer) or Claude Code (x-api-key)."""
    g = guard(Keys([(b"sk-secret-01", "a")]))
    assert g.check(Req(headers={**JSON, **headers}), True) == "a"


def test_a_right_key_in_either_header_wins_over_a_wrong_one_in_the_other():
    """Guards against refusing a client configured with both an auth token and an API key."""
    g = guard(Keys([(b"sk-secret-01", "a")]))
    assert g.check(Req(headers={**JSON, "authorization": "Bearer stale-token", "x-api-key": "sk-secret-01"}),
                   True) == "a"
    assert g.check(Req(headers={**JSON, "authorization": "Bearer sk-secret-01", "x-api-key": "stale-key"}),
                   True) == "a"
    assert refused(g, Req(headers={**JSON, "authorization": "Bearer stale-1", "x-api-key": "stale-2"})).status == 401


def test_open_routes_and_head_need_no_key():
    """Guards against health checks and HEAD probes failing behind a key."""
    g = guard(Keys([(b"sk-secret-01", "a")]))
    assert g.check(Req("GET", {"host": "localhost:8000"}), False) == "default"
    assert g.check(Req("HEAD", {"host": "localhost:8000"}), True) == "default"


def test_keys_are_compared_in_constant_time(monkeypatch):
    """Guards against a key comparison that leaks through timing (== exits at the first mismatch)."""
    calls = []
    real = mashbox.hmac.compare_digest
    monkeypatch.setattr(mashbox.hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    Keys([(b"sk-one-0001", "a"), (b"sk-two-0002", "b")]).tenant_for("sk-one-0001")
    assert len(calls) == 2  # every key compared, no early exit


@pytest.mark.parametrize("origin", ["https://evil.example", "null", "http://127.0.0.1:9999",
                                    "http://evil.example:8000"])
def test_requests_from_another_origin_are_403(origin):
    """Guards against a web page driving the server from a user's browser."""
    assert refused(guard(), Req(headers={**JSON, "origin": origin})).status == 403


def test_same_origin_and_node_clients_pass():
    """Guards against refusing Node SDKs (sec-fetch-mode: cors) or Claude Code's browser header."""
    g = guard()
    g.check(Req(headers={**JSON, "origin": "http://127.0.0.1:8000"}), True)
    g.check(Req(headers={**JSON, "sec-fetch-mode": "cors",
                         "anthropic-dangerous-direct-browser-access": "true"}), True)


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example",
                                  "localhost.evil.example:8000", "[::2]:8000"])
def test_unknown_host_names_are_403(host):
    """Guards against DNS rebinding: a page on a name that resolves to 127.0.0.1."""
    e = refused(guard(), Req(headers={"content-type": "application/json", "host": host}))
    assert e.status == 403


@pytest.mark.parametrize("host", ["localhost:8000", "127.0.0.1", "[::1]:8000", "box.lan:8000", "LOCALHOST"])
def test_known_host_names_pass(host):
    """Guards against refusing the names the server answers to, or ones given with a flag."""
    guard(allowed=("box.lan",)).check(Req(headers={"content-type": "application/json", "host": host}), True)


def test_a_server_bound_to_every_address_answers_to_ip_literals_only():
    """Guards against refusing a LAN client that uses the machine's address, or accepting any name."""
    g = guard(Keys([(b"sk-secret-01", "a")]), host="0.0.0.0")
    ok = {"content-type": "application/json", "x-api-key": "sk-secret-01"}
    g.check(Req(headers={**ok, "host": "192.168.1.20:8000"}), True)
    assert refused(g, Req(headers={**ok, "host": "evil.example:8000"})).status == 403


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x", "application/jsonx"])
def test_a_post_that_is_not_json_is_415(ctype):
    """Guards against form posts (which browsers send without preflight) reaching the model."""
    headers = {"host": "127.0.0.1"}
    if ctype:
        headers["content-type"] = ctype
    assert refused(guard(), Req(headers=headers)).status == 415


def test_json_with_a_charset_is_accepted():
    """Guards against refusing clients that add '; charset=utf-8'."""
    guard().check(Req(headers={"host": "127.0.0.1", "content-type": "Application/JSON; charset=utf-8"}), True)


# ---- reloading the keys --------------------------------------------------------------------------

def test_reload_swaps_the_keys_and_a_bad_file_keeps_the_old_ones(tmp_path, caplog):
    """Guards against a reload that leaves the server with no keys (open) or half a file's keys."""
    f = tmp_path / "keys"
    f.write_text("sk-first-key-1 a\n")
    g = Guard(Keys.load(str(f), None), "127.0.0.1")
    f.write_text("sk-second-key-2 b\n")
    assert g.reload_keys()
    assert g.keys.tenant_for("sk-second-key-2") == "b" and g.keys.tenant_for("sk-first-key-1") is None
    f.write_text("sk-third-key-3\nnot a valid line\n")
    with caplog.at_level(logging.ERROR, logger="mashbox"):
        assert not g.reload_keys()
    assert f"{f}:2:" in caplog.text and "sk-third" not in caplog.text
    assert g.keys.tenant_for("sk-second-key-2") == "b" and g.keys.tenant_for("sk-third-key-3") is None


def test_sighup_rereads_the_key_file_without_dropping_connections(tmp_path, caplog):
    """Guards against a key rotation that needs a restart (dropping every stream) or cuts open connections."""
    f = tmp_path / "keys"
    f.write_text("sk-old-key-01 team\n")
    app = mashbox.App(mashbox.ServeConfig(host=HOST, port=0, model=MODEL_ID),
                      bridge=mashbox.Bridge(FakeArgs(), entry="tests.fake_worker:main", log=lambda m: None),
                      guard=Guard(Keys.load(str(f), None), HOST))
    stop = asyncio.Event()
    seen: dict = {}

    def status(conn, key):
        conn.request("GET", "/v1/models", headers={"x-api-key": key})
        resp = conn.getresponse()
        resp.read()
        return resp.status

    def until(predicate):
        deadline = time.monotonic() + WAIT_S
        while not predicate():
            assert time.monotonic() < deadline
            time.sleep(0.05)

    def client(loop):
        try:
            until(lambda: app.port is not None)
            conn = http.client.HTTPConnection(HOST, app.port, timeout=WAIT_S)
            seen["before"] = status(conn, "sk-old-key-01")
            sock = conn.sock
            f.write_text("sk-new-key-02 team\n")
            os.kill(os.getpid(), signal.SIGHUP)
            until(lambda: status(conn, "sk-new-key-02") == 200)
            seen["old_after"] = status(conn, "sk-old-key-01")
            f.write_text("sk-newer-key-3\nbroken line here\n")
            os.kill(os.getpid(), signal.SIGHUP)
            until(lambda: "not re-read" in caplog.text)
            seen["new_after_bad"] = status(conn, "sk-new-key-02")
            seen["same_socket"] = conn.sock is sock
        except BaseException as e:   # the assertion is made in the main thread
            seen["error"] = e
        finally:
            loop.call_soon_threadsafe(stop.set)

    async def main():
        threading.Thread(target=client, args=(asyncio.get_running_loop(),), daemon=True).start()
        await mashbox.serve(app, stop)

    with caplog.at_level(logging.INFO, logger="mashbox"):
        asyncio.run(asyncio.wait_for(main(), 2 * WAIT_S))
    assert "error" not in seen, seen.get("error")
    assert seen == {"before": 200, "old_after": 401, "new_after_bad": 200, "same_socket": True}
    assert f"{f}:2:" in caplog.text


# ---- every route family of a running server ------------------------------------------------------

KEY, OTHER_KEY = "sk-test-key-0001", "sk-test-key-0002"


@pytest.fixture(scope="module")
def keyed():
    with start_server(keys={KEY: "team", OTHER_KEY: None}, ctx=32768) as server:
        yield server


def send(server, method, path, body, headers):
    if method == "POST":
        headers = {"Content-Type": "application/json", **headers}
        body = json.dumps(body).encode()
    return server.request(method, path, body, headers)


@pytest.mark.parametrize("method, path, body, api", ROUTES, ids=[r[1] for r in ROUTES])
def test_every_route_family_needs_a_key_in_either_header(keyed, method, path, body, api):
    """Guards against a route left open, a key header ignored on some route, or a 401 in the wrong shape."""
    for headers in ({}, {"authorization": "Bearer sk-wrong-key-1"}, {"x-api-key": "sk-wrong-key-1"},
                    {"authorization": KEY}):   # a key without "Bearer " is not a Bearer key
        status, _, answer = send(keyed, method, path, body, headers)
        assert status == 401, (headers, answer)
        assert "sk-" not in error_of(401, answer, api)["message"]
    status, _, answer = send(keyed, method, f"{path}?api_key={KEY}", body, {})
    assert status == 401 and "api_key=" in error_of(401, answer, api)["message"]
    for headers in ({"authorization": f"Bearer {KEY}"}, {"x-api-key": OTHER_KEY}):
        status, _, answer = send(keyed, method, path, body, headers)
        assert status == 200, (headers, answer[:300])


@pytest.mark.parametrize("path", ["/", "/health", "/v1/health"])
def test_health_and_head_stay_open_with_keys(keyed, path):
    """Guards against load balancers and HEAD probes locked out by the keys."""
    assert keyed.request("GET", path)[0] == 200
    assert keyed.request("HEAD", path)[0] == 200
    assert keyed.request("HEAD", "/v1/models")[0] == 200


@pytest.mark.parametrize("method, path, body, api", ROUTES, ids=[r[1] for r in ROUTES])
def test_every_route_family_refuses_other_origins_and_host_names(keyed, method, path, body, api):
    """Guards against a browser page (or a DNS-rebound name) reaching any route, keyed or not."""
    ok = {"x-api-key": KEY}
    for headers in ({**ok, "Origin": "https://evil.example"}, {**ok, "Origin": "null"},
                    {**ok, "Host": "evil.example"}, {**ok, "Host": f"rebind.example:{keyed.port}"}):
        status, _, answer = send(keyed, method, path, body, headers)
        assert status == 403, (headers, answer)
        error_of(403, answer, api)
    same_origin = {**ok, "Origin": f"http://{HOST}:{keyed.port}", "sec-fetch-mode": "cors",
                   "anthropic-dangerous-direct-browser-access": "true"}
    assert send(keyed, method, path, body, same_origin)[0] == 200
    assert keyed.request("GET", "/health", headers={"Origin": "https://evil.example"})[0] == 403


@pytest.mark.parametrize("method, path, body, api", [r for r in ROUTES if r[0] == "POST"],
                         ids=[r[1] for r in ROUTES if r[0] == "POST"])
def test_every_post_route_needs_a_json_content_type(keyed, method, path, body, api):
    """Guards against form posts (no CORS preflight) reaching the model on any route."""
    data = json.dumps(body).encode()
    for ctype in (None, "text/plain", "application/x-www-form-urlencoded"):
        headers = {"x-api-key": KEY} | ({"Content-Type": ctype} if ctype else {})
        status, _, answer = keyed.request("POST", path, data, headers)
        assert status == 415, (ctype, answer)
        error_of(415, answer, api)
    headers = {"x-api-key": KEY, "Content-Type": "application/json; charset=utf-8"}
    assert keyed.request("POST", path, data, headers)[0] == 200


def recorded_requests():
    """One recorded request per client and route (../shared/fixtures/clients), with its key headers."""
    if not CLIENTS.is_dir():
        return []
    chosen = {}
    for f in sorted(CLIENTS.glob("*/*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            if line.strip():
                r = json.loads(line)
                chosen.setdefault((f.parent.name, r["method"], r["path"]), r)
    return list(chosen.values())


def test_recorded_clients_pass_the_guard_with_a_real_key_in_their_own_header(keyed):
    """Guards against a Host, Origin, content-type or key check that refuses what real clients send."""
    requests = recorded_requests()
    if not requests:
        pytest.skip("recorded client traffic (../shared/fixtures/clients) is not here")
    for r in requests:
        headers = {}
        for name, value in r["headers"]:
            low = name.lower()
            if low in ("content-length", "host", "connection", "accept-encoding", "transfer-encoding"):
                continue
            if low == "authorization":
                value = f"Bearer {KEY}"
            elif low == "x-api-key":
                value = KEY
            headers[name] = value
        target = r["path"] + (f"?{r['query']}" if r.get("query") else "")
        body = json.dumps(r["body"]).encode() if r.get("body") is not None else None
        status, _, answer = keyed.request(r["method"], target, body, headers)
        assert status == 200, (r["method"], target, answer[:300])


def test_keys_and_tenant_names_never_reach_the_log_or_the_metrics(keyed, caplog):
    """Guards against a key (or who uses the server) leaking through the log or a Prometheus label."""
    with caplog.at_level(logging.DEBUG):
        for key in (KEY, "sk-wrong-key-77"):
            send(keyed, "POST", "/v1/chat/completions", ROUTES[2][2], {"x-api-key": key})
            send(keyed, "GET", f"/v1/models?api_key={key}", None, {"authorization": f"Bearer {key}"})
        status, _, metrics = keyed.request("GET", "/metrics", headers={"x-api-key": KEY})
    assert status == 200 and "/v1/chat/completions" in caplog.text   # the requests were logged
    for secret in (KEY, OTHER_KEY, "sk-wrong-key-77", "team", "line 2"):
        assert secret not in caplog.text and secret not in metrics.decode()
