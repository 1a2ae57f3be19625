"""The one error type of the checkpoint package."""


class CheckpointError(ValueError):
    """A checkpoint file or index is malformed, or does not match the model. Names the file and key."""
