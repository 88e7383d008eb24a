"""The one error type of the data layer."""


class DataError(ValueError):
    """Input data cannot be used. The message names the file or folder at fault and says what to do."""
