"""Model output text -> OpenAI tool calls, one incremental parser per choice.

A parser is fed the text deltas of one sample as the engine produces them (`feed`) and told when
the sample ends (`finish`); each call returns a `ParsedDelta`: content text that is settled, and
tool-call fragments. The non-streaming route feeds the same deltas and joins what comes back, so a
streamed message assembles to exactly the non-streamed one by construction: the result never
depends on how the text was split (tests/test_tool_parsers.py checks every split of its cases).

To keep that promise a parser never takes anything back. Text that may still turn out to be a
tool call (a partial `<tool_c`, a call whose JSON is not complete yet) is held back until it is
decided; a call is sent, id and name first, arguments next, only once its JSON parsed. Text that
looked like a call but does not parse (malformed JSON, a cut-off call) is content, as vLLM leaves
it. Arguments are the model's JSON re-serialized (`json.dumps`, non-ASCII kept), as vLLM sends them.

Parsers for "auto" (`--tool-call-parser`, vLLM's names):
    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>   Qwen2.5, Qwen3, Hermes
    llama3_json  {"name": ..., "parameters": {...}}; {...}  (optionally after <|python_tag|>)
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]  or  [TOOL_CALLS]name{...}
Parsers of forced output (tool_choice "required" / a named function; the grammar shapes it):
    RequiredParser   [{"name": ..., "parameters": {...}}, ...]   (vLLM's "required" format)
    NamedParser      the output is the arguments object itself
Content next to calls: whitespace between or around calls is dropped; other text stays content.
"""

from .auto import AUTO_PARSERS, HermesToolParser, Llama3JsonToolParser, MistralToolParser
from .base import ParsedDelta, ToolCallDelta, ToolParser, json_end, random_tool_call_id
from .forced import NamedParser, RequiredParser

__all__ = ["AUTO_PARSERS", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser", "NamedParser",
           "ParsedDelta", "RequiredParser", "ToolCallDelta", "ToolParser", "json_end", "random_tool_call_id"]
