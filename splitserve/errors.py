"""Errors a caller can act on."""


class InvalidRequestError(ValueError):
    """One request was rejected; the engine and the other requests carry on."""
