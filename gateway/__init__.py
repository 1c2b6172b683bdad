"""The OpenAI-compatible server in front of the engine processes, in three wings that import one way:

- `web`: HTTP concerns every route shares (keys, CORS, hosts, connections, errors, the in-flight limit, metrics);
- `engines`: the engine processes and the clients that talk to them (spawn, frames, replicas, routing);
- `api`: the OpenAI endpoints, their protocol and what they need (tools, structured outputs, detokenizing).

On top: `config` (the server's settings), `app` (the Starlette app that wires the wings), `cli` (`orcinus`),
`banner` (the startup log). tests/test_layout.py holds the arrows.
"""
