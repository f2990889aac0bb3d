"""The test bed's one error."""


class TestBedError(RuntimeError):
    """The bed could not start, or could not clean up completely."""
