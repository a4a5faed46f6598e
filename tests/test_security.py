"""Keys, tenants and browser protection (the Guard), on parsed requests."""
import pytest

import mashbox
from mashbox import ApiError, Guard, KeyFileError, Keys


class Req:
    """Just what the guard reads of a request."""

    def __init__(self, method="POST", headers=None):
        self.method = method
        self._h = {k.lower(): v for k, v in (headers or {}).items()}

    def header(self, name):
        return self._h.get(name)


JSON = {"content-type": "application/json", "host": "127.0.0.1:8000"}


def guard(keys=None, host="127.0.0.1", allowed=()):
    return Guard(keys or Keys([]), host, allowed)


def test_key_file_names_tenants_and_ignores_comments(tmp_path):
    """Guards against a key file format that is not what the README documents."""
    f = tmp_path / "keys"
    f.write_text("# team keys\nsk-alpha-0001 team-a\nsk-alpha-0002 team-a  # second\n\nsk-solo-0003\n")
    keys = Keys.load(str(f), None)
    assert keys.tenant_for("sk-alpha-0001") == keys.tenant_for("sk-alpha-0002") == "team-a"
    assert keys.tenant_for("sk-solo-0003") == "key-line-5"
    assert keys.tenant_for("sk-wrong") is None and keys.tenant_for(None) is None


def test_a_malformed_key_file_names_its_line(tmp_path):
    """Guards against a server that starts with half its keys."""
    f = tmp_path / "keys"
    f.write_text("sk-good-key-1\nsk-bad key with spaces\n")
    with pytest.raises(KeyFileError, match=":2:"):
        Keys.load(str(f), None)


def test_no_keys_means_one_tenant_and_any_key_is_ignored():
    """Guards against refusing clients that send dummy keys to a loopback server."""
    assert guard().check(Req(headers={**JSON, "authorization": "Bearer sk-dummy"}), True) == "default"


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer nope-nope"}, {"x-api-key": "nope-nope"},
                                     {"authorization": "Basic c2stc2VjcmV0LTAx"}])
def test_missing_or_wrong_key_is_401(headers):
    """Guards against open /v1 routes when keys are configured."""
    g = guard(Keys([(b"sk-secret-01", "a")]))
    with pytest.raises(ApiError) as e:
        g.check(Req(headers={**JSON, **headers}), True)
    assert e.value.status == 401


@pytest.mark.parametrize("headers", [{"authorization": "Bearer sk-secret-01"}, {"x-api-key": "sk-secret-01"}])
def test_either_key_header_is_accepted(headers):
    """Guards against breaking the Anthropic SDK (Bearer) or Claude Code (x-api-key)."""
    g = guard(Keys([(b"sk-secret-01", "a")]))
    assert g.check(Req(headers={**JSON, **headers}), True) == "a"


def test_open_routes_need_no_key():
    """Guards against health checks failing behind a key."""
    g = guard(Keys([(b"sk-secret-01", "a")]))
    assert g.check(Req("GET", {"host": "localhost:8000"}), False) == "default"


def test_keys_are_compared_in_constant_time(monkeypatch):
    """Guards against a key comparison that leaks through timing (== exits at the first mismatch)."""
    calls = []
    real = mashbox.hmac.compare_digest
    monkeypatch.setattr(mashbox.hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    Keys([(b"sk-one-0001", "a"), (b"sk-two-0002", "b")]).tenant_for("sk-one-0001")
    assert len(calls) == 2  # every key compared, no early exit


@pytest.mark.parametrize("origin", ["https://evil.example", "null", "http://127.0.0.1:9999"])
def test_requests_from_another_origin_are_403(origin):
    """Guards against a web page driving the server from a user's browser."""
    with pytest.raises(ApiError) as e:
        guard().check(Req(headers={**JSON, "origin": origin}), True)
    assert e.value.status == 403


def test_same_origin_and_node_clients_pass():
    """Guards against refusing Node SDKs (sec-fetch-mode: cors) or Claude Code's browser header."""
    g = guard()
    g.check(Req(headers={**JSON, "origin": "http://127.0.0.1:8000"}), True)
    g.check(Req(headers={**JSON, "sec-fetch-mode": "cors",
                         "anthropic-dangerous-direct-browser-access": "true"}), True)


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example"])
def test_unknown_host_names_are_403(host):
    """Guards against DNS rebinding: a page on a name that resolves to 127.0.0.1."""
    with pytest.raises(ApiError) as e:
        guard().check(Req(headers={"content-type": "application/json", "host": host}), True)
    assert e.value.status == 403


@pytest.mark.parametrize("host", ["localhost:8000", "127.0.0.1", "[::1]:8000", "box.lan:8000"])
def test_known_host_names_pass(host):
    """Guards against refusing the names the server answers to, or ones given with a flag."""
    guard(allowed=("box.lan",)).check(Req(headers={"content-type": "application/json", "host": host}), True)


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_post_that_is_not_json_is_415(ctype):
    """Guards against form posts (which browsers send without preflight) reaching the model."""
    headers = {"host": "127.0.0.1"}
    if ctype:
        headers["content-type"] = ctype
    with pytest.raises(ApiError) as e:
        guard().check(Req(headers=headers), True)
    assert e.value.status == 415


def test_json_with_a_charset_is_accepted():
    """Guards against refusing clients that add '; charset=utf-8'."""
    guard().check(Req(headers={"host": "127.0.0.1", "content-type": "application/json; charset=utf-8"}), True)
