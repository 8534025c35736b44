"""Argument checking the way the C wrapper's PyArg_ParseTuple does it."""

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
                raise TypeError(f"acl.{name} args parse failed")
            return fn(*args)
        return inner
    return wrap
