"""Errors a user can cause. The CLIs print their message as one line and exit with code 2."""


class UserError(Exception):
    """Bad options, paths or inputs: the message is one line meant for the user."""
