"""What clients expect of `apir serve` beyond plain chat: every request field implemented or
refused, sampling knobs applied on the backend (logit_bias, penalties, logprobs), output
constrained by llguidance (JSON schemas, grammars, tools), embeddings, tokenize, the
Ollama API, and the client libraries (openai, LangChain, litellm) that use them.

Engine checks run in process on SmolLM2 (local, and remote through a real host daemon);
client checks run against one real server process.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("llguidance")

from apir.backends.base import ExecutorConfig  # noqa: E402
from apir.backends.local import LocalBackend  # noqa: E402
from apir.engine import SamplingParams, load  # noqa: E402
from apir.models.errors import ModelNotFoundError  # noqa: E402
from apir.models.resolve import resolve_model  # noqa: E402
from apir.server.schemas import RequestError, parse_chat, parse_completion  # noqa: E402

MODEL = "smollm2-135m"
MSGS = [{"role": "user", "content": "hi"}]

# ---------------------------------------------------------------- the field rule
# Every field of OpenAI's chat completions reference, with a value and what apir makes of
# it: a check on the parsed request, or None where it must be a 400 naming the field.
CHAT_FIELDS = {
    "model": ("m", lambda r: r.model == "m"),
    "frequency_penalty": (0.5, lambda r: r.sampling.frequency_penalty == 0.5),
    "presence_penalty": (-0.5, lambda r: r.sampling.presence_penalty == -0.5),
    "logit_bias": ({"42": -100}, lambda r: r.sampling.logit_bias == ((42, -100.0),)),
    "logprobs": (True, lambda r: r.sampling.logprobs == 0),
    "max_completion_tokens": (7, lambda r: r.sampling.max_tokens == 7),
    "max_tokens": (8, lambda r: r.sampling.max_tokens == 8),
    "n": (1, lambda r: True),
    "response_format": ({"type": "json_object"}, lambda r: r.sampling.grammar.kind == "json_schema"),
    "seed": (3, lambda r: r.sampling.seed == 3),
    "stop": (["x"], lambda r: r.sampling.stop == ("x",)),
    "stream": (True, lambda r: r.stream),
    "stream_options": ({"include_usage": True}, lambda r: r.include_usage),
    "temperature": (0.5, lambda r: r.sampling.temperature == 0.5),
    "top_p": (0.5, lambda r: r.sampling.top_p == 0.5),
    "tools": ([{"type": "function", "function": {"name": "f"}}], lambda r: r.tools.names == ("f",)),
    "tool_choice": ("none", lambda r: r.tools is None),
    "parallel_tool_calls": (False, lambda r: True),
    "modalities": (["text"], lambda r: True),
    "store": (False, lambda r: True),
    "user": ("u", lambda r: True),  # informational
    "metadata": ({"k": "v"}, lambda r: True),  # informational
    "safety_identifier": ("s", lambda r: True),  # informational
    "prompt_cache_key": ("k", lambda r: True),  # informational
    "audio": ({"voice": "alloy", "format": "mp3"}, None),
    "function_call": ("auto", None),
    "functions": ([{"name": "f"}], None),
    "prediction": ({"type": "content", "content": "x"}, None),
    "reasoning_effort": ("low", None),
    "service_tier": ("auto", None),
    "verbosity": ("low", None),
    "web_search_options": ({}, None),
    "top_logprobs": (2, None),  # without logprobs: true
}
COMPLETION_FIELDS = {
    "model": ("m", lambda r: r.model == "m"),
    "best_of": (1, lambda r: True),
    "echo": (False, lambda r: True),
    "frequency_penalty": (1.0, lambda r: r.sampling.frequency_penalty == 1.0),
    "logit_bias": ({"7": 5}, lambda r: r.sampling.logit_bias == ((7, 5.0),)),
    "logprobs": (3, lambda r: r.sampling.logprobs == 3),
    "max_tokens": (4, lambda r: r.sampling.max_tokens == 4),
    "n": (1, lambda r: True),
    "presence_penalty": (1.0, lambda r: r.sampling.presence_penalty == 1.0),
    "seed": (1, lambda r: r.sampling.seed == 1),
    "stop": ("\n", lambda r: r.sampling.stop == ("\n",)),
    "stream": (False, lambda r: not r.stream),
    "stream_options": ({"include_usage": False}, lambda r: not r.include_usage),
    "suffix": ("", lambda r: True),
    "temperature": (0.0, lambda r: r.sampling.temperature == 0.0),
    "top_p": (0.9, lambda r: r.sampling.top_p == 0.9),
    "user": ("u", lambda r: True),
}
REFUSED_VALUES = [  # fields apir knows, with values it cannot honour
    ("chat", "n", 2), ("chat", "store", True), ("chat", "modalities", ["text", "audio"]),
    ("chat", "stream_options", {"include_obfuscation": True}), ("completion", "n", 3),
    ("completion", "best_of", 2), ("completion", "echo", True), ("completion", "suffix", "x"),
    ("chat", "logit_bias", {"a": 1}), ("chat", "logit_bias", {"1": -101}),
    ("chat", "response_format", {"type": "yaml"}), ("chat", "tool_choice", "required"),
    ("chat", "guided_choice", []), ("completion", "logprobs", 21),
]


def test_a_tool_reply_cut_short_is_its_written_text():
    """A generic-format reply that max_tokens cut inside its "response" string comes back
    as the text written so far, escapes decoded; other text as it is."""
    from apir.server.tools import parse

    assert parse('{"response": "Paris, Fr') == ("Paris, Fr", [])
    assert parse('{"response": "a\\nb\\u00') == ("a\nb", [])  # a half escape dropped
    assert parse('{"response": "done"') == ("done", [])
    assert parse('{"response": "done"}') == ("done", [])
    assert parse('{"tool_call": {"name"') == ('{"tool_call": {"name"', [])
    assert parse("plain") == ("plain", [])
    (call,) = parse('{"tool_call": {"name": "f", "arguments": {"x": 1}}}')[1]
    assert call["function"] == {"name": "f", "arguments": '{"x": 1}'}


@pytest.mark.parametrize("field", CHAT_FIELDS)
def test_every_chat_field_is_implemented_or_refused(field):
    value, check = CHAT_FIELDS[field]
    body = {"messages": MSGS, field: value}
    if check is None:
        with pytest.raises(RequestError) as e:
            parse_chat(body)
        assert (e.value.status, e.value.param) == (400, field) and field in e.value.message
    else:
        assert check(parse_chat(body))


@pytest.mark.parametrize("field", COMPLETION_FIELDS)
def test_every_completion_field_is_implemented_or_refused(field):
    value, check = COMPLETION_FIELDS[field]
    assert check(parse_completion({"prompt": "x", field: value}))


def test_unknown_fields_and_unhonoured_values_are_400s():
    for parse, body in ((parse_chat, {"messages": MSGS}), (parse_completion, {"prompt": "x"})):
        for name in ("frobnicate", "grammar_x", "echo_"):
            with pytest.raises(RequestError) as e:
                parse({**body, name: 1})
            assert e.value.param == name and "not supported" in e.value.message
    for kind, field, value in REFUSED_VALUES:
        parse, body = (parse_chat, {"messages": MSGS}) if kind == "chat" else (parse_completion, {"prompt": "x"})
        with pytest.raises(RequestError) as e:
            parse({**body, field: value})
        assert (e.value.status, e.value.param) == (400, field), (field, value)


def test_constraint_fields():
    g = parse_chat({"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "integer"}}}}).sampling.grammar
    assert (g.kind, json.loads(g.text)) == ("json_schema", {"type": "integer"})
    for field, value, kind in (("grammar", 'root ::= "a"', "gbnf"), ("guided_regex", "a+", "regex"),
                               ("guided_choice", ["a", "b"], "choice"), ("guided_json", {"type": "string"}, "json_schema"),
                               ("json_schema", {"type": "string"}, "json_schema")):
        g = parse_completion({"prompt": "x", field: value}).sampling.grammar
        assert (g.kind, g.param) == (kind, field)
    with pytest.raises(RequestError, match="both constrain"):
        parse_chat({"messages": MSGS, "grammar": "root ::= \"a\"", "guided_regex": "a"})
    r = parse_chat({"messages": MSGS, "repetition_penalty": 1.3, "repeat_last_n": 8, "top_k": 2})
    assert (r.sampling.repeat_penalty, r.sampling.penalty_last_n, r.sampling.top_k) == (1.3, 8, 2)
    assert parse_completion({"prompt": "x", "repeat_last_n": -1}).sampling.penalty_last_n == 1 << 31
    assert parse_completion({"prompt": "x"}).sampling.penalty_last_n == 64


def test_model_names_aliases_and_any():
    """An alias is the model (503 while loading, not 404); any name with any_model_name."""
    from starlette.testclient import TestClient

    from apir.flags import RunConfig
    from apir.server.app import ServeConfig, create_app

    def no_model():
        raise RuntimeError("not loaded here")

    def status(config, name):
        app = create_app(config, loader=no_model)
        with TestClient(app, raise_server_exceptions=False) as tc:
            return tc.post("/v1/completions", json={"model": name, "prompt": "x"}).status_code

    config = ServeConfig(RunConfig(model="tiny"), aliases=("smol",))
    assert [status(config, n) for n in ("tiny", "smol", "other")] == [503, 503, 404]
    assert status(ServeConfig(RunConfig(model="tiny"), any_model_name=True), "other") == 503


# ---------------------------------------------------------------- the engine, in process
@pytest.fixture(scope="module")
def smol():
    try:
        resolve_model(MODEL)
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    with load(MODEL, backend="local", device="cpu", n_ctx=512) as model:
        yield model


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_logprobs_are_the_log_softmax_of_the_logits():
    # every product in f32: by default a CPU computes SmolLM2's Q4_1 weights with bf16
    # activations, and a decode step's logprobs then differ from a whole-prompt pass's by
    # up to ~3e-2 (ExecutorConfig.cpu_int4)
    try:
        resolve_model(MODEL)
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    with load(MODEL, backend=LocalBackend("cpu", config=ExecutorConfig(cpu_int4=False)), n_ctx=512) as smol:
        _check_logprobs(smol)


def _check_logprobs(smol) -> None:
    ids = smol.tokenize("The capital of France is")
    tokens = list(smol.generate_tokens(ids, SamplingParams(temperature=0, max_tokens=4, logprobs=3)))
    want = _log_softmax(smol.logits(ids + [t.id for t in tokens[:-1]]))[len(ids) - 1:]
    for row, t in zip(want, tokens):
        assert t.id == int(row.argmax()) == t.top[0][0]
        np.testing.assert_allclose(t.logprob, row[t.id], atol=2e-3)
        assert [i for i, _ in t.top] == list(np.argsort(-row, kind="stable")[:3])
        np.testing.assert_allclose([lp for _, lp in t.top], row[[i for i, _ in t.top]], atol=2e-3)


def test_logit_bias_removes_a_token_and_penalties_change_repetition(smol):
    ids = smol.tokenize("The capital of France is")
    paris = smol.tokenize(" Paris", add_bos=False)[0]
    greedy = list(smol.generate_ids(ids, SamplingParams(temperature=0, max_tokens=6)))
    assert greedy[0] == paris
    banned = list(smol.generate_ids(ids, SamplingParams(temperature=0, max_tokens=6, logit_bias=((paris, -100.0),))))
    assert paris not in banned and banned != greedy
    boosted = list(smol.generate_ids(ids, SamplingParams(temperature=0, max_tokens=2, logit_bias=((42, 100.0),))))
    assert boosted == [42, 42]
    rep = smol.tokenize("one two one two one two one two one two")
    plain = smol.generate(rep, temperature=0, max_tokens=10)
    outs = {plain}
    for kw in ({"repeat_penalty": 1.5}, {"frequency_penalty": 1.0}, {"presence_penalty": 1.5}):
        outs.add(smol.generate(rep, temperature=0, max_tokens=10, **kw))
    assert len(outs) == 4, outs  # each penalty changes the answer
    assert plain.count("two") > smol.generate(rep, temperature=0, max_tokens=10, repeat_penalty=1.5).count("two")


CONSTRAINTS = [
    ("json_schema", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
                                "required": ["n", "ok"], "additionalProperties": False})),
    ("gbnf", 'root ::= "The answer is " ("yes" | "no") "."'),
    ("gbnf", 'start: "The answer is " ("yes" | "no") "."'),  # Lark, through the same field
    # a bounded word: an unbounded [a-z]+ lets a model spell past max_tokens (SmolLM2 did
    # with its products in bf16, APIR_CPU_INT4=1), and then no output could match
    ("regex", r"[A-Z][a-z]{1,12} [0-9]{2}"),
    ("choice", json.dumps(["red", "green", "blue"])),
]


def _constrained(model, kind, text, temperature):
    ids = model.chat_ids([{"role": "user", "content": "Answer briefly."}])
    params = SamplingParams(temperature=temperature, seed=5, max_tokens=40)
    return [t.id for t in model.generate_tokens(ids, params, model.constraint(kind, text))]


@pytest.fixture(scope="module")
def remote_smol(smol, backend_options):
    with load(MODEL, n_ctx=512, **backend_options["remote-unix"]) as model:
        yield model


@pytest.mark.parametrize(("kind", "text"), CONSTRAINTS,
                         ids=["json_schema", "gbnf", "lark", "regex", "choice"])
def test_constrained_output_matches_and_remote_equals_native(smol, remote_smol, kind, text):
    import re

    out = {}
    for temperature in (0.0, 0.9):
        out[temperature] = _constrained(smol, kind, text, temperature)
        got = smol.detokenize(out[temperature])
        if kind == "json_schema":
            value = json.loads(got)
            assert set(value) == {"n", "ok"} and isinstance(value["n"], int) and isinstance(value["ok"], bool)
        elif kind == "gbnf":
            assert got in ("The answer is yes.", "The answer is no.")
        elif kind == "regex":
            assert re.fullmatch(r"[A-Z][a-z]{1,12} [0-9]{2}", got), got
        else:
            assert got in ("red", "green", "blue")
    for temperature, want in out.items():
        assert _constrained(remote_smol, kind, text, temperature) == want


def test_bad_grammar_is_a_clear_error(smol):
    from apir.engine.constraint import GrammarError

    with pytest.raises(GrammarError, match="invalid gbnf"):
        smol.constraint("gbnf", "root ::= (")
    with pytest.raises(GrammarError, match="invalid regex"):
        smol.constraint("regex", "a(")


def test_embeddings_pool_normalise_and_rank(smol):
    cat, paraphrase, other = (smol.embed(smol.tokenize(s), "mean") for s in (
        "The cat sat on the mat.", "A cat was sitting on the rug.", "Stock markets fell sharply on Tuesday."))
    assert cat.shape == (576,) and abs(np.linalg.norm(cat) - 1) < 1e-5
    assert cat @ paraphrase > cat @ other
    ids = smol.tokenize("one two three")
    hidden = [smol.embed(ids[: i + 1], "last") for i in range(len(ids))]
    np.testing.assert_allclose(smol.embed(ids, "cls"), hidden[0], atol=1e-5)  # causal: row 0 alone
    with pytest.raises(ValueError, match="pooling"):
        smol.embed(ids, "max")


# ---------------------------------------------------------------- one server, real clients
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from test_server import serve

    with serve(tmp_path_factory.mktemp("serve"), "--pooling", "mean", "--alias", "smol") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=300)


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"price": {"type": "number"}, "currency": {"enum": ["EUR", "USD"]}},
     "required": ["price", "currency"]},
    {"type": "object", "properties": {"address": {"type": "object", "properties": {
        "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["city", "zip"], "additionalProperties": False}}, "required": ["address"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "count": {"type": "integer", "minimum": 0,
                                                                            "maximum": 9}},
     "required": ["ok", "count"]},
    {"type": "object", "properties": {"points": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
        "required": ["x", "y"], "additionalProperties": False}}}, "required": ["points"]},
    {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20},
                                      "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["answer", "confidence"]},
    {"type": "object", "properties": {"kind": {"const": "event"}, "day": {
        "enum": ["mon", "tue", "wed"]}, "attendees": {"type": "integer"}}, "required": ["kind", "day", "attendees"]},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30}, "sizes": {
        "type": "array", "items": {"enum": ["S", "M", "L"]}, "maxItems": 3}, "meta": {"type": "object", "properties": {
            "stock": {"type": "integer"}}, "required": ["stock"], "additionalProperties": False}},
     "required": ["title", "sizes", "meta"]},
]


def test_json_schema_strict_outputs_validate(client):
    jsonschema = pytest.importorskip("jsonschema")
    for i, schema in enumerate(SCHEMAS):
        schema = {**schema, "additionalProperties": False}
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Make up an example as JSON."}],
            temperature=0, max_tokens=120, seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "strict": True, "schema": schema}})
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.chat.completions.create(model=MODEL, messages=MSGS, temperature=0, max_tokens=60,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError, match="invalid gbnf"):
        client.completions.create(model=MODEL, prompt="x", extra_body={"grammar": "root ::= ("})


def test_logprobs_and_the_field_rule_over_http(client):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, temperature=0, max_tokens=3,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token
                                     for c in content)
    assert "".join(c.token for c in content) == r.choices[0].message.content
    stream = client.chat.completions.create(model=MODEL, messages=MSGS, temperature=0, max_tokens=3,
                                            logprobs=True, top_logprobs=2, stream=True)
    streamed = [e for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for e in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(c.token, c.logprob) for c in content]
    c = client.completions.create(model="smol", prompt="The capital of France is", temperature=0,
                                  max_tokens=2, logprobs=2)
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text and len(lp.top_logprobs[0]) == 2
    for kw, param in (({"n": 2}, "n"), ({"extra_body": {"mirostat": 2}}, "mirostat"),
                      ({"reasoning_effort": "low"}, "reasoning_effort")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1, **kw)
        assert e.value.body["param"] == param


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_tool_calls_whole_streamed_and_answered(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=MODEL, messages=ask, temperature=0, max_tokens=60,
                                       tools=[WEATHER], tool_choice="required")
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}
    stream = client.chat.completions.create(model=MODEL, messages=ask, temperature=0, max_tokens=60,
                                            tools=[WEATHER], tool_choice="required", stream=True)
    chunks = list(stream)
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls]
    assert deltas[0][0].function.name == "get_weather"
    assert deltas[0][0].function.arguments == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    follow = ask + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
    r = client.chat.completions.create(model=MODEL, messages=follow, temperature=0, max_tokens=40,
                                       tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


def test_langchain_structured_output_tools_and_embeddings(server):
    pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI, OpenAIEmbeddings
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    llm = ChatOpenAI(base_url=f"{server}/v1", api_key="none", model=MODEL, temperature=0, max_tokens=80)
    city = llm.with_structured_output(City).invoke("Describe Paris.")
    assert isinstance(city, City) and city.name

    @tool
    def get_weather(city: str) -> str:
        """Get the weather for a city."""
        return "sunny"

    msg = llm.bind_tools([get_weather], tool_choice="required").invoke("What is the weather in Paris?")
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"] and "city" in msg.tool_calls[0]["args"]
    # tiktoken's ids mean nothing to this model: send the text (as every non-OpenAI server needs)
    emb = OpenAIEmbeddings(base_url=f"{server}/v1", api_key="none", model=MODEL,
                           check_embedding_ctx_length=False)
    cat, paraphrase, other = np.array(emb.embed_documents([
        "The cat sat on the mat.", "A cat was sitting on the rug.", "Stock markets fell sharply on Tuesday."]))
    assert cat.shape == (576,) and cat @ paraphrase > cat @ other


def test_litellm_openai_and_ollama_routes(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network fetch
    litellm = pytest.importorskip("litellm")
    want = httpx.post(f"{server}/v1/chat/completions", json={
        "model": MODEL, "messages": MSGS, "temperature": 0, "max_tokens": 5}, timeout=120).json()
    want = want["choices"][0]["message"]["content"]
    for model, base in ((f"openai/{MODEL}", f"{server}/v1"), (f"ollama_chat/{MODEL}", server)):
        r = litellm.completion(model=model, api_base=base, api_key="none", messages=MSGS,
                               temperature=0, max_tokens=5)
        assert r.choices[0].message.content == want, model
    r = litellm.completion(model=f"ollama_chat/{MODEL}", api_base=server, messages=MSGS,
                           temperature=0, max_tokens=5, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in r) == want


def test_ollama_api(server):
    def post(path, body):
        return httpx.post(f"{server}{path}", json=body, timeout=120)

    assert httpx.get(f"{server}/api/version").json()["version"]
    (tag,) = httpx.get(f"{server}/api/tags").json()["models"]
    assert tag["name"] == f"{MODEL}:latest" and tag["details"]["family"] == "llama"
    assert httpx.get(f"{server}/api/ps").json()["models"][0]["context_length"] == 4096
    show = post("/api/show", {"model": MODEL}).json()
    assert "<|im_start|>" in show["template"] and "embedding" in show["capabilities"]
    opts = {"temperature": 0, "num_predict": 5}
    lines = [json.loads(x) for x in post("/api/chat", {"model": MODEL, "messages": MSGS, "options": opts}).text.splitlines()]
    assert [x["done"] for x in lines] == [False] * 5 + [True] and lines[-1]["eval_count"] == 5
    whole = post("/api/chat", {"model": f"{MODEL}:latest", "messages": MSGS, "options": opts, "stream": False}).json()
    assert whole["message"]["content"] == "".join(x["message"]["content"] for x in lines)
    gen = post("/api/generate", {"model": "smol", "prompt": "The capital of France is", "raw": True,
                                 "stream": False, "options": opts}).json()
    assert gen["response"].startswith(" Paris") and gen["done_reason"] == "length"
    fmt = post("/api/chat", {"model": MODEL, "messages": MSGS, "stream": False, "format": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
        "additionalProperties": False}, "options": {
        "temperature": 0, "num_predict": 40}}).json()
    assert set(json.loads(fmt["message"]["content"])) == {"a"}
    tools = post("/api/chat", {"model": MODEL, "stream": False, "tools": [WEATHER],
                               "options": {"temperature": 0, "num_predict": 40},
                               "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}).json()
    # Ollama has no tool_choice: "auto", so the answer is a call or a reply, parsed either way
    answer = tools["message"]
    if "tool_calls" in answer:
        assert answer["tool_calls"][0]["function"]["name"] == "get_weather"
        assert isinstance(answer["tool_calls"][0]["function"]["arguments"], dict)
    else:
        assert answer["content"] and '"response"' not in answer["content"]
    emb = post("/api/embed", {"model": MODEL, "input": ["a cat", "a dog"]}).json()
    assert np.array(emb["embeddings"]).shape == (2, 576)
    bad = post("/api/chat", {"model": MODEL, "messages": MSGS, "options": {"num_ctx": 8}})
    assert bad.status_code == 400 and bad.json() == {"error": "'options.num_ctx' is not supported by this server"}
    assert post("/api/chat", {"model": "nope", "messages": MSGS}).status_code == 404
    # Ollama fields this server cannot honour are refused, naming them; keep_alive of any
    # duration is kept (the model stays loaded), 0 (unload now) is not
    for path, body, field in [
            ("/api/chat", {"model": MODEL, "messages": MSGS, "keep_alive": 0}, "'keep_alive' 0"),
            ("/api/embed", {"model": MODEL, "input": "a", "keep_alive": "0s"}, "'keep_alive' 0"),
            ("/api/show", {"model": MODEL, "verbose": True}, "'verbose'"),
            ("/api/generate", {"model": MODEL, "prompt": "x", "raw": True, "system": "s"}, "'system'")]:
        r = post(path, body)
        assert r.status_code == 400 and r.json()["error"].startswith(field), (path, r.text)
    assert post("/api/embed", {"model": MODEL, "input": "a", "keep_alive": "5m"}).status_code == 200
    # past the context: refused when told not to truncate (Ollama's default cuts it)
    assert post("/api/embed", {"model": MODEL, "input": "cat " * 5000, "truncate": False}).status_code == 400


def test_tokenize_detokenize_and_embeddings_endpoint(server, client):
    r = httpx.post(f"{server}/tokenize", json={"content": "hello world", "with_pieces": True}).json()
    assert [t["piece"] for t in r["tokens"]] == ["hello", " world"]
    ids = [t["id"] for t in r["tokens"]]
    assert httpx.post(f"{server}/tokenize", json={"content": "hello world"}).json() == {"tokens": ids}
    assert httpx.post(f"{server}/detokenize", json={"tokens": ids}).json() == {"content": "hello world"}
    assert httpx.post(f"{server}/detokenize", json={"tokens": [-1]}).status_code == 400
    e = client.embeddings.create(model=MODEL, input=["hello world", ids])  # base64 on the wire
    a, b = (np.array(d.embedding) for d in e.data)
    np.testing.assert_allclose(a, b, atol=1e-6)  # text and its ids: the same vector
    assert e.usage.prompt_tokens == 4


def test_embeddings_need_a_pooling_type():
    from types import SimpleNamespace

    from starlette.testclient import TestClient
    from test_server import _Held, _wait_ok

    from apir.flags import RunConfig
    from apir.server.app import ServeConfig, create_app

    model = _Held()
    model.file = SimpleNamespace(path=None, get=lambda key, default=None: default)  # no pooling_type
    with TestClient(create_app(ServeConfig(RunConfig(model="held"), parallel=1), loader=lambda: model)) as tc:
        _wait_ok(tc)
        r = tc.post("/v1/embeddings", json={"input": "x"})
        assert r.status_code == 400 and "--pooling mean, cls or last" in r.json()["error"]["message"]
        r = tc.post("/api/embed", json={"input": "x"})
        assert r.status_code == 400 and "--pooling" in r.json()["error"]


def test_penalized_sampling_is_the_same_through_a_host(smol, remote_smol):
    """Penalties, logit_bias and logprobs through the remote backend: the same tokens."""
    ids = smol.tokenize("one two one two one two")
    penalized = SamplingParams(temperature=0.8, seed=9, max_tokens=12, repeat_penalty=1.3,
                               frequency_penalty=0.5, logit_bias=((28, -100.0),), logprobs=2)
    # without penalties the steps stay pipelined: each fed its token on the backend
    pipelined = SamplingParams(temperature=0.8, seed=9, max_tokens=12, logit_bias=((28, -100.0),), logprobs=2)
    for params in (penalized, pipelined):
        native, remote = (list(m.generate_tokens(ids, params)) for m in (smol, remote_smol))
        assert [t.id for t in native] == [t.id for t in remote] and 28 not in [t.id for t in native]
        # the host's worker may compute with fewer threads than this process (-t): f32 sums
        # in another order, ~3e-4 apart in a logprob; the tokens are the same
        np.testing.assert_allclose([t.logprob for t in native], [t.logprob for t in remote], atol=2e-3)
