"""The model side of mashbox. The server process imports only engine.chat and engine.protocol."""
