"""Odd values on every route (OpenAI chat / completions, Anthropic Messages, Responses): each
must be a 2xx or a clear 4xx JSON error, never a 5xx, a hang or a dropped connection.

Usage: python odd_inputs.py PORT"""

import json
import sys

import httpx

BASE = f"http://localhost:{sys.argv[1]}"
M = "SmolLM2-135M-Instruct"
CASES = [
    ("/v1/chat/completions", {"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2**63}),
    ("/v1/chat/completions", {"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 1e308}),
    ("/v1/chat/completions", {"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "top_p": 0}),
    ("/v1/chat/completions", {"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "seed": -1}),
    ("/v1/chat/completions", {"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "seed": 2**70}),
    ("/v1/chat/completions", {"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logit_bias": {"99999999999": 5}}),
    ("/v1/chat/completions", {"model": M, "messages": [{"role": "user", "content": "\u0000\ud800"}], "max_tokens": 4}),
    ("/v1/chat/completions", {"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stop": [""]}),
    ("/v1/chat/completions", {"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 0}),
    ("/v1/chat/completions", {"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "mtplx": {"depth": 10**9}}),
    ("/v1/completions", {"model": M, "prompt": [[]], "max_tokens": 4}),
    ("/v1/completions", {"model": M, "prompt": [-1, 5], "max_tokens": 4}),
    ("/v1/completions", {"model": M, "prompt": "x", "max_tokens": 4, "logprobs": 10**6}),
    ("/v1/completions", {"model": M, "prompt": "x" * 200000, "max_tokens": 4}),
    ("/v1/messages", {"model": M, "max_tokens": 4, "messages": [{"role": "user", "content": []}]}),
    ("/v1/messages", {"model": M, "max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/messages", {"model": M, "max_tokens": 4, "messages": [{"role": "assistant", "content": "hi"}]}),
    ("/v1/messages", {"model": M, "max_tokens": 4, "system": [{"type": "image"}], "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"model": M, "input": [], "max_output_tokens": 4}),
    ("/v1/responses", {"model": M, "input": "hi", "max_output_tokens": -1}),
    ("/v1/responses", {"model": M, "input": [{"type": "function_call_output", "call_id": "x", "output": "y"}], "max_output_tokens": 4}),
    ("/v1/responses", {"model": M, "input": "hi", "max_output_tokens": 4, "previous_response_id": "resp_nope"}),
]

out = []
with httpx.Client(timeout=120) as client:
    for path, payload in CASES:
        try:
            r = client.post(BASE + path, content=json.dumps(payload),  # lone surrogates: \\u escapes
                            headers={"content-type": "application/json"})
            status, text = r.status_code, r.text[:160]
        except httpx.HTTPError as error:
            status, text = -1, repr(error)
        out.append({"path": path, "status": status, "body": text})
print(json.dumps(out, indent=1))
bad = [o for o in out if o["status"] >= 500 or o["status"] < 0]
print("5xx or transport errors:", len(bad), file=sys.stderr)
