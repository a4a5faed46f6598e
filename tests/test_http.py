"""The HTTP/1.1 layer on bytes: the request reader, the response writer, SSE framing, error shapes.

Pure tests: no sockets. Each feeds exact bytes and checks the exact result or the exact status.
"""
import json
import re

import pytest

import mashbox
from mashbox import ApiError, RequestReader

HOST = b"Host: 127.0.0.1:8000\r\n"


def read_all(data: bytes, max_body: int = mashbox.MAX_BODY_BYTES, pieces: list[int] | None = None):
    """Feed data (whole, or split at the given offsets) and collect every request that comes out."""
    reader = RequestReader(max_body)
    cuts = [0, *(pieces or []), len(data)]
    found = []
    for a, b in zip(cuts, cuts[1:]):
        reader.feed(data[a:b])
        while (req := reader.next()) is not None:
            found.append(req)
    return found, reader


def refused(data: bytes, status: int, max_body: int = mashbox.MAX_BODY_BYTES) -> ApiError:
    with pytest.raises(ApiError) as caught:
        read_all(data, max_body)
    assert caught.value.status == status, caught.value.message
    return caught.value


def post(body_framing: bytes, body: bytes) -> bytes:
    return b"POST /v1/chat/completions HTTP/1.1\r\n" + HOST + body_framing + b"\r\n" + body


# ---- reading requests ----------------------------------------------------------------------------

def test_request_line_headers_and_query_are_parsed():
    """Guards against lost query parameters (Claude Code's ?beta=true) and case-sensitive header lookup."""
    [req], _ = read_all(b"GET /v1/messages?beta=true&x=a%20b&empty= HTTP/1.1\r\n" + HOST +
                        b"X-Api-Key:  sk-1 \r\nAccept: */*\r\n\r\n")
    assert (req.method, req.target, req.path) == ("GET", "/v1/messages?beta=true&x=a%20b&empty=", "/v1/messages")
    assert req.query == {"beta": "true", "x": "a b", "empty": ""}
    assert req.header("x-api-key") == "sk-1"
    assert req.header("missing") is None
    assert req.headers[0] == ("host", "127.0.0.1:8000")
    assert (req.version, req.keep_alive, req.body) == ("HTTP/1.1", True, b"")


def test_content_length_body_arrives_in_any_pieces():
    """Guards against a body cut short or run over when it arrives in several reads."""
    body = b'{"messages": [{"role": "user", "content": "hi"}]}'
    data = post(b"Content-Length: %d\r\n" % len(body), body)
    for cut in range(1, len(data)):
        [req], reader = read_all(data, pieces=[cut])
        assert req.body == body
        assert reader.state == "idle"


def test_chunked_body_split_at_every_byte_boundary():
    """Guards against a chunked decoder that loses state between reads (chunk size, CRLF, trailer)."""
    data = post(b"Transfer-Encoding: chunked\r\n",
                b"4\r\nWiki\r\n6;name=value\r\npedia \r\nE\r\nin \r\n\r\nchunks.\r\n0\r\nX-Trailer: 1\r\n\r\n")
    for cut in range(1, len(data)):
        [req], _ = read_all(data, pieces=[cut])
        assert req.body == b"Wikipedia in \r\n\r\nchunks."
    [req], _ = read_all(data, pieces=list(range(1, len(data))))   # one byte per read
    assert req.body == b"Wikipedia in \r\n\r\nchunks."


def test_pipelined_requests_come_out_in_order():
    """Guards against a second request in the same read being dropped or answered out of order."""
    body = b'{"a":1}'
    data = (post(b"Content-Length: 7\r\n", body)
            + b"GET /health HTTP/1.1\r\n" + HOST + b"\r\n"
            + post(b"Transfer-Encoding: chunked\r\n", b"2\r\nok\r\n0\r\n\r\n")
            + b"GET /v1/models HTTP/1.1\r\n" + HOST + b"Connection: close\r\n\r\n")
    reqs, reader = read_all(data)
    assert [(r.method, r.path, r.body) for r in reqs] == [
        ("POST", "/v1/chat/completions", body), ("GET", "/health", b""),
        ("POST", "/v1/chat/completions", b"ok"), ("GET", "/v1/models", b"")]
    assert [r.keep_alive for r in reqs] == [True, True, True, False]
    assert reader.buffered == 0


