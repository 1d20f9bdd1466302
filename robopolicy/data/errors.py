"""The one error type of the data layer."""


class DatasetError(ValueError):
    """A dataset on disk is missing, corrupt or does not fit; the message names the file."""
