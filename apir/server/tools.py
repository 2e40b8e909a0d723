"""Tool calling in llama.cpp's "generic" format, which works with any chat template.

The tools are described in a system message; the model answers with one JSON object,
``{"tool_call": {"name", "arguments"}}`` (``{"tool_calls": [...]}`` when parallel calls
are allowed) or ``{"response": "..."}``, and a JSON schema grammar holds it to exactly
that shape (only calls when ``tool_choice`` is "required" or names a function). Earlier
calls in the conversation are written back into assistant turns in the same JSON, so the
model sees its own format. The conversation is then rendered with the model's template.
"""

from __future__ import annotations

import json
import re
import secrets

from .schemas import Grammar, Tools


def _call_schema(tools: Tools) -> dict:
    wanted = tools.names if tools.choice in ("auto", "required") else (tools.choice,)
    one = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": f["function"]["name"]},
                           "arguments": f["function"].get("parameters") or {"type": "object"}}}
           for f in tools.functions if f["function"]["name"] in wanted]
    return one[0] if len(one) == 1 else {"anyOf": one}


def _answer_schema(tools: Tools) -> dict:
    call = _call_schema(tools)
    key, value = ("tool_calls", {"type": "array", "items": call, "minItems": 1}) if tools.parallel \
        else ("tool_call", call)
    calls = {"type": "object", "additionalProperties": False, "required": [key], "properties": {key: value}}
    if tools.choice != "auto":
        return calls
    reply = {"type": "object", "additionalProperties": False, "required": ["response"],
             "properties": {"response": {"type": "string"}}}
    return {"anyOf": [calls, reply]}


def grammar(tools: Tools) -> Grammar:
    """The constraint that holds the answer to the generic format."""
    return Grammar("json_schema", json.dumps(_answer_schema(tools)), "tools")


def messages(conversation: list[dict], tools: Tools) -> list[dict]:
    """``conversation`` with the tools described first and earlier calls written as JSON."""
    key = "tool_calls" if tools.parallel else "tool_call"
    what = ("either with `tool_call` (a request to call a tool) or with `response` (your "
            "reply to the user)") if tools.choice == "auto" else "with `tool_call` (a request to call a tool)"
    described = (f"You can call these tools:\n{json.dumps([f['function'] for f in tools.functions], indent=2)}"
                 f"\n\nRespond in JSON format, {what}.").replace("tool_call", key)
    out = list(conversation)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{described}"}
    else:
        out.insert(0, {"role": "system", "content": described})
    for i, m in enumerate(out):
        if m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in m["tool_calls"]]
            out[i] = {"role": "assistant",
                      "content": json.dumps({key: calls} if tools.parallel else {key: calls[0]})}
    return out


# the start of a reply in the generic format, {"response": "...
_REPLY = re.compile(r'\s*\{\s*"response"\s*:\s*"')


def parse(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls in OpenAI's shape) of an answer in the generic format. A reply
    cut short (max_tokens) comes back as the part of its "response" string that was
    written; other text that is not the format, as it is."""
    try:
        answer = json.loads(text)
    except ValueError:
        return _cut_reply(text), []
    if not isinstance(answer, dict):
        return text, []
    calls = answer.get("tool_calls") if "tool_calls" in answer else [answer.get("tool_call")]
    calls = [c for c in calls or () if isinstance(c, dict) and isinstance(c.get("name"), str)]
    if calls:
        return None, [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
                       "function": {"name": c["name"], "arguments": json.dumps(c.get("arguments", {}))}}
                      for c in calls]
    response = answer.get("response")
    return (response, []) if isinstance(response, str) else (text, [])


def _cut_reply(text: str) -> str:
    """The written part of a cut-short {"response": "... (its string decoded, a half
    escape or the closing quote dropped), or ``text`` when it is not one."""
    start = _REPLY.match(text)
    if start is None:
        return text
    body = text[start.end():]
    for end in range(len(body), max(len(body) - 7, -1), -1):  # \uXXXX is the longest escape
        try:
            return json.loads(f'"{body[:end]}"')
        except ValueError:
            continue
    return text
