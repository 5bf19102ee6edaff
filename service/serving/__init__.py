"""The serving loop: the engine driven from asyncio, outside the engine.

`loop.py` (`ServingLoop`) is what the servicer calls, in the engine's types;
`scheduler.py` batches every Propose's Step onto `engine.step`; `runner.py` is the
engine's worker thread. No wire message is read or written here, and the engine
knows nothing of this package.
"""
