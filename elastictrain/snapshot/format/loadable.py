"""What ``torch.load(weights_only=True)`` will accept, checked when state is staged.

A value the restricted unpickler refuses (a numpy scalar, a ``pathlib.Path``, a
dataclass) would otherwise commit without complaint and make every later
restore fail. Staging already visits every node of the state, so the check
costs one type lookup per non-tensor leaf and dict key, never a byte copy.

The accepted set mirrors ``torch._weights_only_unpickler``: plain containers
and primitives, dtypes, devices and layouts, plus every type registered with
``torch.serialization.add_safe_globals`` (whose attributes are checked too).
Tensors and the containers staging rebuilds (dict, list, tuple) are handled by
the staging walk itself.
"""

from __future__ import annotations

from typing import Any

import torch

from elastictrain.core.errors import UnsafeStateError

# Leaf types the weights-only unpickler rebuilds without any registration.
_PRIMITIVES: frozenset[type] = frozenset({
    type(None), bool, int, float, complex, str, bytes, bytearray,
    torch.dtype, torch.device, torch.layout,
})
# Dict keys are pickled too: the hashable primitives (tuples of them are checked item by item).
_KEYS: frozenset[type] = frozenset({type(None), bool, int, float, complex, str, bytes,
                                    torch.dtype, torch.device, torch.layout})


# Globals a pickle can name to run code or reach the system when called: a snapshot that
# names one was written by something other than elastictrain (tampered with), and no
# error may advise allowlisting it. By module (the first dotted part), plus exact prefixes.
# Pickle protocol 2 writes Python 2 names (subprocess.call is "commands.call"), and torch
# names a builtin without its module ("eval"): a bare name is a builtin, and every builtin
# a snapshot can hold (containers, numbers) loads already.
_CODE_MODULES: frozenset[str] = frozenset({
    "os", "posix", "nt", "subprocess", "_posixsubprocess", "commands", "popen2", "sys",
    "builtins", "__builtin__", "_operator", "_functools", "_thread", "thread",
    "importlib", "runpy", "pty", "shutil", "socket", "ctypes", "code", "codeop", "pickle",
    "_pickle", "marshal", "operator", "functools", "types", "inspect", "io", "_io",
    "webbrowser", "multiprocessing", "asyncio", "threading", "signal", "pdb", "timeit",
    "platform", "gc", "tempfile", "pathlib", "glob", "zipimport", "pydoc", "numpy.testing",
})
_CODE_PREFIXES = ("torch.hub.", "torch.package.", "torch.ops.", "torch._ops.", "torch.jit.",
                  "torch._C.", "torch.load", "torch.serialization.", "torch.utils.cpp_extension.",
                  "numpy.ctypeslib.", "numpy.f2py.", "numpy.distutils.")


def runs_code(qualified_name: str) -> bool:
    """Whether a pickle global such as ``posix.system`` (``module.attribute``) can run
    code or touch the system when called: never a type to allowlist."""
    module, dot, _ = qualified_name.partition(".")
    return not dot or module in _CODE_MODULES or qualified_name.startswith(_CODE_PREFIXES)


def registered_types() -> frozenset[type]:
    """Types the user allowed with ``torch.serialization.add_safe_globals``."""
    found: set[type] = set()
    for entry in torch.serialization.get_safe_globals():
        obj = entry[0] if isinstance(entry, tuple) else entry
        if isinstance(obj, type):
            found.add(obj)
    return frozenset(found)


def check_leaf(value: Any, path: tuple[Any, ...], registered: frozenset[type]) -> None:
    """Raise UnsafeStateError unless ``value`` (a non-tensor, non-container leaf at
    ``path``) loads under ``weights_only=True``."""
    kind = type(value)
    if kind in _PRIMITIVES:
        return
    if kind is set:
        for item in value:
            check_leaf(item, (*path, "<set item>"), registered)
        return
    if kind in registered:
        for name, attr in getattr(value, "__dict__", {}).items():
            _check_nested(attr, (*path, name), registered)
        return
    raise _unsafe(f"value {format_path(path)}", kind)


def check_key(key: Any, path: tuple[Any, ...]) -> None:
    """Raise UnsafeStateError unless dict key ``key`` (under ``path``) loads back."""
    if type(key) is tuple:
        for item in key:
            check_key(item, path)
    elif type(key) not in _KEYS:
        raise _unsafe(f"dict key under {format_path(path)}", type(key))


def _check_nested(value: Any, path: tuple[Any, ...], registered: frozenset[type]) -> None:
    """A registered object's attributes: any nesting, tensors allowed."""
    if isinstance(value, torch.Tensor):
        return
    if type(value) in (dict, list, tuple):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            if isinstance(value, dict):
                check_key(k, path)
            _check_nested(v, (*path, k), registered)
        return
    check_leaf(value, path, registered)


def format_path(path: tuple[Any, ...]) -> str:
    """``('extras', 'best')`` → ``extras['best']``; ``('optimizer', 'state', 3)`` →
    ``optimizer['state'][3]``."""
    if not path:
        return "<state>"
    head, *rest = path
    return str(head) + "".join(f"[{p!r}]" for p in rest)


def _unsafe(where: str, kind: type) -> UnsafeStateError:
    name = (kind.__qualname__ if kind.__module__ == "builtins"
            else f"{kind.__module__}.{kind.__qualname__}")
    return UnsafeStateError(
        f"snapshot state {where} is a {name}, which "
        "torch.load(weights_only=True) refuses, so the snapshot could never be restored; "
        "fix: convert it to a tensor / int / float / str / list / dict, or register the "
        "type with torch.serialization.add_safe_globals"
    )

