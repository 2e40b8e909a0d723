"""`apir serve` end to end: the official openai client against a real server process
(SmolLM2-135M on the CPU), plus in-process checks of loading and auth on a tiny model.

The server starts once per module; generations are kept to a few tokens because the CPU
decodes slowly. Greedy (temperature 0) replies are deterministic, which is what the
stream-vs-whole and concurrent-vs-alone comparisons rely on.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from hosts import WAIT  # noqa: E402

from apir.flags import RunConfig  # noqa: E402
from apir.models.errors import ModelNotFoundError  # noqa: E402
from apir.models.resolve import resolve_model  # noqa: E402

KEY = "test-key-123"
MODEL = "smollm2-135m"
N = 5  # tokens per generation: enough to compare, cheap on a CPU
HELLO = [{"role": "user", "content": "Say hello"}]
COLOR = [{"role": "user", "content": "Name a color"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(tmp: Path, *args: str) -> Iterator[str]:
    """``apir serve`` of MODEL on the CPU in a subprocess with ``args``; yields its base URL
    once /health says ok."""
    try:
        resolve_model(MODEL)
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    port = _free_port()
    log = tmp / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("APIR_")}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "apir.cli", "serve", "-m", MODEL, "--backend", "local",
             "--device", "cpu", "--port", str(port), *args],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"server exited:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"server not healthy:\n{log.read_text()[-3000:]}"
            try:
                r = httpx.get(f"{base}/health", timeout=5)
                if r.status_code == 200:
                    assert r.json() == {"status": "ok"}
                    break
                assert (r.status_code, r.json()) == (503, {"status": "loading"})
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(WAIT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("serve"), "--api-key", KEY) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=180)


def _chat(client, messages, **kw):
    return client.chat.completions.create(**{"model": MODEL, "messages": messages,
                                             "temperature": 0, "max_tokens": N, **kw})


@pytest.fixture(scope="module")
def hello(client):
    """The greedy reply to HELLO, asked alone."""
    return _chat(client, HELLO)


def _metrics(base: str) -> dict[str, float]:
    r = httpx.get(f"{base}/metrics", timeout=WAIT)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_lists_the_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_completion(hello):
    choice = hello.choices[0]
    assert hello.object == "chat.completion" and hello.model == MODEL
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    u = hello.usage
    assert u.completion_tokens == N and u.prompt_tokens > 5
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_stream_equals_whole_reply(client, hello):
    chunks = list(_chat(client, HELLO, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == hello.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and _counts(chunks[-1].usage) == _counts(hello.usage)
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_and_stop_strings(client):
    whole = client.completions.create(model=MODEL, prompt="The capital of France is",
                                      temperature=0, max_tokens=N)
    text = whole.choices[0].text
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    stop = text.split()[1]  # the second word
    cut = client.completions.create(model=MODEL, prompt="The capital of France is",
                                    temperature=0, max_tokens=N, stop=[stop, "never seen"])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens <= N


def test_metrics_count_up(server, client):
    before = _metrics(server)
    r = client.chat.completions.create(model=MODEL, messages=COLOR, temperature=0, max_tokens=2)
    after = _metrics(server)
    key = 'apir_requests_total{endpoint="/v1/chat/completions",status="200"}'
    assert after[key] == before.get(key, 0) + 1
    assert after["apir_generated_tokens_total"] - before["apir_generated_tokens_total"] == 2
    assert after["apir_prompt_tokens_total"] - before["apir_prompt_tokens_total"] == r.usage.prompt_tokens
    assert after["apir_generation_tokens_per_second"] > 0
    assert after["apir_remote_round_trip_seconds"] == 0 and after["apir_model_loaded"] == 1
    assert after["apir_requests_in_flight"] == 0


def test_bad_requests_are_refused_and_serving_continues(server, client):
    auth = {"Authorization": f"Bearer {KEY}"}
    url = f"{server}/v1/chat/completions"
    r = httpx.post(url, content=b'{"messages": [', headers=auth, timeout=WAIT)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(url, json={"messages": HELLO, "temperature": -1}, headers=auth, timeout=WAIT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = httpx.post(url, json={"messages": "hi"}, headers=auth, timeout=WAIT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(url, json={"messages": HELLO}, timeout=WAIT)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=HELLO)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=100_000)
    assert e.value.code == "context_length_exceeded" and "context" in e.value.message
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()
    assert _chat(client, COLOR, max_tokens=1).choices[0].message.content  # still serving


def test_client_disconnect_cancels_generation(server, client):
    before = _metrics(server)
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        contents = 0
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                contents += 1
                if contents == 2:
                    break  # hang up mid-stream
    assert _chat(client, COLOR, max_tokens=1).choices[0].finish_reason == "length"
    after = _metrics(server)
    assert after["apir_generations_cancelled_total"] == before["apir_generations_cancelled_total"] + 1
    assert after["apir_generated_tokens_total"] - before["apir_generated_tokens_total"] < 50


def test_concurrent_requests_match_alone(client, hello):
    color = _chat(client, COLOR)
    with ThreadPoolExecutor(2) as pool:
        both = [pool.submit(_chat, client, m) for m in (HELLO, COLOR)]
        a, b = (f.result() for f in both)
    assert a.choices[0].message.content == hello.choices[0].message.content
    assert b.choices[0].message.content == color.choices[0].message.content
    # prompt_tokens_details.cached_tokens differs: a repeated prompt reuses its slot's cache
    assert (_counts(a.usage), _counts(b.usage)) == (_counts(hello.usage), _counts(color.usage))


def _counts(usage) -> tuple[int, int, int]:
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


# ---------------------------------------------------------------- in process, tiny model
@pytest.fixture
def tiny_app(tmp_path):
    """An app on a tiny random GGUF (numpy backend) whose loading waits for a go."""
    from starlette.testclient import TestClient
    from tiny_models import write_tiny_gguf

    import apir
    from apir.server.app import ServeConfig, create_app

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    go = threading.Event()

    def loader():
        assert go.wait(WAIT)
        return apir.load(str(path), backend="numpy")

    config = ServeConfig(RunConfig(model=str(path), backend="numpy"), api_key="k")
    with TestClient(create_app(config, loader=loader)) as tc:
        yield tc, go


def _wait_ok(tc) -> None:
    deadline = time.monotonic() + WAIT
    while tc.get("/health").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_health_reports_loading_then_ok(tiny_app):
    tc, go = tiny_app
    r = tc.get("/health")
    assert (r.status_code, r.json()) == (503, {"status": "loading"})
    r = tc.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer k"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready"
    go.set()
    _wait_ok(tc)
    assert tc.get("/health").json() == {"status": "ok"}


@pytest.mark.filterwarnings("ignore:.*ChatML")  # the tiny model has no chat template
def test_tiny_model_completions_and_auth(tiny_app):
    tc, go = tiny_app
    go.set()
    _wait_ok(tc)
    body = {"model": "tiny", "prompt": [256, 104, 105], "max_tokens": 3, "temperature": 0}
    assert tc.post("/v1/completions", json=body).status_code == 401
    assert tc.post("/v1/completions", json=body, headers={"Authorization": "Bearer no"}).status_code == 401
    r = tc.post("/v1/completions", json=body, headers={"Authorization": "Bearer k"})
    assert r.status_code == 200, r.text
    u = r.json()["usage"]  # a random model may end early
    assert u["prompt_tokens"] == 3 and u["total_tokens"] == 3 + u["completion_tokens"] <= 6
    r = tc.post("/v1/completions", json={**body, "prompt": [10**6]}, headers={"Authorization": "Bearer k"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = tc.post("/v1/completions", json={**body, "stream": True}, headers={"Authorization": "Bearer k"})
    lines = [ln for ln in r.text.split("\n\n") if ln]
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 2, "temperature": 1.0, "seed": 7}
    r1, r2 = (tc.post("/v1/chat/completions", json=chat, headers={"Authorization": "Bearer k"})
              for _ in range(2))
    assert r1.json()["usage"]["completion_tokens"] <= 2
    assert r1.json()["choices"] == r2.json()["choices"]  # same seed, same sample
    assert tc.get("/health").status_code == 200  # /health and /metrics need no key
    assert "apir_requests_total" in tc.get("/metrics").text


def test_load_failure_is_reported(tmp_path):
    from starlette.testclient import TestClient

    from apir.server.app import ServeConfig, create_app

    failed = []
    config = ServeConfig(RunConfig(model=str(tmp_path / "missing.gguf")))
    with TestClient(create_app(config, on_load_error=failed.append)) as tc:
        deadline = time.monotonic() + WAIT
        while not failed:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = tc.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "error"
        assert "not found" in r.json()["message"]


def test_serve_cli_help():
    out = subprocess.run([sys.executable, "-m", "apir.cli", "serve", "--help"], capture_output=True,
                         text=True, check=True, cwd=Path(__file__).parent).stdout
    for flag in ("--bind", "--port", "--api-key", "--backend", "--remote", "--ctx-size"):
        assert flag in out


def test_request_validation():
    from apir.server.schemas import RequestError, parse_chat, parse_completion

    msgs = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]
    req = parse_chat({"messages": msgs, "stop": "x", "max_tokens": 9, "max_completion_tokens": 3})
    assert req.messages[0] == {"role": "system", "content": "be brief"}
    assert req.sampling.stop == ("x",) and req.sampling.max_tokens == 3
    assert parse_completion({"prompt": ["once"]}).prompt == "once"
    assert parse_completion({"prompt": [1, 2]}).prompt == (1, 2)
    for body, param in [
        ({"messages": msgs, "n": 2}, "n"),
        ({"messages": msgs, "top_p": 1.5}, "top_p"),
        ({"messages": msgs, "max_tokens": 0}, "max_tokens"),
        ({"messages": msgs, "stop": [1]}, "stop"),
        ({"messages": msgs, "seed": "7"}, "seed"),
        ({"messages": msgs, "stream": "yes"}, "stream"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        ({"messages": msgs, "model": 3}, "model"),
    ]:
        with pytest.raises(RequestError) as e:
            parse_chat(body)
        assert e.value.param == param and e.value.status == 400
    with pytest.raises(RequestError):
        parse_completion({"prompt": ["a", "b"]})
    with pytest.raises(RequestError):
        parse_chat([1, 2])


# ---------------------------------------------------------------- hostile requests, raw ASGI
async def _asgi(app, path: str, chunks, headers=(), disconnect: bool = False):
    """POST ``chunks`` (read one per receive) to ``app``; returns (status, JSON body, chunks
    read). With ``disconnect``, the client is gone once its body is sent."""
    import anyio

    it, pulled, ended, sent = iter(chunks), 0, False, []

    async def receive():
        nonlocal pulled, ended
        for chunk in it:
            pulled += 1
            return {"type": "http.request", "body": chunk, "more_body": True}
        if not ended:
            ended = True
            return {"type": "http.request", "body": b"", "more_body": False}
        if not disconnect:
            await anyio.sleep_forever()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"), *headers],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    with anyio.fail_after(WAIT):  # a guard against a hang, not a speed test
        await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body), pulled


def _app(**kw):
    from apir.server.app import ServeConfig, create_app

    return create_app(ServeConfig(RunConfig(model="tiny"), **kw), loader=lambda: pytest.fail("not loaded here"))


def _post(app, path: str, body: bytes):
    import asyncio

    status, reply, _ = asyncio.run(_asgi(app, path, [body]))
    assert set(reply["error"]) == {"message", "type", "param", "code"}, reply
    return status, reply["error"]


def test_malformed_json_of_any_kind_is_a_400():
    app = _app()
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, err = _post(app, "/v1/completions", deep)
    assert status == 400 and "nested too deeply" in err["message"]
    status, err = _post(app, "/v1/completions", b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}")
    assert status == 400 and "not valid JSON" in err["message"]  # past int()'s digit limit
    status, err = _post(app, "/v1/completions", b'{"prompt": "hi", "temperature": 1' + b"0" * 400 + b"}")
    assert (status, err["param"]) == (400, "temperature")  # too big for a float
    status, err = _post(app, "/v1/chat/completions", b'{"messages": [{"role": [1], "content": "x"}]}')
    assert (status, err["param"]) == (400, "messages[0].role") and err["message"].endswith("got list")
    status, err = _post(app, "/v1/chat/completions", json.dumps({"model": "m" * 100_000,
                                                                 "messages": HELLO}).encode())
    assert status == 404 and len(err["message"]) < 300  # not said back whole


def test_body_is_capped_while_it_is_read():
    import asyncio

    from apir.server.app import MAX_BODY

    app = _app()
    mib = b" " * (1 << 20)
    status, reply, pulled = asyncio.run(_asgi(app, "/v1/completions", [mib] * 64))
    assert status == 413 and "over 32 MiB" in reply["error"]["message"]
    assert pulled == MAX_BODY // len(mib) + 1  # stopped at the first MiB past the cap
    length = [(b"content-length", str(MAX_BODY + 1).encode())]
    status, reply, pulled = asyncio.run(_asgi(app, "/v1/completions", [b"{}"], length))
    assert (status, pulled) == (413, 0)  # refused from its header, nothing read
    status, reply, _ = asyncio.run(_asgi(app, "/v1/completions", [b"{}"], [(b"content-length", b"-1")]))
    assert status == 400 and "Content-Length" in reply["error"]["message"]


class _Held:
    """A model whose generations wait for ``go``: the first request holds the runner."""

    arch_name, n_ctx, vocab_size = "held", 64, 100

    def __init__(self):
        from types import SimpleNamespace

        self.go, self.started = threading.Event(), threading.Event()
        self.backend = SimpleNamespace(name="held", device=lambda: SimpleNamespace(name="cpu", kind="cpu"))
        self.tokenizer = SimpleNamespace(stream=lambda: SimpleNamespace(feed=lambda t: "x", flush=lambda: ""))
        self.file = SimpleNamespace(path=None)

    def tokenize(self, text):
        if text == "boom":
            raise RuntimeError("failed at /srv/secret/model.py line 3")
        return [1, 2]

    def generate_tokens(self, ids, params, constraint=None):
        from apir.engine.model import Token

        self.started.set()
        assert self.go.wait(WAIT)
        yield from (Token(i) for i in range(3, 3 + params.max_tokens))

    def close(self):
        pass


def test_a_queued_request_whose_client_left_ends(monkeypatch):
    """A non-streaming request queued behind another, whose client hangs up, gets its
    Done at once: the handler returns and the in-flight count goes back down."""
    from starlette.testclient import TestClient

    from apir.server.app import ServeConfig, create_app

    model = _Held()
    app = create_app(ServeConfig(RunConfig(model="held"), parallel=1), loader=lambda: model)
    with TestClient(app, raise_server_exceptions=False) as tc:
        _wait_ok(tc)
        first = []
        t = threading.Thread(target=lambda: first.append(
            tc.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})))
        t.start()
        try:
            assert model.started.wait(WAIT)
            body = json.dumps({"prompt": "b", "max_tokens": 2}).encode()
            status, reply, _ = tc.portal.call(lambda: _asgi(app, "/v1/completions", [body], disconnect=True))
            assert status == 200 and reply["choices"][0]["finish_reason"] == "cancelled"
            assert "apir_requests_in_flight 1" in tc.get("/metrics").text  # only the first
            r = tc.post("/v1/completions", json={"prompt": "boom"})
            assert r.status_code == 500 and "/srv" not in r.text and "RuntimeError" in r.text
        finally:
            model.go.set()
            t.join(WAIT)
        assert first[0].status_code == 200 and first[0].json()["usage"]["completion_tokens"] == 2
        assert "apir_requests_in_flight 0" in tc.get("/metrics").text


def test_runner_ends_every_job():
    """Cancelled while queued, queued at close, submitted after close: each gets its Done."""
    import asyncio

    from apir.engine import SamplingParams
    from apir.server.metrics import Metrics
    from apir.server.runner import Done, Job, Runner

    async def events(job):
        return [e async for e in job.events()]

    async def main():
        model = _Held()
        runner = Runner(model, Metrics())
        jobs = [Job([1, 2], SamplingParams(max_tokens=2)) for _ in range(4)]
        for job in jobs[:3]:
            runner.submit(job)
        await asyncio.to_thread(model.started.wait, WAIT)
        jobs[1].cancel()
        assert await asyncio.wait_for(events(jobs[1]), WAIT) == [Done("cancelled", 2, 0)]
        closing = asyncio.create_task(asyncio.to_thread(runner.close))
        while not runner._closed:  # job 2 is still queued when the close begins
            await asyncio.sleep(0.01)
        model.go.set()
        await closing
        runner.submit(jobs[3])
        ends = [(await asyncio.wait_for(events(j), WAIT))[-1] for j in (jobs[0], jobs[2], jobs[3])]
        assert [e.finish_reason for e in ends] == ["cancelled"] * 3

    asyncio.run(main())
