"""The error types of the data package, in their own module so that sources and partitions both
raise them without importing each other."""


class DataError(ValueError):
    """Bad input data (missing file or key, wrong shape, impossible split); the message names the culprit."""


class UnreadableImage(DataError):
    """An image file that cannot be decoded: a command may offer to leave such files out
    (fedper.data.skipping_unreadable_images) instead of stopping."""
