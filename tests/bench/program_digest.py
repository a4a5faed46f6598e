"""Digests of the model's programs, to show a change of engine code leaves them as they were (run by hand).

    python tests/bench/program_digest.py FOLDER [WEIGHTS_DTYPE KV_DTYPE]

Lowers engine.model's forward for a few decode and prefill shapes on the model in FOLDER (e.g.
tests/fixtures/tiny/qwen3) and prints a digest of each program's StableHLO, without source
locations and with function names normalised (they carry module paths). Run it on the code before and
after a change, on the same machine: equal digests mean XLA is handed the same programs, so speed and
logits cannot have changed. It does not exercise engine.native's kernel unless this CPU runs it.
"""
from __future__ import annotations

import hashlib
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numpy as np  # noqa: E402

from engine.cache import init_cache  # noqa: E402
from engine.config import load_config  # noqa: E402
from engine.model import jit_forward  # noqa: E402
from engine.weights import load_weights  # noqa: E402

SHAPES = ((1, 1), (4, 1), (1, 64), (1, 256))      # (rows, tokens): decode steps and prefill chunks


def main() -> None:
    folder = sys.argv[1]
    weights_dtype, kv_dtype = (sys.argv[2:4] + ["float32", "float16"][len(sys.argv[2:4]):])
    cfg = load_config(folder)
    params = load_weights(folder, cfg, weights_dtype)
    cache = init_cache(cfg, 4, 1024, np.dtype(kv_dtype))
    for rows, tokens in SHAPES:
        zeros = np.zeros(rows, np.int32)
        lowered = jit_forward.lower(params, cache, np.zeros((rows, tokens), np.int32), zeros, zeros,
                                    np.ones(rows, np.int32), cfg=cfg)
        text = re.sub(r"@[\w.]+", "@f", lowered.as_text(debug_info=False))
        print(f"{rows} rows x {tokens} tokens: {hashlib.sha256(text.encode()).hexdigest()[:16]}")


if __name__ == "__main__":
    main()
