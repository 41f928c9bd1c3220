"""Schema edges of the sampling fields on the four generation routes, sent as raw JSON text
(so NaN, Infinity and 1e309 reach the server as written): each case has the statuses it
may get; every error must be in its API's shape (OpenAI's, Anthropic's under
/v1/messages) with no backtrace; never 5xx. Prints one JSON object.

    python edges.py --port 8701 --key KEY
"""

from __future__ import annotations

import argparse
import json
import os
import time

import httpx

OK, BAD = (200,), (400,)

# field -> [(raw JSON text, expected statuses)]; a route lists the fields it has.
MAX_TOKENS = [
    ("0", BAD),
    ("-1", BAD),
    ("1000000000", BAD),
    ('"5"', BAD),
    ("true", BAD),
    ("1.0", BAD),
    ("1.5", BAD),
    ("1e9", BAD),
    ("1e309", BAD),
    ("NaN", BAD),
    ("9223372036854775808", BAD),
    ("18446744073709551616", BAD),
    ("1" + "0" * 400, BAD),
    ("1", OK),
    ("2", OK),
]
TEMPERATURE = [
    ("NaN", BAD),
    ("Infinity", BAD),
    ("-Infinity", BAD),
    ("1e309", BAD),
    ("-1e309", BAD),
    ("-0.0", OK),
    ("0", OK),
    ("1e-320", OK),
    ("2.0000001", BAD),
    ("-1e-320", BAD),
    ('"0.5"', BAD),
    ("true", BAD),
    ("null", OK),
    ("1" + "0" * 400, BAD),
]
TOP_P = [
    ("0", BAD),
    ("-0.0", BAD),
    ("5e-324", OK),
    ("1", OK),
    ("1.0000001", BAD),
    ("NaN", BAD),
    ("Infinity", BAD),
    ("1e-400", BAD),
    ("0.5", OK),
]
SEED = [
    ("0", OK),
    ("-1", BAD),
    ("9223372036854775807", (200, 400)),
    ("9223372036854775808", BAD),
    ("18446744073709551616", BAD),
    ("1" + "0" * 4000, BAD),
    ("-9223372036854775808", BAD),
    ("1.5", BAD),
    ('"1"', BAD),
    ("1e3", BAD),
]
LOGIT_BIAS = [
    ('{"0": 100}', OK),
    ('{"0": -100}', OK),
    ('{"0": 101}', (200, 400)),
    ('{"0": 1e309}', BAD),
    ('{"0": NaN}', BAD),
    ('{"0": -Infinity}', BAD),
    ('{"-1": 1}', BAD),
    ('{"49151": 5}', OK),
    ('{"49152": 1}', BAD),
    ('{"abc": 1}', BAD),
    ('{"1e3": 1}', BAD),
    ('{" 5": 1}', BAD),
    ('{"0x10": 1}', BAD),
    ('{"99999999999999999999": 1}', BAD),
    ('{"": 1}', BAD),
    ('{"2": 1e300}', (200, 400)),
    ('{"2": -1e300}', (200, 400)),
    ("[]", BAD),
    ('"x"', BAD),
]
PENALTY = [("NaN", BAD), ("2", OK), ("2.01", BAD), ("-2", OK), ("1e309", BAD)]
TOP_K = [
    ("-1", OK),
    ("0", OK),
    ("-2", BAD),
    ("49152", OK),
    ("1e309", BAD),
    ("1" + "0" * 30, (200, 400)),
]
MIN_P = [("NaN", BAD), ("0", OK), ("1", OK), ("1.01", BAD)]
REP = [("0", BAD), ("NaN", BAD), ("1e309", BAD), ("1e-300", (200, 400)), ("1e300", (200, 400))]
N = [("0", BAD), ("17", BAD), ("1000000000", BAD), ("2", OK), ("NaN", BAD)]
TOP_LOGPROBS = [("20", OK), ("21", BAD), ("-1", BAD), ("NaN", BAD)]

