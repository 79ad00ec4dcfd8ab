"""The one error type of the data package, in its own module so that sources and partitions both
raise it without importing each other."""


class DataError(ValueError):
    """Bad input data (missing file or key, wrong shape, impossible split); the message names the culprit."""
