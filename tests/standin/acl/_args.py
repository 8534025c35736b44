"""Argument checking the way the C wrapper's PyArg_ParseTuple does it.

The texts are the wrappers' own: "acl.<sub>.<name> args parse failed", with a "!" after it in acl.mdl
(hicann/runtime python/pyACL/mdl/mdl_wrap.cpp; rt/*.cpp and py_init_acl.cpp have none)."""

import functools


def checked(name: str, *types, optional: tuple = ()):
    """Wrong argument count or type -> TypeError('acl.<name> args parse failed'), as pyACL raises."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args):
            ok = len(types) <= len(args) <= len(types) + len(optional)
            spec = types + optional
            if ok:
                for value, kind in zip(args, spec):
                    if isinstance(value, bool) or not isinstance(value, kind):
                        ok = False
                        break
            if not ok:
                raise TypeError(f"acl.{name} args parse failed{'!' if name.startswith('mdl.') else ''}")
            return fn(*args)
        return inner
    return wrap
