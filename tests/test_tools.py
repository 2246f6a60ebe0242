"""Tool contract, get_tool, the calculator (safe AST arithmetic) and the python tool."""

from __future__ import annotations

import doctest
import operator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, ValidationError

import plexrl.tools.calculator as calculator_module
from plexrl.roles import declare
from plexrl.tools import Calculator, PythonTool, Sandbox, Tool, ToolResult, ToolSpec, get_tool
from plexrl.tools.sandbox import SandboxLimits


class EchoArguments(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str


class EchoTool:
    """A user's own tool, found by get_tool as 'test_tools:EchoTool'."""

    spec = ToolSpec(name="echo", description="Repeat the text.", arguments=EchoArguments)

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix
        self.episodes: set[str] = set()

    def create(self, episode_id: str) -> None:
        self.episodes.add(episode_id)

    def execute(self, episode_id: str, arguments: dict[str, Any]) -> ToolResult:
        return ToolResult(ok=True, output=self.prefix + str(arguments.get("text")), error=None, latency_s=0.0)

    def release(self, episode_id: str) -> None:
        self.episodes.discard(episode_id)


@declare("tool")
def make_echo(**params: Any) -> EchoTool:
    return EchoTool(**params)


NOT_A_TOOL = 3


def undeclared_factory() -> EchoTool:
    return EchoTool()


@declare("tool")
def not_a_tool_factory() -> object:
    return object()


def calc(expression: Any) -> ToolResult:
    return Calculator().execute("episode", {"expression": expression})


# ----------------------------------------------------------------------------------------------- get_tool


def test_get_tool_builds_the_builtins_and_user_tools() -> None:
    assert isinstance(get_tool("calculator"), Calculator)
    python = get_tool("python", timeout_s=2)
    assert isinstance(python, PythonTool) and python.sandbox.limits.timeout_s == 2
    for name in (f"{__name__}:EchoTool", f"{__name__}:make_echo"):
        tool = get_tool(name, prefix="> ")
        assert isinstance(tool, Tool)
        assert tool.execute("e", {"text": "hi"}).output == "> hi"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("shell", r"unknown tool 'shell': use a built-in tool \(calculator, python\) or a dotted path"),
        ("no_such_module_xyz:Tool", "cannot import module 'no_such_module_xyz'"),
        (f"{__name__}:Missing", "has no attribute 'Missing'"),
        (f"{__name__}:NOT_A_TOOL", "is not a declared tool"),
        (f"{__name__}:undeclared_factory", "is not a declared tool"),
        ("subprocess:Popen", "is not a declared tool"),
        ("plexrl.yamlio:load_yaml_file", "is not a declared tool"),
        (f"{__name__}:not_a_tool_factory", "returned object, which is not a Tool"),
    ],
)
def test_get_tool_refuses_unknown_names_clearly(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_tool(name)


def test_get_tool_refuses_bad_parameters() -> None:
    with pytest.raises(ValidationError, match="Extra inputs"):
        get_tool("python", walltime=3)
    with pytest.raises(ValueError, match="either a sandbox or limits"):
        PythonTool(Sandbox(), timeout_s=1)
    with pytest.raises(ValueError, match="either a sandbox or limits"):
        PythonTool(Sandbox(), strict=True)


def test_tool_spec_renders_a_function_calling_schema() -> None:
    schema = Calculator.spec.json_schema()
    assert schema["name"] == "calculator" and schema["description"].startswith("Evaluate")
    assert schema["parameters"]["required"] == ["expression"]
    assert schema["parameters"]["additionalProperties"] is False
    with pytest.raises(ValidationError, match="Extra inputs"):
        ToolSpec(name="x", description="y", arguments=EchoArguments, version=2)  # type: ignore[call-arg]


def test_lifecycle_is_create_execute_release() -> None:
    for tool in (Calculator(), PythonTool(), EchoTool()):
        tool.create("ep-1")
        tool.create("ep-1")  # idempotent
        tool.release("ep-1")
        tool.release("never-created")  # ignored


# ----------------------------------------------------------------------------------------------- calculator


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("1 + 2 * 3", "7"),
        ("(1 + 2) * 3", "9"),
        ("((2 + 3) * (4 - 1))", "15"),
        ("2 ** 100", "1267650600228229401496703205376"),
        ("2 ** -2", "0.25"),
        ("7 / 2", "3.5"),
        ("8 / 2", "4"),
        ("-7 // 2", "-4"),
        ("-7 % 3", "2"),
        ("1.5 * 4", "6.0"),
        ("--3", "3"),
        ("2 ^ 10", "1024"),
        ("10**20 + 1", "100000000000000000001"),
        ("(-8) ** 3", "-512"),
        ("(-1) ** 10**9", "1"),
        ("  12  ", "12"),
        ("1e3 + 0.5", "1000.5"),
    ],
)
def test_calculator_is_exact(expression: str, expected: str) -> None:
    result = calc(expression)
    assert result.ok and result.error is None, result.error
    assert result.output == expected


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("1.0 // 0.0", "division by zero"),
        ("0 ** -1", "zero cannot be raised to a negative power"),
        ("9 ** 9 ** 9", "exponent too large"),
        ("10.0 ** 400", "cannot compute"),
        ("(-8) ** 0.5", "fractional power"),
        ("2 ** 4000 * 2 ** 4000", "result too large"),
        ("__import__('os').system('id')", "unsupported syntax (Call)"),
        ("().__class__", "unsupported syntax (Attribute)"),
        ("x + 1", "unsupported syntax (Name)"),
        ("'a' * 3", "only numbers are allowed"),
        ("True + 1", "only numbers are allowed"),
        ("1 if 1 else 2", "unsupported syntax (IfExp)"),
        ("[1, 2]", "unsupported syntax (List)"),
        ("lambda: 1", "unsupported syntax (Lambda)"),
        ("1 << 1000", "unsupported syntax (BinOp)"),
        ("1 +", "not a valid arithmetic expression"),
        ("", "empty expression"),
        ("1" * 1001, "longer than 1000 characters"),
        ("(" * 300 + "1" + ")" * 300, "not a valid arithmetic expression"),
        ("-" * 500 + "1", "nested deeper"),
    ],
)
def test_calculator_refuses_with_a_clear_error(expression: str, error: str) -> None:
    result = calc(expression)
    assert not result.ok and result.output == ""
    assert result.error is not None and result.error.startswith("calculator: ")
    assert error in result.error


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        ({}, "expression: Field required"),
        ({"expression": 3}, "expression: Input should be a valid string"),
        ({"expression": "1", "extra": 1}, "extra: Extra inputs are not permitted"),
        ("1 + 1", "takes a JSON object of arguments, got str"),
        (None, "got NoneType"),
    ],
)
def test_bad_arguments_are_a_tool_error_not_an_exception(arguments: Any, error: str) -> None:
    result = Calculator().execute("episode", arguments)
    assert not result.ok and result.error is not None and error in result.error
    if isinstance(arguments, dict):
        assert result.error.startswith("invalid arguments for tool 'calculator'")
        assert result.error.endswith("expected fields: expression")
    python = PythonTool().execute("episode", arguments)
    assert not python.ok and python.error is not None and python.error.startswith(("invalid arguments", "tool"))


