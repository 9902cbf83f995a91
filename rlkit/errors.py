"""Errors that are the user's to fix, and only those, end a run with one line.

`recipe.cli` prints a `UserError` as ``rlkit: error: <message>`` and exits with status 1; every other
exception keeps its traceback, because it is a bug (rlkit's, or a forked recipe's) and the traceback is
how it gets found. Each class also derives from the built-in exception it replaces, so
``except ValueError`` and ``pytest.raises(FileNotFoundError)`` keep working.

Raise one where the input is checked, with a message that names the flag or file and the fix.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem in what the user passed (a flag, a file, the data, the machine), explained with its fix."""


class ConfigError(UserError, ValueError):
    """A flag, a data file's content or a config value that cannot work."""


class MissingFile(UserError, FileNotFoundError):
    """A file or folder the user named does not exist or is not what it should be."""


class RunExists(UserError, FileExistsError):
    """Starting would overwrite an earlier run's output."""


class MissingPackage(UserError, ImportError):
    """An optional dependency is not installed (the message says how to install it)."""


class NonFinite(UserError, FloatingPointError):
    """Training produced a NaN/inf loss or gradient (the message says which flags help)."""


class RunFailed(UserError, RuntimeError):
    """The run cannot go on for a reason outside rlkit's own code: a reward function failed, a worker process died,
    the cluster lacks resources."""