@pytest.mark.parametrize("version, connection, keep", [
    (b"HTTP/1.1", b"", True),
    (b"HTTP/1.1", b"Connection: close\r\n", False),
    (b"HTTP/1.1", b"Connection: Upgrade, Close\r\n", False),
    (b"HTTP/1.1", b"Connection: keep-alive\r\n", True),
    (b"HTTP/1.0", b"", False),
    (b"HTTP/1.0", b"Connection: keep-alive\r\n", False),
])
def test_keep_alive_follows_version_and_connection_header(version, connection, keep):
    """Guards against holding HTTP/1.0 connections open or ignoring Connection: close."""
    [req], _ = read_all(b"GET / " + version + b"\r\n" + HOST + connection + b"\r\n")
    assert req.keep_alive is keep


def test_http10_request_without_host_is_accepted():
    """Guards against refusing old clients: only HTTP/1.1 requires Host."""
    [req], _ = read_all(b"GET /health HTTP/1.0\r\n\r\n")
    assert req.version == "HTTP/1.0"


def test_empty_lines_before_a_request_are_skipped():
    """Guards against a 400 for the stray CRLF some clients send after a POST body (RFC 9112 s2.2)."""
    reqs, _ = read_all(b"\r\n\r\nGET / HTTP/1.1\r\n" + HOST + b"\r\n")
    assert [r.path for r in reqs] == ["/"]


def test_absolute_form_and_asterisk_targets():
    """Guards against a 400 for the absolute-form target proxies send."""
    [req], _ = read_all(b"GET http://127.0.0.1:8000/v1/models?x=1 HTTP/1.1\r\n" + HOST + b"\r\n")
    assert (req.path, req.query) == ("/v1/models", {"x": "1"})
    [req], _ = read_all(b"OPTIONS * HTTP/1.1\r\n" + HOST + b"\r\n")
    assert req.path == "*"


def test_truncated_request_waits_for_more():
    """Guards against parsing half a head or half a body as a whole request."""
    data = post(b"Content-Length: 10\r\n", b"0123456789")
    for cut in range(len(data)):
        reqs, _ = read_all(data[:cut])
        assert reqs == []


def test_expect_continue_is_offered_once_when_a_body_is_due():
    """Guards against curl waiting a second for 100 Continue before sending every large body."""
    reader = RequestReader()
    reader.feed(post(b"Content-Length: 2\r\nExpect: 100-continue\r\n", b""))
    assert reader.next() is None
    assert reader.take_continue() is True
    assert reader.take_continue() is False
    reader.feed(b"{}")
    assert reader.next().body == b"{}"
    reader.feed(b"GET / HTTP/1.1\r\n" + HOST + b"Expect: 100-continue\r\n\r\n")
    assert reader.next() is not None and reader.take_continue() is False   # no body: nothing to wait for


def test_reader_state_tells_idle_head_and_body_apart():
    """Guards against the wrong timeout: idle keep-alive vs a slow head vs a stalled body."""
    reader = RequestReader()
    assert reader.state == "idle"
    reader.feed(b"POST / HTTP/1.1\r\n")
    assert reader.next() is None and reader.state == "head"
    reader.feed(HOST + b"Content-Length: 3\r\n\r\nab")
    assert reader.next() is None and reader.state == "body"
    reader.feed(b"c")
    assert reader.next().body == b"abc" and reader.state == "idle"


# ---- refusing bad requests -----------------------------------------------------------------------

@pytest.mark.parametrize("data", [
    b"hello\r\n\r\n",
    b"GET /\r\n\r\n",
    b"GET / HTTP/1.1 extra\r\nHost: x\r\n\r\n",
    b"GET  / HTTP/1.1\r\nHost: x\r\n\r\n",
    b"G(T / HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET / HTTP/one\r\nHost: x\r\n\r\n",
    b"GET /\x7f HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /caf\xc3\xa9 HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nBad Name: 1\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nName : 1\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nA: 1\r\n folded\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nA: 1\x002\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nA: 1\n2\r\n\r\n",
    b"GET / HTTP/1.1\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
    b"GET / HTTP/1.1\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(32)) + b"\r\n\r\n",   # a TLS hello
])
def test_garbage_is_refused_with_400(data):
    """Guards against a 500, a hang, or a guess at what a malformed request meant."""
    refused(data, 400)


