"""Grammars compiled once and shared by every state that asks for them, each compilation
bounded in time.

A compilation runs on a worker thread: the caller waits at most `timeout` seconds, and a
grammar that takes longer is refused (GRAMMAR_COMPILE_TIMEOUT) while its compilation
goes on and lands in the cache, so that asking again later finds it. Two requests for
one grammar share one compilation. A grammar the compiler refuses is INVALID_ARGUMENT
with the compiler's own message; a refusal is not cached (the next request compiles it
again, and is refused again).
"""

from __future__ import annotations

import concurrent.futures
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from ..engine.errors import DeadlineExceeded, InvalidArgument
from .spec import KINDS, CompiledGrammar, GrammarSpec

if TYPE_CHECKING:
    import xgrammar

_FIELD = "grammar"


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer; keeps the last `capacity` compiled."""

    def __init__(
        self,
        tokenizer: xgrammar.TokenizerInfo,
        *,
        timeout: float,
        capacity: int = 256,
        threads: int = 2,
    ) -> None:
        import xgrammar

        # xgrammar's own cache is off: this one knows which compilations are under way.
        self._compiler = xgrammar.GrammarCompiler(
            tokenizer, max_threads=threads, cache_enabled=False
        )
        self.timeout = timeout
        self.capacity = capacity
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, "grammar-compile")
        self._lock = threading.Lock()
        self._compiled: OrderedDict[GrammarSpec, concurrent.futures.Future] = OrderedDict()
        self.compilations = 0  # grammars compiled (or tried), not served from the cache

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar, from the cache or compiled now (at most `timeout` s).

        Raises InvalidArgument (GRAMMAR_KIND, GRAMMAR_INVALID) or DeadlineExceeded
        (GRAMMAR_COMPILE_TIMEOUT), each naming the field `grammar`.
        """
        if spec.kind not in KINDS:
            raise InvalidArgument(
                f"grammar: kind {spec.kind!r} is none of {', '.join(KINDS)}",
                reason="GRAMMAR_KIND",
                field=_FIELD,
            )
        with self._lock:
            job = self._compiled.get(spec)
            if job is None:
                job = self._pool.submit(self._compile_now, spec)
                self._compiled[spec] = job
                self.compilations += 1
                while len(self._compiled) > self.capacity:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(spec)
        try:
            return job.result(timeout=self.timeout)
        except concurrent.futures.TimeoutError:
            raise DeadlineExceeded(
                f"grammar: its compilation took longer than {self.timeout:g} s (it goes on: "
                "the same grammar asked again once it is compiled is served from the cache)",
                reason="GRAMMAR_COMPILE_TIMEOUT",
                field=_FIELD,
            ) from None
        except (RuntimeError, ValueError, TypeError) as exc:
            with self._lock:
                if self._compiled.get(spec) is job:
                    del self._compiled[spec]
            raise InvalidArgument(
                f"grammar: the {spec.kind} does not compile: {_compiler_message(exc)}",
                reason="GRAMMAR_INVALID",
                field=_FIELD,
            ) from None

    def cached(self, spec: GrammarSpec) -> bool:
        """Whether `spec` is compiled (or compiling) in the cache."""
        with self._lock:
            return spec in self._compiled

    def _compile_now(self, spec: GrammarSpec) -> CompiledGrammar:
        c = self._compiler
        compile_kind = {
            "json_schema": c.compile_json_schema,
            "ebnf": c.compile_grammar,
            "regex": c.compile_regex,
            "structural_tag": c.compile_structural_tag,
        }[spec.kind]
        return CompiledGrammar(spec, compile_kind(spec.source))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _compiler_message(exc: BaseException) -> str:
    """xgrammar's message without what locates it in xgrammar's C++ (the time, the source
    line and the condition that failed)."""
    return _LOCATION.sub("", str(exc).strip())


# "[07:18:10] /project/cpp/grammar_parser.cc:820: " and "Check failed: (...) is false: "
_LOCATION = re.compile(r"^(\[[0-9:]+\] \S+\.cc:\d+: )?(Check failed: .*? is false: )?")
