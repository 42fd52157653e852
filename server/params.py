"""Typed request-parameter tables: each parameter has one type; a lossless coercion is accepted, anything else refused.

Front-ends whose parameters arrive untyped or loosely typed (KServe's InferParameter oneof, later
JSON bodies) read them through a table here, so a `top_k` sent as a double, a string `"false"` for
a boolean or a NaN `k` is refused with INVALID_ARGUMENT naming the parameter and the type expected,
and never reaches the engine. Value ranges that depend on the model (k <= V, token ids < V) are
checked afterwards by logitserve.validate, the same for every front-end.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from logitserve.errors import InvalidRequest

_TYPE_NAMES = {int: "an integer", float: "a finite number", bool: "a boolean", str: "a string"}


@dataclass(frozen=True)
class Param:
    """One parameter: its type, its static bounds (inclusive; model-dependent ones are checked later), its choices."""

    name: str
    kind: type                            # int | float | bool | str
    doc: str
    lo: Optional[float] = None
    hi: Optional[float] = None
    choices: tuple[str, ...] = ()         # for str: the accepted values (case-insensitive), returned upper-case

    def expected(self) -> str:
        text = _TYPE_NAMES[self.kind]
        if self.choices:
            text += " (one of " + ", ".join(self.choices) + ")"
        if self.lo is not None and self.hi is not None:
            text += f" in [{self.lo:g}, {self.hi:g}]"
        elif self.lo is not None:
            text += f" >= {self.lo:g}"
        return text

    def coerce(self, value: Any, where: str):
        """`value` as this parameter's type, or InvalidRequest naming `where` and the type expected."""
        field = f"{where}{self.name}" if not where or where.endswith(".") else f"{where}[{self.name}]"

        def refuse(why: str):
            return InvalidRequest(field, f"{why}; expected {self.expected()}")

        if self.kind is bool:
            if not isinstance(value, bool):
                raise refuse(f"got {_describe(value)}")
            return value
        if self.kind is str:
            if not isinstance(value, str):
                raise refuse(f"got {_describe(value)}")
            if self.choices:
                if value.upper() not in self.choices:
                    raise refuse(f"got {_clip(value)!r}")
                return value.upper()
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise refuse(f"got {_describe(value)}")
        if self.kind is int:
            if isinstance(value, float):
                if not (math.isfinite(value) and value.is_integer()):
                    raise refuse(f"got {value!r}, not a whole number")
                value = int(value)
        else:
            value = float(value)
            if not math.isfinite(value):
                raise refuse(f"got {value!r}")
        if (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
            raise refuse(f"got {value!r}")
        return value


def _clip(text: str, n: int = 64) -> str:
    return text if len(text) <= n else text[:n] + "..."


def _describe(value: Any) -> str:
    if isinstance(value, str):
        return f"the string {_clip(value)!r}"
    if isinstance(value, bool):
        return f"the boolean {value}"
    if isinstance(value, float):
        return f"the number {value!r}"
    if isinstance(value, int):
        return f"the integer {value}"
    return type(value).__name__


class ParamTable:
    """The parameters one place of one front-end accepts."""

    def __init__(self, *params: Param):
        self.params = {p.name: p for p in params}

    def read(self, values: Mapping[str, Any], where: str = "parameters") -> dict[str, Any]:
        """Every given parameter, coerced; an unknown name is refused with the list of known ones. An empty
        `where` names fields bare (JSON bodies: `logprobs`), one ending in "." dotted (`sampling_params.top_k`),
        else as `where[name]`."""
        out = {}
        for name, value in values.items():
            p = self.params.get(name)
            if p is None:
                raise InvalidRequest(f"{where}[{_clip(name)}]", f"unknown parameter; known: {', '.join(self.params)}")
            out[name] = p.coerce(value, where)
        return out

    def describe(self) -> str:
        """`name:type` for each parameter, comma-separated (KServe ModelConfig's request_parameters)."""
        return ",".join(f"{p.name}:{p.kind.__name__}" for p in self.params.values())