def test_other_http_versions_get_505():
    """Guards against speaking HTTP/1.1 framing to an HTTP/2 client (its preface is PRI * HTTP/2.0)."""
    refused(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505)


def test_long_request_line_gets_414_before_it_ends():
    """Guards against buffering an endless request line (RFC 9112: 414 for a target too long)."""
    line = b"GET /" + b"a" * mashbox.MAX_REQUEST_LINE
    refused(line, 414)                                        # still arriving
    refused(line + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414)      # complete


def test_too_many_or_too_large_headers_get_431():
    """Guards against unbounded memory per connection from headers."""
    many = b"".join(b"X-%d: 1\r\n" % i for i in range(mashbox.MAX_HEADERS + 1))
    refused(b"GET / HTTP/1.1\r\n" + HOST + many + b"\r\n", 431)
    big = b"X-Big: " + b"a" * mashbox.MAX_HEAD_BYTES + b"\r\n"
    refused(b"GET / HTTP/1.1\r\n" + HOST + big + b"\r\n", 431)      # complete
    refused(b"GET / HTTP/1.1\r\n" + HOST + big, 431)                # still arriving


def test_body_over_the_limit_gets_413_before_it_is_read():
    """Guards against reading (and holding) a body the server will refuse anyway."""
    err = refused(post(b"Content-Length: 1001\r\n", b""), 413, max_body=1000)
    assert "1001" in err.message
    read_all(post(b"Content-Length: 1000\r\n", b"x" * 1000), max_body=1000)   # the limit itself is fine
    refused(post(b"Transfer-Encoding: chunked\r\n", b"3e8\r\n" + b"x" * 1000 + b"\r\n1\r\n"), 413, max_body=1000)


def test_the_body_limit_fits_agent_prompts():
    """Guards against a limit that refuses real agent traffic (Claude Code bodies reach 250 KB)."""
    assert mashbox.MAX_BODY_BYTES >= 16 * 1024 * 1024


@pytest.mark.parametrize("framing", [
    b"Content-Length: 3\r\nContent-Length: 3\r\n",
    b"Content-Length: 3\r\nContent-Length: 4\r\n",
    b"Content-Length: 3, 3\r\n",
    b"Content-Length: -3\r\n",
    b"Content-Length: +3\r\n",
    b"Content-Length: 0x3\r\n",
    b"Content-Length: \r\n",
    b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n",
    b"Transfer-Encoding: chunked\r\nContent-Length: 3\r\n",
    b"Transfer-Encoding: chunked, gzip\r\n",
    b"Transfer-Encoding: chunked, chunked\r\n",
])
def test_ambiguous_body_framing_is_refused_with_400(framing):
    """Guards against request smuggling: two readings of where a body ends must never both be possible."""
    refused(post(framing, b"abc"), 400)


def test_transfer_encoding_in_http10_is_refused():
    """Guards against chunked framing from a client whose version has none (RFC 9112 s6.1)."""
    refused(b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400)


@pytest.mark.parametrize("coding", [b"gzip", b"gzip, chunked", b"identity"])
def test_unsupported_transfer_coding_gets_501(coding):
    """Guards against treating a compressed body as plain bytes (RFC 9112: 501 for an unknown coding)."""
    refused(post(b"Transfer-Encoding: " + coding + b"\r\n", b""), 501)


@pytest.mark.parametrize("chunks", [
    b"zz\r\nab\r\n0\r\n\r\n",
    b"-1\r\nab\r\n0\r\n\r\n",
    b"0x2\r\nab\r\n0\r\n\r\n",
    b"\r\nab\r\n0\r\n\r\n",
    b"1" * 17 + b"\r\n",
    b"2\r\nabX\r\n0\r\n\r\n",
    b"2 2\r\nab\r\n0\r\n\r\n",
    b"2" + b";" * mashbox.MAX_CHUNK_LINE,
])
def test_bad_chunks_are_refused_with_400(chunks):
    """Guards against a chunked decoder that guesses at malformed sizes or missing CRLFs."""
    refused(post(b"Transfer-Encoding: chunked\r\n", chunks), 400)


# ---- writing responses ---------------------------------------------------------------------------

@pytest.fixture
def fixed_date(monkeypatch):
    monkeypatch.setattr(mashbox, "http_date", lambda: "Mon, 30 Nov 2026 12:00:00 GMT")


