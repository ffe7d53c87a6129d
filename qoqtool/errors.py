"""User-facing errors.

Anything the user can fix (a wrong path, an unknown recipe, bad data) raises `UserError`
with one line that names the problem and the fix. The CLI prints that line and exits 2;
anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's input: printed as one line, exit code 2."""

    exit_code = 2
