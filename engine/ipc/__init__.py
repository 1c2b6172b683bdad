"""The engine process and its link to the gateway: msgspec frames, shared-memory rings, the worker loop.

`messages` and `channel` import without torch (the gateway uses them); `worker` builds the engine.
"""
