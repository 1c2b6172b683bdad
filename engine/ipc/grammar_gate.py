"""Requests waiting for their grammar (vLLM's WAITING_FOR_FSM), outside the scheduler and off the engine's step.

An AddGrammar starts compiling in a thread pool (llguidance drops the GIL while it builds); the AddRequests naming
it wait here, and once it has compiled each enters the engine with its own copy of the matcher. A large schema
(a second or more to compile) thus delays only the requests it constrains: the step, and every other stream, go on.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from engine.ipc.messages import AddGrammar, AddRequest

COMPILE_THREADS = 2  # grammars compiled at once; more wait their turn
BACKGROUND_NICE = 19  # compile threads' niceness: on a machine with few cores they would otherwise stretch every step


def background_thread() -> None:
    """A pool initializer: the calling thread yields the CPU to decoding (Linux sets niceness per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: compile at normal priority
        pass


@dataclass
class _Grammar:
    text: str
    compiled: Future  # -> a matcher in its start state (in error when the grammar is invalid)
    waiting: list[AddRequest] = field(default_factory=list)
    released: bool = False  # no later AddRequest will name it


@dataclass(frozen=True)
class Compiled:
    """A request whose grammar has compiled: its matcher (its own copy), or why the grammar failed."""

    request: AddRequest
    grammar: str
    matcher: object | None
    error: str | None


class GrammarGate:
    """`wake` is called from a compile thread when a grammar is done (the worker rings its own doorbell)."""

    def __init__(self, compile: Callable[[str], object], wake: Callable[[], None], threads: int = COMPILE_THREADS):
        self._compile = compile
        self._wake = wake
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar", initializer=background_thread)
        self._grammars: dict[str, _Grammar] = {}

    @property
    def busy(self) -> bool:
        """Some grammar is held: compiling, with requests to hand over, or not yet released."""
        return bool(self._grammars)

    def add_grammar(self, msg: AddGrammar) -> None:
        compiled = self._pool.submit(self._compile, msg.grammar)
        compiled.add_done_callback(lambda _: self._wake())
        self._grammars[msg.grammar_id] = _Grammar(msg.grammar, compiled)

    def park(self, msg: AddRequest) -> bool:
        """Hold a request until its grammar has compiled; False if no AddGrammar of that id came (or is released)."""
        grammar = self._grammars.get(msg.grammar_id)
        if grammar is None or grammar.released:
            return False
        grammar.waiting.append(msg)
        return True

    def release(self, grammar_id: str) -> None:
        grammar = self._grammars.get(grammar_id)
        if grammar is not None:
            grammar.released = True
            self._forget_if_done(grammar_id, grammar)

    def abort(self, request_id: str) -> bool:
        """Drop a waiting request; False if none of that id waits here."""
        for grammar_id, grammar in list(self._grammars.items()):
            for i, msg in enumerate(grammar.waiting):
                if msg.request.request_id == request_id:
                    del grammar.waiting[i]
                    self._forget_if_done(grammar_id, grammar)
                    return True
        return False

    def ready(self) -> list[Compiled]:
        """The waiting requests whose grammar has compiled, each with a fresh matcher; they wait here no longer."""
        out = []
        for grammar_id, grammar in list(self._grammars.items()):
            if not grammar.compiled.done():
                continue
            start, error = self._result(grammar)
            for msg in grammar.waiting:
                out.append(Compiled(msg, grammar.text, None if error else start.deep_copy(), error))
            grammar.waiting = []
            self._forget_if_done(grammar_id, grammar)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def _result(grammar: _Grammar) -> tuple[object | None, str | None]:
        try:
            start = grammar.compiled.result()
        except Exception as e:
            return None, f"compiling the grammar failed: {e!r}"
        if start.is_error():
            return None, f"invalid grammar: {start.get_error().strip()[:500]}"
        return start, None

    def _forget_if_done(self, grammar_id: str, grammar: _Grammar) -> None:
        if grammar.released and not grammar.waiting:
            grammar.compiled.cancel()  # a compile nobody waits for any more: not started, not run
            if grammar.compiled.done():
                del self._grammars[grammar_id]
