"""``labelSelector`` and ``fieldSelector`` parsing, compiled to predicates over object dicts.

Informers and controllers lean on selectors to narrow lists and watches, so an unsupported
selector must fail loudly (400, like the real server) rather than silently match everything.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from .errors import bad_request
from .resources import ResourceType

Predicate = Callable[[dict[str, Any]], bool]

_KEY = r"[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?"
_SET_TERM = re.compile(rf"^\s*(?P<key>{_KEY})\s+(?P<op>in|notin)\s*\((?P<values>[^)]*)\)\s*$")
_VALUE = r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?"
_EQ_TERM = re.compile(rf"^\s*(?P<key>{_KEY})\s*(?P<op>==|=|!=)\s*(?P<value>{_VALUE})\s*$")
_EXISTS_TERM = re.compile(rf"^\s*(?P<neg>!?)\s*(?P<key>{_KEY})\s*$")


def match_all(_obj: dict[str, Any]) -> bool:
    return True


def _split_terms(selector: str) -> list[str]:
    """Split on commas that are not inside ``in (a,b)`` parentheses."""
    terms: list[str] = []
    depth = 0
    current = ""
    for char in selector:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    terms.append(current)
    return [term for term in terms if term.strip()]


def _labels(obj: dict[str, Any]) -> dict[str, str]:
    return (obj.get("metadata") or {}).get("labels") or {}


def _label_term(term: str) -> Predicate:
    if m := _SET_TERM.match(term):
        key = m["key"]
        values = {v.strip() for v in m["values"].split(",") if v.strip()}
        if not all(re.fullmatch(_VALUE, v) for v in values):
            raise bad_request(f"unable to parse requirement: invalid values in {term!r}")
        if m["op"] == "in":
            return lambda obj: _labels(obj).get(key) in values
        return lambda obj: _labels(obj).get(key) not in values
    if m := _EQ_TERM.match(term):
        key, value = m["key"], m["value"]
        if m["op"] == "!=":
            return lambda obj: _labels(obj).get(key) != value
        return lambda obj: _labels(obj).get(key) == value
    if m := _EXISTS_TERM.match(term):
        key = m["key"]
        if m["neg"]:
            return lambda obj: key not in _labels(obj)
        return lambda obj: key in _labels(obj)
    raise bad_request(f"unable to parse requirement: invalid label selector term {term!r}")


def parse_label_selector(selector: str | None) -> Predicate:
    """Compile a label selector (``a=b,c!=d,e,!f,g in (x,y),h notin (z)``)."""
    if not selector or not selector.strip():
        return match_all
    predicates = [_label_term(term) for term in _split_terms(selector)]
    return lambda obj: all(p(obj) for p in predicates)


def _field_value(obj: dict[str, Any], path: str) -> str:
    """Field selectors compare string forms; absent fields compare equal to ``""``."""
    current: Any = obj
    for part in path.split("."):
        if not isinstance(current, dict):
            return ""
        current = current.get(part)
    if current is None:
        return ""
    if isinstance(current, bool):
        return "true" if current else "false"
    return str(current)


def _field_term(path: str, value: str, *, negate: bool) -> Predicate:
    return lambda obj: (_field_value(obj, path) == value) != negate


def parse_field_selector(selector: str | None, rt: ResourceType) -> Predicate:
    """Compile a field selector, accepting only the fields the real server indexes for ``rt``."""
    if not selector or not selector.strip():
        return match_all
    allowed = {"metadata.name", *rt.field_labels}
    if rt.namespaced:
        allowed.add("metadata.namespace")
    predicates: list[Predicate] = []
    for term in _split_terms(selector):
        m = re.match(r"^\s*([A-Za-z0-9.]+)\s*(==|=|!=)\s*(.*?)\s*$", term)
        if not m:
            raise bad_request(f"invalid field selector term {term!r}")
        path, op, value = m.groups()
        if path not in allowed:
            raise bad_request(
                f"field label not supported: {path}"
                if rt.group == ""
                else f'"{path}" is not a known field selector: only "metadata.name", '
                '"metadata.namespace"'
            )
        predicates.append(_field_term(path, value, negate=op == "!="))
    return lambda obj: all(p(obj) for p in predicates)
