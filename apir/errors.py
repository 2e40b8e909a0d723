"""The root of apir's error hierarchy."""


class ApirError(Exception):
    """Base of every error apir reports to a user: one clear line, no traceback needed."""
