#!/usr/bin/env python3
"""End-to-end tests of `akunu serve` and `akunu chat` on the default model.

Starts the real server binary on a loopback port and drives it with the
official `openai` Python package and with raw HTTP (http.client): chat and
completions, streaming and not, stop sequences, seeds, JSON schema output,
logprobs, prefix reuse, concurrent requests, a client that disconnects
mid-stream, a full queue, and bad requests of every kind; after each of the
latter the server must still answer. Then `akunu chat` is driven through a
pipe, with a Ctrl-C (SIGINT) in the middle of a reply.

usage: test_server.py --akunu target/release/akunu [--model PATH]
"""

import argparse
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import openai

KEY = "sk-akunu-test"
CTX = 512
QUEUE = 4  # the concurrency test sends this many at once: they fit even before one starts

failures = []


def check(cond, what):
    if cond:
        print(f"  ok: {what}")
    else:
        print(f"  FAIL: {what}")
        failures.append(what)


class Server:
    def __init__(self, akunu, model, extra):
        args = [akunu, "serve", "--device", "cpu", "--port", "0", "--ctx", str(CTX),
                "--queue", str(QUEUE), "--api-key", KEY] + extra
        if model:
            args += ["--model", model]
        self.log = open("target/test_server.log", "w")
        self.proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True)
        self.port = None
        deadline = time.time() + 120
        for line in self.proc.stderr:
            self.log.write(line)
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                break
            if time.time() > deadline:
                break
        if self.port is None:
            raise SystemExit("the server did not start; see target/test_server.log")
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.proc.stderr:
            self.log.write(line)
            self.log.flush()

    def stop(self):
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def raw(port, method, path, body=None, key=KEY, timeout=120):
    """One raw HTTP request; returns (status, parsed JSON or text)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    if isinstance(body, (dict, list)):
        body = json.dumps(body)
    c.request(method, path, body=body, headers=headers)
    r = c.getresponse()
    data = r.read().decode()
    c.close()
    try:
        return r.status, json.loads(data)
    except json.JSONDecodeError:
        return r.status, data


def is_openai_error(body):
    return (isinstance(body, dict) and isinstance(body.get("error"), dict)
            and isinstance(body["error"].get("message"), str) and "type" in body["error"])


def health(port):
    return raw(port, "GET", "/health", key=None)[1]


def still_serving(port, model_id):
    s, b = raw(port, "POST", "/v1/completions",
               {"model": model_id, "prompt": "Hello", "max_tokens": 2, "temperature": 0})
    check(s == 200 and b["usage"]["completion_tokens"] >= 1, "  ... and the server still serves")


def chat_text(client, model_id, content, **kw):
    r = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": content}], **kw)
    return r


def test_basics(client, port, model_id):
    print("models and health")
    models = client.models.list()
    check([m.id for m in models.data] == [model_id], f"/v1/models lists {model_id}")
    h = health(port)
    check(h["status"] == "ok" and h["context"] == CTX, "/health answers without a key")

    print("chat, non-streaming and streaming (greedy)")
    q = "What is the capital of France? Answer in one sentence."
    r = chat_text(client, model_id, q, max_tokens=24, temperature=0)
    text = r.choices[0].message.content
    check(r.object == "chat.completion" and r.choices[0].message.role == "assistant",
          "chat.completion with an assistant message")
    check("Paris" in text, f"the answer mentions Paris: {text!r}")
    u = r.usage
    check(u.total_tokens == u.prompt_tokens + u.completion_tokens and 0 < u.completion_tokens <= 24,
          f"usage adds up ({u.prompt_tokens} + {u.completion_tokens})")
    check(r.choices[0].finish_reason in ("stop", "length"), "finish_reason given")
    if r.choices[0].finish_reason == "length":
        check(u.completion_tokens == 24, "finish_reason length at max_tokens")
    stream = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": q}], max_tokens=24, temperature=0,
        stream=True, stream_options={"include_usage": True})
    parts, finish, usage, roles = [], None, None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            if c.delta.content:
                parts.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    check("".join(parts) == text, "the streamed text equals the non-streamed one")
    check(len(parts) > 3, f"it came in pieces ({len(parts)} chunks)")
    check(roles == ["assistant"] and finish == r.choices[0].finish_reason,
          "role in the first chunk, finish_reason in the last")
    check(usage is not None and usage.completion_tokens == u.completion_tokens,
          "include_usage sends the usage")

    print("prefix reuse: the next turn resends the conversation")
    before = health(port)["reused_prompt_tokens"]
    msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": text},
            {"role": "user", "content": "And of Italy?"}]
    r2 = client.chat.completions.create(model=model_id, messages=msgs, max_tokens=16, temperature=0)
    reused = health(port)["last"]["reused_tokens"]
    check(reused >= u.prompt_tokens, f"{reused} of {r2.usage.prompt_tokens} prompt tokens came from the cache "
          f"(the first turn's prompt had {u.prompt_tokens})")
    check(health(port)["reused_prompt_tokens"] > before, "the /health counter grew")

    print("completions, logprobs")
    r = client.completions.create(model=model_id, prompt="The first five prime numbers are",
                                  max_tokens=12, temperature=0, logprobs=3)
    c = r.choices[0]
    check(r.object == "text_completion" and len(c.text) > 0, f"text_completion: {c.text!r}")
    lp = c.logprobs
    check(len(lp.tokens) == r.usage.completion_tokens == len(lp.token_logprobs),
          "one logprob per generated token")
    check("".join(lp.tokens) == c.text, "the logprob tokens spell the text")
    ok = all(x <= 0 for x in lp.token_logprobs)
    # Greedy: the chosen token is the most likely one.
    ok_top = all(abs(max(t.values()) - x) < 1e-4 for t, x in zip(lp.top_logprobs, lp.token_logprobs))
    check(ok and ok_top, "logprobs are <= 0 and greedy picks the top-1")
    check(all(sum(2.718281828 ** v for v in t.values()) <= 1.0001 for t in lp.top_logprobs),
          "top probabilities sum to at most 1")
    r = chat_text(client, model_id, "Say hi", max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    check(len(content) == r.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content),
          "chat logprobs with top_logprobs")
    r = client.completions.create(model=model_id, prompt=[504, 3290, 314], max_tokens=4, temperature=0)
    check(r.usage.prompt_tokens == 3, "a prompt of token ids")


def test_stop_and_seed(client, model_id):
    print("stop sequences")
    p = "Count: 1, 2, 3, 4,"
    free = client.completions.create(model=model_id, prompt=p, max_tokens=30, temperature=0).choices[0].text
    stop = " 8"
    check(stop in free, f"the free text contains the stop string: {free!r}")
    want = free[: free.index(stop)]
    r = client.completions.create(model=model_id, prompt=p, max_tokens=30, temperature=0, stop=[stop, "zzz"])
    check(r.choices[0].text == want and r.choices[0].finish_reason == "stop",
          f"stopped before the stop string: {r.choices[0].text!r}")
    parts = [c.choices[0].text for c in client.completions.create(
        model=model_id, prompt=p, max_tokens=30, temperature=0, stop=stop, stream=True)]
    check("".join(parts) == want, "streaming: same text, the stop string never sent")

    print("seed reproducibility (temperature 1)")
    kw = dict(max_tokens=24, temperature=1.0, top_p=0.95)
    q = "Write a sentence about a cat."
    a = chat_text(client, model_id, q, seed=42, **kw).choices[0].message.content
    b = chat_text(client, model_id, q, seed=42, **kw).choices[0].message.content
    others = [chat_text(client, model_id, q, seed=s, **kw).choices[0].message.content for s in (7, 8)]
    check(a == b, "the same seed gives the same text")
    check(any(o != a for o in others), "other seeds give other text")


def test_json(client, model_id):
    print("response_format: json_schema and json_object")
    schema = {"type": "object",
              "properties": {"name": {"type": "string", "maxLength": 20},
                             "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    r = chat_text(client, model_id, "Describe a person named Ann, aged 31, as JSON.", max_tokens=60,
                  temperature=0,
                  response_format={"type": "json_schema",
                                   "json_schema": {"name": "person", "schema": schema, "strict": True}})
    text = r.choices[0].message.content
    try:
        obj = json.loads(text)
        ok = (set(obj) == {"name", "age"} and isinstance(obj["name"], str) and len(obj["name"]) <= 20
              and isinstance(obj["age"], int) and not isinstance(obj["age"], bool) and 0 <= obj["age"] <= 150)
    except json.JSONDecodeError:
        ok = False
    check(ok, f"the output is valid under the schema: {text!r}")
    r = chat_text(client, model_id, "Give me a JSON object about the sea.", max_tokens=60, temperature=0,
                  response_format={"type": "json_object"})
    text = r.choices[0].message.content
    try:
        ok = isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        ok = r.choices[0].finish_reason == "length" and text.lstrip().startswith("{")
    check(ok, f"json_object gives a JSON object: {text[:80]!r}")


def test_concurrent(port, model_id):
    print("concurrent requests: all answered, none mixed")
    prompts = ["The capital of Japan is", "Water boils at", "My favourite fruit is",
               "The first planet from the sun is"]
    expected = {}
    for p in prompts:
        s, b = raw(port, "POST", "/v1/completions",
                   {"model": model_id, "prompt": p, "max_tokens": 12, "temperature": 0})
        expected[p] = b["choices"][0]["text"]
    got = {}

    def worker(p):
        got[p] = raw(port, "POST", "/v1/completions",
                     {"model": model_id, "prompt": p, "max_tokens": 12, "temperature": 0})

    threads = [threading.Thread(target=worker, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    check(all(got[p][0] == 200 for p in prompts), f"all answered 200: {[got[p][0] for p in prompts]}")
    check(all(got[p][0] == 200 and got[p][1]["choices"][0]["text"] == expected[p] for p in prompts),
          "each got the text of its own prompt (as when sent alone)")
    check(len(set(expected.values())) == len(prompts), f"the prompts give different texts: {list(expected.values())}")


class StreamReader:
    """A raw streaming request, read chunk by chunk."""

    def __init__(self, port, body):
        self.c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        self.c.request("POST", "/v1/completions", body=json.dumps(body),
                       headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        self.r = self.c.getresponse()

    def next_data(self):
        while True:
            line = self.r.readline().decode()
            if not line:
                return None
            if line.startswith("data: "):
                return line[6:].strip()

    def close(self):
        # Drop the connection without reading the rest.
        self.c.sock.shutdown(2)
        self.c.close()


def wait_idle(port, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        h = health(port)
        if not h["generating"] and h["queue"]["waiting"] == 0:
            return h
        time.sleep(0.05)
    return health(port)


def test_disconnect(port, model_id):
    print("a client that disconnects mid-stream stops its generation")
    wait_idle(port)
    s = StreamReader(port, {"model": model_id, "prompt": "Once upon a time", "max_tokens": 400,
                            "temperature": 0, "ignore_eos": True, "stream": True})
    check(s.r.status == 200, "the stream started")
    for _ in range(3):
        s.next_data()
    s.close()
    h = wait_idle(port)
    last = h["last"]
    check(last["client_disconnected"] and last["max_tokens"] == 400 and last["generated_tokens"] < 100,
          f"the generation ended early: {last['generated_tokens']} of 400 tokens")
    still_serving(port, model_id)


def test_full_queue(port, model_id):
    print(f"a full queue answers 503 (queue {QUEUE})")
    wait_idle(port)
    long = StreamReader(port, {"model": model_id, "prompt": "Once upon a time", "max_tokens": 480,
                               "temperature": 0, "ignore_eos": True, "stream": True})
    long.next_data()
    results = []

    def filler():
        results.append(raw(port, "POST", "/v1/completions",
                           {"model": model_id, "prompt": "Hi", "max_tokens": 1, "temperature": 0}))

    fillers = [threading.Thread(target=filler) for _ in range(QUEUE)]
    for t in fillers:
        t.start()
    deadline = time.time() + 30
    while health(port)["queue"]["waiting"] < QUEUE and time.time() < deadline:
        time.sleep(0.02)
    check(health(port)["queue"]["waiting"] == QUEUE, "the queue filled up")
    s, b = raw(port, "POST", "/v1/completions", {"model": model_id, "prompt": "Hi", "max_tokens": 1})
    check(s == 503 and is_openai_error(b) and b["error"]["code"] == "queue_full",
          f"503 with the OpenAI error shape: {b}")
    long.close()
    for t in fillers:
        t.join()
    check(len(results) == QUEUE and all(r[0] == 200 for r in results), "the waiting requests were served")
    still_serving(port, model_id)


def test_bad_requests(client, port, model_id):
    print("bad requests get OpenAI-shaped errors, and the server keeps serving")
    cases = [
        ("malformed JSON", "/v1/chat/completions", '{"model": "x", "messages": [', 400, None),
        ("body not an object", "/v1/completions", "[1, 2]", 400, None),
        ("max_tokens of the wrong type", "/v1/chat/completions",
         {"model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, 400, "max_tokens"),
        ("messages of the wrong type", "/v1/chat/completions",
         {"model": model_id, "messages": "hi"}, 400, "messages"),
        ("temperature out of range", "/v1/chat/completions",
         {"model": model_id, "messages": [{"role": "user", "content": "hi"}], "temperature": 5}, 400, "temperature"),
        ("n = 2", "/v1/completions", {"model": model_id, "prompt": "hi", "n": 2}, 400, "n"),
        ("presence_penalty", "/v1/completions", {"model": model_id, "prompt": "hi", "presence_penalty": 1}, 400,
         "presence_penalty"),
        ("token id outside the vocabulary", "/v1/completions", {"model": model_id, "prompt": [99999999]}, 400,
         "prompt"),
        ("unknown model", "/v1/chat/completions",
         {"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
        ("oversized prompt", "/v1/completions", {"model": model_id, "prompt": "hello " * 600}, 400, None),
        ("prompt + max_tokens over the context", "/v1/completions",
         {"model": model_id, "prompt": "hello " * 100, "max_tokens": CTX}, 400, None),
        ("invalid JSON schema", "/v1/chat/completions",
         {"model": model_id, "messages": [{"role": "user", "content": "hi"}],
          "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         400, None),
        ("unknown endpoint", "/v1/embeddings", {"model": model_id, "input": "x"}, 404, None),
    ]
    for what, path, body, status, param in cases:
        s, b = raw(port, "POST", path, body)
        ok = s == status and is_openai_error(b) and (param is None or b["error"].get("param") == param)
        check(ok, f"{what}: {s} {b['error']['message'] if is_openai_error(b) else b}")
        if what.startswith(("oversized", "prompt + max")) and is_openai_error(b):
            check(b["error"]["code"] == "context_length_exceeded" and "context" in b["error"]["message"],
                  "  ... it says the context is exceeded")
        still_serving(port, model_id)

    print("API keys")
    s, b = raw(port, "GET", "/v1/models", key=None)
    check(s == 401 and is_openai_error(b) and b["error"]["code"] == "invalid_api_key", "missing key: 401")
    s, b = raw(port, "GET", "/v1/models", key="sk-wrong")
    check(s == 401 and is_openai_error(b), "wrong key: 401")
    bad = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-wrong", max_retries=0)
    try:
        bad.models.list()
        check(False, "the openai client with a wrong key is refused")
    except openai.AuthenticationError:
        check(True, "the openai client with a wrong key gets AuthenticationError")
    try:
        chat_text(client, "gpt-17", "hi", max_tokens=2)
        check(False, "unknown model refused through the openai client")
    except openai.NotFoundError:
        check(True, "unknown model: the openai client gets NotFoundError")
    try:
        client.completions.create(model=model_id, prompt="hello " * 600, max_tokens=4)
        check(False, "oversized prompt refused through the openai client")
    except openai.BadRequestError as e:
        check("context" in str(e), "oversized prompt: the openai client gets BadRequestError")
    still_serving(port, model_id)


def test_chat_cli(akunu, model):
    print("akunu chat through a pipe; Ctrl-C stops a reply, not the program")
    args = [akunu, "chat", "--device", "cpu", "--ctx", "1024", "-n", "300", "--stats"]
    if model:
        args += ["--model", model]
    p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, bufsize=1)
    err_lines = []
    threading.Thread(target=lambda: err_lines.extend(p.stderr), daemon=True).start()
    p.stdin.write("What is the capital of France?\n")
    p.stdin.flush()
    first = p.stdout.readline()
    check("Paris" in first, f"first reply: {first.strip()!r}")
    # Ctrl-C at the prompt (no reply running) does not end the program either.
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    time.sleep(0.5)
    check(p.poll() is None, "Ctrl-C at the prompt leaves the program running")
    # A long reply, interrupted after its first line of text.
    p.stdin.write("Write a very long story about a dragon, with many chapters.\n")
    p.stdin.flush()
    got = ""
    deadline = time.time() + 60
    while len(got) < 20 and time.time() < deadline:
        got += p.stdout.read(1)
    p.send_signal(signal.SIGINT)
    time.sleep(1.0)
    p.stdin.write("/exit\n")
    p.stdin.flush()
    try:
        rc = p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        rc = None
    time.sleep(0.2)
    err = "".join(err_lines)
    check(rc == 0, f"the program went on after Ctrl-C and exited cleanly on /exit (rc {rc})")
    check("[reply stopped]" in err, "the reply was stopped")
    check("Ctrl-C stops a reply; /exit or Ctrl-D quits" in err, "the idle Ctrl-C printed a hint")
    stats = re.findall(r"prefilled (\d+) new tokens \((\d+) reused", err)
    check(len(stats) == 2 and int(stats[1][1]) > int(stats[1][0]),
          f"the second turn reused the cache: (new, reused) = {stats}")
    gen = re.findall(r"generated (\d+) tokens", err)
    check(len(gen) == 2 and int(gen[1]) < 300, f"the stopped reply ended early: {gen}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--akunu", required=True)
    ap.add_argument("--model", default=None)
    a = ap.parse_args()
    t0 = time.time()
    srv = Server(a.akunu, a.model, [])
    try:
        port = srv.port
        model_id = raw(port, "GET", "/v1/models")[1]["data"][0]["id"]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        test_basics(client, port, model_id)
        test_stop_and_seed(client, model_id)
        test_json(client, model_id)
        test_concurrent(port, model_id)
        test_disconnect(port, model_id)
        test_full_queue(port, model_id)
        test_bad_requests(client, port, model_id)
    finally:
        srv.stop()
    test_chat_cli(a.akunu, a.model)
    print(f"{time.time() - t0:.0f} s")
    if failures:
        print(f"{len(failures)} FAILED:")
        for f in failures:
            print(f"  {f}")
        sys.exit(1)
    print("all server tests passed")


if __name__ == "__main__":
    main()
