"""Errors a user can cause. The CLIs print their message as one line and exit with code 2."""


class UserError(Exception):
    """Bad options, paths or inputs: the message is one line meant for the user."""


def first_line(what: object) -> str:
    """The first line of an exception's (or any object's) text, for one-line messages."""
    lines = str(what).strip().splitlines()
    return lines[0] if lines else type(what).__name__
