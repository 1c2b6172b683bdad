"""The engine process and its link to the gateway: msgspec frames, shared-memory rings, the engine loop.

`messages` and `channel` import without torch (the gateway uses them); `engine_loop` builds the engine.
"""