ROUTES = {
    "/v1/completions": (
        '{"model": M, "prompt": "Hello", "max_tokens": 2, FIELD}',
        {
            "max_tokens": MAX_TOKENS,
            "temperature": TEMPERATURE,
            "top_p": TOP_P,
            "seed": SEED,
            "logit_bias": LOGIT_BIAS,
            "presence_penalty": PENALTY,
            "frequency_penalty": PENALTY,
            "top_k": TOP_K,
            "min_p": MIN_P,
            "repetition_penalty": REP,
            "n": N,
            "logprobs": TOP_LOGPROBS,
        },
    ),
    "/v1/chat/completions": (
        '{"model": M, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, FIELD}',
        {
            "max_tokens": MAX_TOKENS,
            "max_completion_tokens": MAX_TOKENS,
            "temperature": TEMPERATURE,
            "top_p": TOP_P,
            "seed": SEED,
            "logit_bias": LOGIT_BIAS,
            "presence_penalty": PENALTY,
            "top_k": TOP_K,
            "min_p": MIN_P,
            "repetition_penalty": REP,
            "n": N,
        },
    ),
    "/v1/messages": (
        '{"model": M, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, FIELD}',
        {
            "max_tokens": MAX_TOKENS,
            "temperature": TEMPERATURE,
            "top_p": TOP_P,
            "top_k": [("0", OK), ("-1", BAD), ("NaN", BAD), ("1e309", BAD)],
        },
    ),
    "/v1/responses": (
        '{"model": M, "input": "Hi", "max_output_tokens": 2, FIELD}',
        {"max_output_tokens": MAX_TOKENS, "temperature": TEMPERATURE, "top_p": TOP_P},
    ),
}


def shape_ok(route: str, status: int, body: object) -> bool:
    """Whether an error body has its API's shape."""
    if status == 200:
        return True
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return False
    error = body["error"]
    if route == "/v1/messages":
        return body.get("type") == "error" and {"type", "message"} <= error.keys()
    return {"message", "type", "param", "code"} <= error.keys()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=8701)
    p.add_argument("--key", required=True)
    args = p.parse_args()
    client = httpx.Client(
        base_url=f"http://127.0.0.1:{args.port}",
        timeout=120,
        headers={"Authorization": f"Bearer {args.key}", "Content-Type": "application/json"},
    )
    model = client.get("/v1/models").json()["data"][0]["id"]
    results, failures = [], []
    for route, (template, fields) in ROUTES.items():
        for field, cases in fields.items():
            for raw, expected in cases:
                # max_tokens set twice would be a duplicate key: replace the default one.
                text = template.replace("M", json.dumps(model), 1)
                if field in ("max_tokens", "max_output_tokens") and f'"{field}": 2' in text:
                    text = text.replace(f'"{field}": 2', f'"{field}": {raw}')
                    text = text.replace(", FIELD", "")
                elif field == "max_completion_tokens":  # instead of max_tokens, not beside it
                    text = text.replace('"max_tokens": 2', f'"{field}": {raw}')
                    text = text.replace(", FIELD", "")
                else:
                    extra = f'"{field}": {raw}'
                    if field == "logprobs" and route == "/v1/chat/completions":
                        extra = f'"logprobs": true, "top_logprobs": {raw}'
                    text = text.replace("FIELD", extra)
                start = time.monotonic()
                try:
                    r = client.post(route, content=text)
                except httpx.HTTPError as exc:
                    failures.append(
                        {
                            "route": route,
                            "field": field,
                            "value": raw[:40],
                            "problems": [type(exc).__name__],
                        }
                    )
                    continue
                seconds = round(time.monotonic() - start, 3)
                try:
                    body = r.json()
                except ValueError:
                    body = r.text[:200]
                case = {
                    "route": route,
                    "field": field,
                    "value": raw[:40],
                    "status": r.status_code,
                    "seconds": seconds,
                }
                if r.status_code != 200:
                    case["error"] = body.get("error") if isinstance(body, dict) else body
                problems = []
                if r.status_code not in expected:
                    problems.append(f"status {r.status_code} not in {expected}")
                if r.status_code >= 500:
                    problems.append("5xx")
                if not shape_ok(route, r.status_code, body):
                    problems.append("error shape")
                if "Traceback" in r.text or 'File "' in r.text:
                    problems.append("backtrace")
                results.append(case)
                if problems:
                    failures.append({**case, "problems": problems})
    after = client.post(
        "/v1/chat/completions",
        json={"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
    )
    print(
        json.dumps(
            {
                "load_avg": os.getloadavg(),
                "cases": len(results),
                "failures": failures,
                "chat_after": after.status_code,
                "results": results,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
