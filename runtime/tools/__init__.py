"""Tool calling: the tools a request offers, how the model's template writes a call, and
turning what the model wrote back into OpenAI `tool_calls`.

    tools = parse_tools(body["tools"])                     # definitions.py (400 on bad input)
    choice = parse_tool_choice(body.get("tool_choice"), tools)
    fmt = FORMATS.get("hermes")                            # format.py: the registry
    spec = fmt.grammar(tools, choice, parallel)           # required / named: enforced calls
    parser = fmt.parser(tools); parser.feed(text) ...     # content and calls, streamed
"""

from .definitions import ToolChoice, ToolDef, ToolError, parse_tool_choice, parse_tools  # noqa: F401
from .format import FORMATS, ToolCallFormat, pick_format  # noqa: F401
from . import hermes  # noqa: F401  (registers the format)