_ops = {"+": operator.add, "-": operator.sub, "*": operator.mul, "//": operator.floordiv, "%": operator.mod}


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.integers(-1000, 1000).map(str),
        lambda inner: st.tuples(inner, st.sampled_from(sorted(_ops)), inner).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        max_leaves=12,
    )
)
def test_calculator_agrees_with_python_on_integer_expressions(expression: str) -> None:
    try:
        expected: str | None = str(_reference(expression))
    except ZeroDivisionError:
        expected = None
    result = calc(expression)
    assert result.ok == (expected is not None)
    if expected is not None:
        assert result.output == expected


def _reference(expression: str) -> int:
    """Plain-Python reference for the property test (the calculator itself never uses eval)."""
    import ast

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Constant):
            return int(node.value)
        if isinstance(node, ast.UnaryOp):
            return -walk(node.operand)
        assert isinstance(node, ast.BinOp)
        symbol = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "//", ast.Mod: "%"}[type(node.op)]
        return int(_ops[symbol](walk(node.left), walk(node.right)))

    return walk(ast.parse(expression, mode="eval").body)


def test_calculator_module_has_no_eval_or_exec_and_its_doctests_pass() -> None:
    source = Path(calculator_module.__file__).read_text()
    assert "eval(" not in source.replace("_evaluate(", "").replace("evaluate(", "")
    assert "exec(" not in source
    assert doctest.testmod(calculator_module).failed == 0


# ----------------------------------------------------------------------------------------------- python tool


def test_python_tool_returns_stdout() -> None:
    tool = get_tool("python", timeout_s=5)
    tool.create("ep")
    result = tool.execute("ep", {"code": "import math\nprint(math.factorial(20))"})
    assert result.ok and result.output == "2432902008176640000\n" and result.error is None
    assert 0 < result.latency_s < 5
    tool.release("ep")


def test_python_tool_errors_carry_the_traceback_and_the_reason() -> None:
    tool = get_tool("python", timeout_s=5)
    result = tool.execute("ep", {"code": "print('partial')\n1 / 0"})
    assert not result.ok
    assert result.error == "python: the program exited with status 1: ZeroDivisionError: division by zero"
    assert result.output.startswith("partial\n") and "Traceback" in result.output


def test_python_tool_survives_hostile_code() -> None:
    tool = PythonTool(Sandbox(SandboxLimits(timeout_s=1.0, cpu_s=5, max_output_bytes=1000)))
    hang = tool.execute("ep", {"code": "while True: pass"})
    assert not hang.ok and hang.error is not None and "timed out" in hang.error
    flood = tool.execute("ep", {"code": "while True: print('y' * 100)"})
    assert not flood.ok and flood.output.endswith("[output truncated]") and len(flood.output) < 1100
    assert tool.execute("ep", {"code": "print('still fine')"}).output == "still fine\n"


def test_a_strict_python_tool_refuses_degraded_isolation() -> None:
    assert get_tool("python", strict=True).sandbox.strict and not get_tool("python").sandbox.strict
    degraded = PythonTool(Sandbox(SandboxLimits(timeout_s=5), namespaces=("mount", "pid"), strict=True))
    result = degraded.execute("ep", {"code": "print('ran')"})
    assert not result.ok and "ran" not in result.output
    assert result.error is not None and result.error.startswith("python: strict mode: refusing to run without")
