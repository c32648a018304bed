"""How a cache policy is spelled: "name:key=value,..." or {"policy": name, key: value}; None or "none" for none.

The eviction policies (kv/eviction.py) and the sparse attention policies (kv/sparse.py) are both dataclasses
whose fields are their options; parse_policy makes one from its spelling, or says what is wrong with it.
"""
from __future__ import annotations

import numbers
import re
from dataclasses import fields

MAX_OPTION = 2**31 - 1      # a budget, window or pool in tokens: more than any context


def policy_spec(policy) -> str:
    """A policy's spelling with every option: "name:key=value,..." (what parse_policy reads back)."""
    return f"{policy.name}:" + ",".join(f"{f.name}={getattr(policy, f.name)}" for f in fields(policy))


def parse_policy(spec, policies: dict[str, type], kind: str, form: str, base: type):
    """A policy of `policies` (name -> dataclass) from its spelling; `spec` itself where it is one already (an
    instance of `base`), None for None or "none". `kind` names the option in the messages ("eviction"), `form`
    shows its spelling.

    Anything else raises ValueError showing the form: an unknown name or option, an option value that is not a
    whole number (a float, a bool, NaN, inf) where one is needed, or one past MAX_OPTION."""
    if spec is None or isinstance(spec, base):
        return spec
    if isinstance(spec, dict):
        options = dict(spec)
        name = options.pop("policy", None)
    elif isinstance(spec, str):
        name, _, rest = spec.strip().partition(":")
        try:
            options = dict(item.split("=", 1) for item in rest.split(",") if item.strip())
        except ValueError:
            raise ValueError(f"malformed {kind} {spec!r}: {form}") from None
    else:
        raise ValueError(f"{kind} must be a string or a dict, got {type(spec).__name__}: {form}")
    if not isinstance(name, str):
        raise ValueError(f"{kind} policy must be a name (a string), got {type(name).__name__} {name!r}: {form}")
    if name == "none" and not options:
        return None
    policy = policies.get(name)
    if policy is None:
        raise ValueError(f"unknown {kind} policy {name!r}: {form}")
    if not all(isinstance(k, str) for k in options):
        raise ValueError(f"{kind} options are named by strings, got {list(options)!r}: {form}")
    known = {f.name: type(f.default) for f in fields(policy)}
    options = {k.strip(): v for k, v in options.items()}
    unknown = set(options) - set(known)
    if unknown:
        raise ValueError(f"{name} has no option {', '.join(sorted(unknown))} (it takes {', '.join(sorted(known))}): "
                         f"{form}")
    values = {k: _option_value(kind, name, k, v, known[k], spec, form) for k, v in options.items()}
    try:
        return policy(**values)
    except ValueError as e:
        raise ValueError(f"malformed {kind} {spec!r} ({e}): {form}") from None


def _option_value(kind: str, policy: str, key: str, value, of: type, spec, form: str) -> int | str:
    """An option's value as its field's type: an int from an int or a string of digits, at most MAX_OPTION;
    a str, stripped."""
    if of is int:
        if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or abs(value) > MAX_OPTION:
            raise ValueError(f"malformed {kind} {spec!r}: {policy}'s {key} must be a whole number "
                             f"up to {MAX_OPTION}, got {value!r}: {form}")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"malformed {kind} {spec!r}: {policy}'s {key} must be a string, got {value!r}: {form}")
    return value.strip()
