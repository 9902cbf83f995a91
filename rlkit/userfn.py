"""Loading a user's function from "path/to/file.py:name" or "package.module:name" (reward functions, tools).

Its own module so that both the trainer (rlkit/rewards.py) and a sandbox worker (rlkit/sandbox.py) can use it
without importing each other.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from collections.abc import Callable
from pathlib import Path

from rlkit.errors import ConfigError, MissingFile

_SPEC_FORMAT = 'expected "path/to/file.py:function_name" (or "package.module:function_name")'


def load_function(spec: str) -> Callable:
    """Load a function from "path/to/file.py:function_name" or "package.module:function_name".

    Relative file paths are resolved against the current working directory. Errors say what is wrong
    and how to fix it: ValueError for a malformed spec, an unimportable module, a missing or
    non-callable attribute; FileNotFoundError (with the absolute path tried) for a missing file.
    """
    location, sep, name = str(spec).rpartition(":")
    if not sep or not location or not name:
        raise ConfigError(f"bad function spec {spec!r}: {_SPEC_FORMAT}")

    if location.endswith(".py") or "/" in location or "\\" in location:
        path = Path(location).expanduser().resolve()
        if not path.is_file():
            raise MissingFile(
                f"reward file not found: {path} (from {spec!r}); relative paths are resolved against the "
                f"current directory {Path.cwd()} - fix the path or pass an absolute one"
            )
        module_name = f"rlkit_custom_{re.sub(r'[^0-9a-zA-Z_]', '_', path.stem)}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module  # so dataclasses, pickle-by-reference etc. can find it
        try:
            module_spec.loader.exec_module(module)
        except BaseException as e:
            del sys.modules[module_name]
            if isinstance(e, KeyboardInterrupt):
                raise
            raise ConfigError(
                f"the reward file {path} (--reward.custom-fn {spec}) failed while importing: {type(e).__name__}: {e}; "
                "fix that file (its own imports and top-level code run when it loads)"
            ) from e
        where = str(path)
    else:
        try:
            module = importlib.import_module(location)
        except ModuleNotFoundError as e:
            if e.name is None or not (location == e.name or location.startswith(e.name + ".")):
                raise  # the module exists but one of its own imports is missing
            raise ConfigError(
                f'cannot import module {location!r} (from {spec!r}): install it, or give a file path instead: "path/to/file.py:{name}"'
            ) from e
        where = f"module {location}"

    if not hasattr(module, name):
        defined = sorted(
            k
            for k, v in vars(module).items()
            if callable(v) and not k.startswith("_") and getattr(v, "__module__", None) == module.__name__
        )
        raise ConfigError(
            f"{where} has no function {name!r}; it defines: {', '.join(defined) or '(no public functions)'} "
            f"- fix the name after the ':' in {spec!r}"
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise ConfigError(f"{name!r} in {where} is a {type(fn).__name__}, not a function; point {spec!r} at a function")
    return fn
