"""Strict JSON for request bodies: a depth limit, no NaN/Infinity, valid Unicode only.

Python's json module accepts what mlxq must refuse: NaN and Infinity (not JSON; stored, they make
later answers invalid JSON), lone surrogates such as "\\ud800" (not Unicode; they fail later, deep
in Redis or a tokenizer), and nesting deep enough to exhaust the interpreter's stack. Every view
parses bodies through `Blueprint`, whose argument parser uses `loads` below, so each of these is a
400 naming the field instead of a 500.
"""

from __future__ import annotations

import json
import math

import flask
import flask_smorest
from webargs import core
from webargs.flaskparser import FlaskParser
from werkzeug.datastructures import CombinedMultiDict

from web.errors import APIError

MAX_DEPTH = 32
"""Deepest nesting of arrays and objects accepted in a body (the API's own shapes use 5 at most)."""


class JSONRejected(ValueError):
    """A body that parses as Python's JSON but not as mlxq's; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _refuse_constant(name: str):
    raise JSONRejected(f"{name} is not valid JSON: send numbers only")


def loads(text: str | bytes):
    """Parse a JSON document, refusing NaN/Infinity, deep nesting and invalid Unicode."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise JSONRejected(f"the body is nested too deeply (at most {MAX_DEPTH} levels)") from None
    check(value)
    return value


def check(value) -> None:
    """Walk a parsed document iteratively; raise JSONRejected for deep nesting or a lone surrogate."""
    stack = [(value, (), 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item, path)
        elif isinstance(item, float) and not math.isfinite(item):  # 1e400 parses as inf
            raise JSONRejected("is a number out of range (JSON numbers must be finite)", _dotted(path))
        elif isinstance(item, (dict, list)):
            if depth >= MAX_DEPTH:
                raise JSONRejected(f"the body is nested too deeply (at most {MAX_DEPTH} levels)", _dotted(path))
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            for key, child in pairs:
                if isinstance(key, str):
                    _check_text(key, path)
                stack.append((child, (*path, key), depth + 1))


def _check_text(text: str, path: tuple) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise JSONRejected("contains a lone surrogate (such as \\ud800), which is not valid Unicode",
                           _dotted(path)) from None


def _dotted(path: tuple) -> str | None:
    return ".".join(str(part) for part in path) or None


class StrictParser(FlaskParser):
    """webargs' Flask parser with strict JSON, validation errors answered as 400 (not 422), and a
    `multipart` location: a form's fields and files in one schema (so OpenAPI documents one body)."""

    DEFAULT_VALIDATION_STATUS = 400
    __location_map__ = {**FlaskParser.__location_map__, "multipart": "load_multipart"}

    def load_multipart(self, req: flask.Request, schema):
        """A multipart form's text fields and file parts together."""
        return self._makeproxy(CombinedMultiDict([req.files, req.form]), schema)

    def _raw_load_json(self, req: flask.Request):
        if not core.is_json(req.mimetype):
            return core.missing
        data = req.get_data(cache=True)
        try:
            return loads(data)
        except JSONRejected as exc:
            where = f"Invalid value for '{exc.param}': " if exc.param else "Invalid JSON body: "
            raise APIError(400, where + str(exc), "invalid_value" if exc.param else "invalid_json",
                           exc.param) from None
        except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
            self._handle_invalid_json_error(exc, req)


class Blueprint(flask_smorest.Blueprint):
    """flask-smorest's Blueprint with mlxq's strict argument parser (every view uses this one)."""

    ARGUMENTS_PARSER = StrictParser()
    DEFAULT_LOCATION_CONTENT_TYPE_MAPPING = {**flask_smorest.Blueprint.DEFAULT_LOCATION_CONTENT_TYPE_MAPPING,
                                             "multipart": "multipart/form-data"}
