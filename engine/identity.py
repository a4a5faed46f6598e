"""What a running model is, as two ids the spec's Health reports (no jax here: the fake engine and
tests import it too).

    component_set_sha(folder, chat_format)   sha256 over the model's components as loaded: config,
                                             every weight file, the tokenizer files, the chat template
    deployment_id(programs, settings)        sha256 over the compiled programs' text and what shapes
                                             them (jax/jaxlib versions, device kind, engine settings)

A weight file's hash is kept in a small file under the cache root, keyed by (path, size, mtime), so a
restart does not read gigabytes again; any write to the file changes its mtime and so its hash is
taken anew.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

# Files of a Hugging Face folder that decide what the model reads and says, besides its weights.
# generation_config.json holds the stop ids; tokenizer_config.json the chat template the GGUF or the
# checkpoint ships (mashbox renders its own, from engine/chat.py, which is hashed too).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "generation_config.json")
CONFIG_FILE = "config.json"
# The chat templates are Python code: their source is the template as loaded.
CHAT_SOURCE = Path(__file__).resolve().parent / "chat.py"
# Hashes of files at least this big are remembered between starts (smaller ones are read each time).
REMEMBER_BYTES = 1 << 20
HASH_CACHE_NAME = "file-hashes.json"
READ_CHUNK = 8 << 20


def _cache_path() -> Path:
    from engine.registry import cache_root
    return cache_root() / HASH_CACHE_NAME


def _load_cache(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_cache(path: Path, cache: dict) -> None:
    """Best effort (a read-only cache root only costs a rehash next time); written whole, then renamed."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=0, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass


def file_sha256(path: str, cache: dict | None = None) -> str:
    """sha256 of a file's bytes; with `cache`, a big file's hash is reused while its size and mtime
    are unchanged (and stored there when taken)."""
    path = os.path.abspath(path)
    st = os.stat(path)
    key = [st.st_size, st.st_mtime_ns]
    if cache is not None and st.st_size >= REMEMBER_BYTES:
        hit = cache.get(path)
        if isinstance(hit, list) and hit[:2] == key:
            return hit[2]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(READ_CHUNK):
            h.update(block)
    digest = h.hexdigest()
    if cache is not None and st.st_size >= REMEMBER_BYTES:
        cache[path] = key + [digest]
    return digest


def weight_files(folder: str) -> list[str]:
    """The weight files the loader reads (engine.checkpoint decides which), and the shard index."""
    from engine.checkpoint import INDEX_FILE, WeightsError, weight_files as files_of
    try:
        files = set(files_of(folder)[1])
    except (WeightsError, OSError):
        files = set()
    index = os.path.join(folder, INDEX_FILE)
    if os.path.exists(index):
        files.add(index)
    return sorted(files)


def component_set_sha(folder: str, chat_format: str, cache_file: Path | None = None) -> str:
    """The id of the model's component set: sha256 over a manifest of (role, file name, sha256) for
    the config, every weight file, the tokenizer files and the chat template (engine/chat.py's source
    and the format it renders)."""
    cache_file = cache_file or _cache_path()
    cache = _load_cache(cache_file)
    before = dict(cache)
    manifest = [("chat_format", chat_format, ""), ("chat_template", CHAT_SOURCE.name, file_sha256(str(CHAT_SOURCE)))]
    config = os.path.join(folder, CONFIG_FILE)
    if os.path.exists(config):
        manifest.append(("config", CONFIG_FILE, file_sha256(config)))
    for name in TOKENIZER_FILES:
        path = os.path.join(folder, name)
        if os.path.exists(path):
            manifest.append(("tokenizer", name, file_sha256(path, cache)))
    for path in weight_files(folder):
        manifest.append(("weights", os.path.relpath(path, folder), file_sha256(path, cache)))
    if cache != before:
        _save_cache(cache_file, cache)
    return hashlib.sha256(json.dumps(manifest).encode()).hexdigest()


def deployment_id(programs: list[str], settings: dict) -> str:
    """The id of the compiled programs a server runs: each program's text (sorted, so the order they
    were compiled in does not matter) and the settings and software that shape them."""
    h = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    for digest in sorted(hashlib.sha256(text.encode()).hexdigest() for text in programs):
        h.update(digest.encode())
    return h.hexdigest()
