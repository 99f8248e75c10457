"""The one exception type the user sees, and the small words of Kiln's messages."""


class KilnError(Exception):
    """A problem with the user's input, reported as one line and exit code 2."""


class ModelError(KilnError):
    """A model file Kiln refuses: what is wrong (`problem`, naming the file) and what to do
    (`fix`), kept apart so that a caller who knows better gives its own fix: an artifact's
    damaged model is rebuilt, not re-exported."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(f"{problem} {fix}")
        self.problem = problem
        self.fix = fix


def a_type(value: object) -> str:
    """'a list', 'an OrderedDict': the value's type with its article, for messages."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def counted(count: int, noun: str) -> str:
    """'1 thread', '2 threads': a count with its noun, plural where it is not one."""
    return f"{count} {noun}{'s' * (count != 1)}"
