"""Errors raised while loading a checkpoint."""


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be served: the message names the file or tensor."""
