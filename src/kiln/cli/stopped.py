"""The exception a signal to stop becomes in the CLI."""

from __future__ import annotations


class Stopped(BaseException):
    """SIGINT or SIGTERM. A BaseException of Kiln's own: the CLI framework turns a plain
    KeyboardInterrupt into its own "Aborted!" before Kiln could say anything, and SIGTERM's
    default action would skip every cleanup (a hidden temporary artifact left behind). Raised
    instead, it unwinds through the `finally` blocks that remove partial work. `said` is what
    the one line tells the user was kept."""

    def __init__(self, signum: int, said: str = "nothing was written.") -> None:
        super().__init__(signum)
        self.signum = signum
        self.said = said
