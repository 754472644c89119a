"""The one base class for mistakes a user can fix (a bad key, a missing file, a request that cannot fit).

The CLI prints such an error as one `error: ...` line and exits 2; anything else is a bug and keeps its traceback.
Raise a subclass (or `UserError` itself) with a message that names the key or file and says what to do.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem in what the user asked for, with a message that names it and the fix."""
