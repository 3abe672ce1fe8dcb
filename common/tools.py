"""The bundled tools a model can call: a calculator, unit conversion, date arithmetic and a lookup in a bundled
table of chemical elements.

Each is a pure Python function behind a fixed registry (`BUNDLED`): a call names a tool of the registry and gives
JSON arguments, which are checked against the tool's parameters before the function runs. Nothing the model
writes is ever evaluated as code: the calculator parses its expression with `ast` and computes only numbers,
+ - * / // % ** and parentheses, with bounded sizes. A call that cannot run (unknown tool, missing or mistyped
argument, bad value) returns {"error": "..."} as its result, which goes back to the model like any other result,
the way OpenAI-style agents report failures; `run_tool` never raises for the model's input.

`tool_schemas()` gives the registry in OpenAI's function format, which is what the chat template renders inside
<tools></tools> and what the server's clients send.
"""
from __future__ import annotations

import ast
import datetime as dt
import json
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable

from .tool_calls import ToolCall


class ToolError(ValueError):
    """A call that cannot run; its message is returned to the model as the call's result."""


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, a one-line description, its parameters (name -> (JSON type,
    description, "" for none)) and the Python function, called with the arguments by keyword. Descriptions are
    kept short: every tool offered costs its signature's tokens in the prompt (about 60-110 with the shipped
    tokenizer)."""

    name: str
    description: str
    parameters: dict[str, tuple[str, str]]
    function: Callable[..., dict[str, Any]]

    def schema(self) -> dict[str, Any]:
        """OpenAI's {"type": "function", "function": {...}} description of the tool."""
        properties = {p: {"type": kind, **({"description": text} if text else {})}
                      for p, (kind, text) in self.parameters.items()}
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": {"type": "object", "properties": properties, "required": list(self.parameters)}}}


# ---------------------------------------------------------------------- calculator
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION = 200  # characters
MAX_MAGNITUDE = 1e15  # beyond, a result is refused rather than computed (a ** b can be huge)


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
            raise ToolError("exponent or base too large")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:  # float arithmetic past ~1.8e308 (1e6 ** 64)
            raise ToolError("result out of range") from None
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
            raise ToolError("result out of range")
        return value
    raise ToolError(f"unsupported in an expression: {ast.unparse(node) if isinstance(node, ast.expr) else node}")


def tidy(value: float) -> int | float:
    """A result as it is written back: an integer when it is one, else rounded to 2 decimals (a model copies
    it into its answer). Infinity and NaN are no results (JSON has no such numbers): ToolError."""
    if not math.isfinite(value):
        raise ToolError("result out of range")
    value = round(value, 2)
    return int(value) if float(value).is_integer() else value


def calculator(expression: str) -> dict[str, Any]:
    text = expression.replace("×", "*").replace("÷", "/").replace("^", "**")
    if len(text) > MAX_EXPRESSION:
        raise ToolError(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError):  # ValueError: a NUL byte, which the parser refuses outright
        raise ToolError(f"not an arithmetic expression: {expression!r}") from None
    return {"result": tidy(_evaluate(tree.body))}


# ---------------------------------------------------------------------- unit conversion
# Each unit's size in its dimension's base unit (metre, kilogram, litre); temperatures convert by formula.
UNITS: dict[str, tuple[str, float]] = {
    "m": ("length", 1.0), "km": ("length", 1000.0), "cm": ("length", 0.01), "mm": ("length", 0.001),
    "mi": ("length", 1609.344), "ft": ("length", 0.3048), "in": ("length", 0.0254), "yd": ("length", 0.9144),
    "kg": ("mass", 1.0), "g": ("mass", 0.001), "lb": ("mass", 0.45359237), "oz": ("mass", 0.028349523125),
    "l": ("volume", 1.0), "ml": ("volume", 0.001), "gal": ("volume", 3.785411784),
    "c": ("temperature", 1.0), "f": ("temperature", 1.0), "k": ("temperature", 1.0),
}
_TO_KELVIN = {"c": lambda t: t + 273.15, "f": lambda t: (t - 32) * 5 / 9 + 273.15, "k": lambda t: t}
_FROM_KELVIN = {"c": lambda t: t - 273.15, "f": lambda t: (t - 273.15) * 9 / 5 + 32, "k": lambda t: t}


def convert_units(value: float, from_unit: str, to_unit: str) -> dict[str, Any]:
    units = {}
    for role, unit in (("from_unit", from_unit), ("to_unit", to_unit)):
        units[role] = unit.strip().lower().removeprefix("°")
        if units[role] not in UNITS:
            raise ToolError(f"unknown unit {unit!r} ({role}); known: {', '.join(UNITS)}")
    src, dst = units["from_unit"], units["to_unit"]
    if UNITS[src][0] != UNITS[dst][0]:
        raise ToolError(f"cannot convert {UNITS[src][0]} ({src}) to {UNITS[dst][0]} ({dst})")
    if UNITS[src][0] == "temperature":
        result = _FROM_KELVIN[dst](_TO_KELVIN[src](value))
    else:
        result = value * UNITS[src][1] / UNITS[dst][1]
    return {"result": tidy(result), "unit": dst}


# ---------------------------------------------------------------------- dates
def _date(text: str, name: str) -> dt.date:
    try:
        return dt.date.fromisoformat(text.strip())
    except ValueError:
        raise ToolError(f"{name} must be a date as YYYY-MM-DD, got {text!r}") from None


def add_days(date: str, days: int) -> dict[str, Any]:
    try:
        result = _date(date, "date") + dt.timedelta(days=days)
    except OverflowError:
        raise ToolError("date out of range") from None
    return {"date": result.isoformat(), "weekday": result.strftime("%A")}


