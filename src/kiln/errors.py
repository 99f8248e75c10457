"""The one exception type the user sees."""


class KilnError(Exception):
    """A problem with the user's input, reported as one line and exit code 2."""
