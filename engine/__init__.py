"""The model side of mashbox. The server process imports only the modules that never import jax:
chat (templates, output parser; the server alone uses it), protocol, registry, config and memory."""