def days_between(start: str, end: str) -> dict[str, Any]:
    return {"days": (_date(end, "end") - _date(start, "start")).days}


# ---------------------------------------------------------------------- the element table
# (atomic number, symbol, English name, Chinese name): the first 30 elements and ten well-known heavier ones.
ELEMENTS = (
    (1, "H", "hydrogen", "氢"), (2, "He", "helium", "氦"), (3, "Li", "lithium", "锂"), (4, "Be", "beryllium", "铍"),
    (5, "B", "boron", "硼"), (6, "C", "carbon", "碳"), (7, "N", "nitrogen", "氮"), (8, "O", "oxygen", "氧"),
    (9, "F", "fluorine", "氟"), (10, "Ne", "neon", "氖"), (11, "Na", "sodium", "钠"), (12, "Mg", "magnesium", "镁"),
    (13, "Al", "aluminium", "铝"), (14, "Si", "silicon", "硅"), (15, "P", "phosphorus", "磷"),
    (16, "S", "sulfur", "硫"), (17, "Cl", "chlorine", "氯"), (18, "Ar", "argon", "氩"), (19, "K", "potassium", "钾"),
    (20, "Ca", "calcium", "钙"), (21, "Sc", "scandium", "钪"), (22, "Ti", "titanium", "钛"),
    (23, "V", "vanadium", "钒"), (24, "Cr", "chromium", "铬"), (25, "Mn", "manganese", "锰"), (26, "Fe", "iron", "铁"),
    (27, "Co", "cobalt", "钴"), (28, "Ni", "nickel", "镍"), (29, "Cu", "copper", "铜"), (30, "Zn", "zinc", "锌"),
    (35, "Br", "bromine", "溴"), (47, "Ag", "silver", "银"), (50, "Sn", "tin", "锡"), (53, "I", "iodine", "碘"),
    (74, "W", "tungsten", "钨"), (78, "Pt", "platinum", "铂"), (79, "Au", "gold", "金"), (80, "Hg", "mercury", "汞"),
    (82, "Pb", "lead", "铅"), (92, "U", "uranium", "铀"),
)
_BY_NAME = {key: row for row in ELEMENTS for key in (row[1].lower(), row[2], row[3])}


def lookup_element(name: str) -> dict[str, Any]:
    row = _BY_NAME.get(name.strip().lower()) or _BY_NAME.get(name.strip().lower().removesuffix("元素"))
    if row is None:
        raise ToolError(f"no element named {name!r} in the table")
    number, symbol, english, chinese = row
    return {"name": english, "name_zh": chinese, "symbol": symbol, "atomic_number": number}


# ---------------------------------------------------------------------- the registry
BUNDLED: dict[str, Tool] = {tool.name: tool for tool in (
    Tool("calculator", "Evaluate arithmetic", {"expression": ("string", "")}, calculator),
    Tool("convert_units", "Convert length, mass, volume or temperature",
         {"value": ("number", ""), "from_unit": ("string", "e.g. km"), "to_unit": ("string", "")}, convert_units),
    Tool("add_days", "Date some days later", {"date": ("string", "YYYY-MM-DD"), "days": ("integer", "")}, add_days),
    Tool("days_between", "Days between dates", {"start": ("string", "YYYY-MM-DD"), "end": ("string", "")},
         days_between),
    Tool("lookup_element", "Chemical element facts", {"name": ("string", "")}, lookup_element),
)}

_JSON_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "number": (int, float), "integer": (int,)}


def tool_schemas(names: list[str] | None = None, registry: dict[str, Tool] = BUNDLED) -> list[dict[str, Any]]:
    """The tools (all, or those named, in that order) in OpenAI's function format."""
    return [registry[name].schema() for name in (names or list(registry))]


def check_arguments(tool: Tool, arguments: dict[str, Any]) -> dict[str, Any]:
    """The arguments a tool is called with, checked against its parameters (every one given, of its type, no
    others); ToolError saying which is wrong."""
    missing = [p for p in tool.parameters if p not in arguments]
    unknown = [a for a in arguments if a not in tool.parameters]
    if missing or unknown:
        raise ToolError(f"{tool.name} takes {', '.join(tool.parameters)}"
                        + (f"; missing {', '.join(missing)}" if missing else "")
                        + (f"; unknown {', '.join(unknown)}" if unknown else ""))
    for param, (kind, _) in tool.parameters.items():
        value = arguments[param]
        if isinstance(value, float) and kind == "integer" and value.is_integer():
            value = arguments[param] = int(value)
        if isinstance(value, bool) or not isinstance(value, _JSON_TYPES[kind]) or (
                isinstance(value, float) and not math.isfinite(value)):
            raise ToolError(f"{tool.name}: {param} must be a{'n' if kind[0] == 'i' else ''} {kind}, "
                            f"got {json.dumps(value, ensure_ascii=False)}")
    return arguments


def run_tool(call: ToolCall, registry: dict[str, Tool] = BUNDLED) -> str:
    """Run one call; its result (or {"error": ...}) as the JSON text the model reads back."""
    tool = registry.get(call.name)
    try:
        if tool is None:
            raise ToolError(f"unknown tool {call.name!r}; available: {', '.join(registry)}")
        result = tool.function(**check_arguments(tool, dict(call.arguments)))
    except ToolError as e:
        result = {"error": str(e)}
    except Exception as e:  # noqa: BLE001 -- a tool's own fault on the model's input is that call's error, never
        # an escape that would end a rollout batch (and the training step around it)
        result = {"error": f"{call.name} failed: {type(e).__name__}: {e}"}
    return json.dumps(result, ensure_ascii=False, allow_nan=False)
