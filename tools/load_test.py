#!/usr/bin/env python3
"""A bounded load test of `akunu serve` on loopback.

N client threads send streaming chat requests back to back for a fixed
duration (raw HTTP, server-sent events). Reports requests served, errors
(by status), the time to first token (p50/p99, from sending the request to
the first content chunk) and the total time per request, and the tokens
generated per second overall.

Start the server first (e.g. `akunu serve --device cpu --port 8090 --queue 16`),
or pass --akunu to have this script start one on a free port.

usage: load_test.py [--port P | --akunu BIN [--model PATH]] [--clients N]
                    [--duration S] [--max-tokens T] [--json OUT]
"""

import argparse
import http.client
import json
import re
import statistics
import subprocess
import threading
import time

PROMPTS = [
    "Tell me about the sea.", "What is a prime number?", "Name three colors.",
    "Write a short poem about rain.", "How do birds fly?", "What is the capital of Spain?",
    "Give me a tip for cooking rice.", "Why is the sky blue?",
]


def percentile(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


def one_request(port, model, prompt, max_tokens, api_key):
    """Returns (status, ttft_s or None, total_s, completion_tokens)."""
    t0 = time.perf_counter()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.7, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    try:
        c.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=headers)
        r = c.getresponse()
        if r.status != 200:
            r.read()
            return r.status, None, time.perf_counter() - t0, 0
        ttft, tokens = None, 0
        while True:
            line = r.readline()
            if not line:
                break
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
            for ch in obj.get("choices", []):
                if ttft is None and ch.get("delta", {}).get("content"):
                    ttft = time.perf_counter() - t0
        return 200, ttft, time.perf_counter() - t0, tokens
    except OSError as e:
        return f"connection error: {e}", None, time.perf_counter() - t0, 0
    finally:
        c.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int)
    ap.add_argument("--akunu")
    ap.add_argument("--model")
    ap.add_argument("--model-id", help="the model name to send (default: the first of /v1/models)")
    ap.add_argument("--api-key")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--queue", type=int, default=16, help="--queue of the server this script starts")
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args()

    proc = None
    port = a.port
    if a.akunu:
        args = [a.akunu, "serve", "--device", "cpu", "--port", "0", "--queue", str(a.queue)]
        if a.model:
            args += ["--model", a.model]
        proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True)
        for line in proc.stderr:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m:
                port = int(m.group(1))
                break
        threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    if port is None:
        raise SystemExit("give --port or --akunu")
    model = a.model_id
    if model is None:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        c.request("GET", "/v1/models", headers={"Authorization": f"Bearer {a.api_key}"} if a.api_key else {})
        model = json.loads(c.getresponse().read())["data"][0]["id"]

    results = []
    lock = threading.Lock()
    end = time.perf_counter() + a.duration

    def client(i):
        n = 0
        while time.perf_counter() < end:
            res = one_request(port, model, PROMPTS[(i + n) % len(PROMPTS)], a.max_tokens, a.api_key)
            n += 1
            with lock:
                results.append(res)
            if res[0] != 200:
                # A refused client waits a little before trying again, as
                # real clients back off (and so as not to spin on 503s).
                time.sleep(0.1)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if proc:
        proc.terminate()
        proc.wait(timeout=30)

    ok = [r for r in results if r[0] == 200]
    errors = {}
    for r in results:
        if r[0] != 200:
            errors[str(r[0])] = errors.get(str(r[0]), 0) + 1
    ttft = [r[1] for r in ok if r[1] is not None]
    total = [r[2] for r in ok]
    tokens = sum(r[3] for r in ok)
    out = {
        "clients": a.clients, "duration_s": a.duration, "wall_s": round(wall, 1), "max_tokens": a.max_tokens,
        "requests": len(results), "served": len(ok), "errors": errors,
        "ttft_p50_ms": round(1e3 * percentile(ttft, 50), 1) if ttft else None,
        "ttft_p99_ms": round(1e3 * percentile(ttft, 99), 1) if ttft else None,
        "latency_p50_ms": round(1e3 * statistics.median(total), 1) if total else None,
        "latency_p99_ms": round(1e3 * percentile(total, 99), 1) if total else None,
        "generated_tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
    }
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
