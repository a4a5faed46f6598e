"""The model side of mashbox: the engine worker's modules, and the few the server process loads too.

The server process (mashbox.py) never imports jax: the worker process (engine/worker.py) owns the
device. Of the engine, the server loads SERVER_MODULES and nothing else (tests/test_layout.py
compares the list with sys.modules after the server's start-up sizing); the README's map, "How it
is built", groups the files by the process they work in.
"""

# The engine modules the server process loads: those mashbox.py imports (chat, protocol, registry,
# config, checkpoint, memory, sharding's start-up checks, and what they import), and those its
# start-up sizing adds (native: whether a kernel tier runs; weights: which tensors are held narrow).
# None imports jax.
SERVER_MODULES = ("chat", "checkpoint", "config", "cpu", "memory", "native", "prefix", "protocol", "registry",
                  "scheduler", "sharding", "vocab", "weights")
# Of those, the ones only random weights load (their tokenizer files come from a packaged vocabulary).
RANDOM_WEIGHTS_ONLY = ("vocab",)
