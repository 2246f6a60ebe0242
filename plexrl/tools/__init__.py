"""Tools the policy can call during agentic rollouts, and the sandbox that runs model-written code.

Built-ins: `calculator` (safe arithmetic by walking the AST) and `python` (code run in `Sandbox`). Users add
their own tools as "pkg.module:Factory" for `get_tool`. See docs/security.md for the sandbox's threat model.
"""

from plexrl.tools.base import Tool, ToolResult, ToolSpec
from plexrl.tools.calculator import Calculator
from plexrl.tools.python import PythonTool
from plexrl.tools.registry import get_tool
from plexrl.tools.sandbox import Sandbox, SandboxResult

__all__ = ["Calculator", "PythonTool", "Sandbox", "SandboxResult", "Tool", "ToolResult", "ToolSpec", "get_tool"]
