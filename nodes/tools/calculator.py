"""The `calculator` tool: arithmetic on numbers, parsed with `ast` and evaluated node by node (never
`eval`): + - * / // % ** and parentheses; big powers and results are refused."""

from __future__ import annotations

import ast
import operator

from siirl_dag.registry import tool

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT, MAX_MAGNITUDE, MAX_LENGTH = 64, 10**100, 200


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ValueError saying what is not allowed."""
    if len(expression) > MAX_LENGTH:
        raise ValueError(f"expression longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} above {MAX_EXPONENT}")
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        if isinstance(result, complex) or abs(result) > MAX_MAGNITUDE:
            raise ValueError("result out of range")
        return result
    raise ValueError(f"'{ast.unparse(node)}' is not allowed; expected numbers, + - * / // % ** and parentheses")


@tool("calculator", description="Evaluate an arithmetic expression, e.g. 123+456*2.",
      parameters={"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"],
                  "additionalProperties": False})
def calculator(expression: str) -> str:
    """The expression's value as text (an integral float without its .0)."""
    value = evaluate(expression)
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