def test_response_bytes_are_exact(fixed_date):
    """Guards against a missing Content-Length, Date or Server header, or a wrong status line."""
    assert mashbox.response_bytes(200, b'{"ok":true}', "application/json", [("Retry-After", "5")]) == (
        b"HTTP/1.1 200 OK\r\nDate: Mon, 30 Nov 2026 12:00:00 GMT\r\nServer: mashbox\r\n"
        b"Content-Type: application/json\r\nContent-Length: 11\r\nRetry-After: 5\r\n\r\n"
        b'{"ok":true}')


def test_closing_response_says_connection_close(fixed_date):
    """Guards against a client reusing a connection the server is about to close."""
    data = mashbox.response_bytes(529, b"{}", "application/json", keep_alive=False)
    assert data.startswith(b"HTTP/1.1 529 Overloaded\r\n")
    assert b"\r\nConnection: close\r\n\r\n{}" in data


def test_head_response_has_the_get_headers_and_no_body(fixed_date):
    """Guards against a body after a HEAD answer, which corrupts the next response on the connection."""
    get = mashbox.response_bytes(200, b"abcdef", "text/plain")
    head = mashbox.response_bytes(200, b"abcdef", "text/plain", head_only=True)
    assert get == head + b"abcdef"
    assert b"Content-Length: 6\r\n" in head


def test_stream_head_and_chunks_are_exact(fixed_date):
    """Guards against SSE that proxies buffer (no no-cache) or chunk framing with a wrong size."""
    assert mashbox.stream_head() == (
        b"HTTP/1.1 200 OK\r\nDate: Mon, 30 Nov 2026 12:00:00 GMT\r\nServer: mashbox\r\n"
        b"Content-Type: text/event-stream\r\nCache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n")
    frame = mashbox.sse({"type": "ping"}, event="ping")
    assert mashbox.chunk(frame) == b"23\r\nevent: ping\ndata: {\"type\":\"ping\"}\n\n\r\n"
    assert mashbox.chunk(b"") == b""          # an empty chunk would end the stream
    assert mashbox.LAST_CHUNK == b"0\r\n\r\n"
    unframed = mashbox.stream_head(chunked=False, keep_alive=False)
    assert b"Transfer-Encoding" not in unframed and b"Connection: close\r\n" in unframed


def test_sse_frames_are_exact():
    """Guards against SSE frames clients cannot split: one data line, blank line after, raw UTF-8."""
    assert mashbox.sse({"a": "é", "b": [1, 2]}) == 'data: {"a":"é","b":[1,2]}\n\n'.encode()
    assert mashbox.sse("[DONE]") == b"data: [DONE]\n\n"
    assert mashbox.sse({"type": "message_stop"}, event="message_stop") == (
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n')


def test_response_header_with_a_line_break_is_refused():
    """Guards against header injection through a value that reached a response header."""
    with pytest.raises(ValueError):
        mashbox.response_head(200, [("X-Id", "a\r\nSet-Cookie: x=1")])


def test_date_header_is_an_http_date():
    """Guards against a Date in a format clients cannot parse (RFC 9110 IMF-fixdate)."""
    assert re.fullmatch(r"[A-Z][a-z]{2}, \d\d [A-Z][a-z]{2} \d{4} \d\d:\d\d:\d\d GMT", mashbox.http_date())


# ---- the one error mapper ------------------------------------------------------------------------

def test_openai_error_shape():
    """Guards against an error body OpenAI clients cannot read (they expect error.message/type/code/param)."""
    err = ApiError(404, "model: 'x' is not served here", code="model_not_found", param="model")
    assert mashbox.openai_error_body(err) == {"error": {
        "message": "model: 'x' is not served here", "type": "invalid_request_error",
        "code": "model_not_found", "param": "model"}}
    assert mashbox.openai_error_body(ApiError(529, "busy", type="overloaded_error"))["error"]["type"] == "unavailable"


@pytest.mark.parametrize("status, kind", [(400, "invalid_request_error"), (401, "authentication_error"),
                                          (404, "not_found_error"), (413, "request_too_large"),
                                          (500, "api_error"), (529, "overloaded_error")])
def test_anthropic_error_shape_follows_the_status(status, kind):
    """Guards against Anthropic clients misreading an error: its type must match its status."""
    body = mashbox.anthropic_error_body(ApiError(status, "why"))
    assert body == {"type": "error", "error": {"type": kind, "message": "why"}}
    json.dumps(body)
