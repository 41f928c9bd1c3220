"""Speculation under churn: 16 workers against a server with the default drafter, each
sending a random mix of greedy chats (streamed or not), seeded T=0.8 chats, streams cut
at a random line, n=2, logprobs, stop sequences, max_tokens 1 and 2, JSON-mode rows and
completions. Greedy replies (and what derives from them: stop, max_tokens 1 / 2, n=2,
JSON mode) must equal a plain server's (``--ref-port``, started with ``--drafter none``)
for the same prompt, sent there one at a time. No 5xx, no hang (client timeout). Prints
one JSON object.

    python spec_churn.py --port 8701 --ref-port 8702 --key KEY --pid SERVER_PID
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time

import httpx

PROMPTS = [
    "Name three rivers of Europe and one fact about each.",
    "Write a short poem about the sea.",
    "Explain what a binary search does, step by step.",
    "List the planets of the solar system in order.",
    "def fibonacci(n):\n    # complete this Python function",
    "What is the capital of France? Answer in one sentence.",
    "Give me a recipe for pancakes.",
    "Translate 'good morning, my friend' into French and Spanish.",
]
MAX_TOKENS = 48


def chat(url: str, key: str, body: dict, timeout: float = 300) -> tuple[int, dict | str]:
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json=body,
        timeout=timeout,
        headers={"Authorization": f"Bearer {key}"},
    )
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text[:300]


def stream_text(url: str, key: str, body: dict, cut_after: int | None) -> tuple[int, str, bool]:
    """(status, content, ended with [DONE]); ``cut_after``: close after that many lines."""
    text, done, lines = [], False, 0
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json=body,
        timeout=300,
        headers={"Authorization": f"Bearer {key}"},
    ) as r:
        for line in r.iter_lines():
            lines += 1
            if cut_after is not None and lines >= cut_after:
                return r.status_code, "".join(text), False
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                if data.get("choices"):
                    text.append(data["choices"][0]["delta"].get("content") or "")
    return r.status_code, "".join(text), done


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=8701)
    p.add_argument("--ref-port", type=int, default=8702)
    p.add_argument("--key", required=True)
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--per-worker", type=int, default=6)
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()
    url, ref = f"http://127.0.0.1:{args.port}", f"http://127.0.0.1:{args.ref_port}"
    model = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {args.key}"}).json()[
        "data"
    ][0]["id"]
    out: dict = {"load_avg_start": os.getloadavg()}

    def body(prompt: str, **extra: object) -> dict:
        return {
            "model": model,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "messages": [{"role": "user", "content": prompt}],
            **extra,
        }

    json_mode = {"response_format": {"type": "json_object"}}
    reference, reference_json = {}, {}
    for prompt in PROMPTS:  # one at a time on the plain server
        reference[prompt] = chat(ref, args.key, body(prompt))[1]["choices"][0]["message"]["content"]
        reference_json[prompt] = chat(ref, args.key, body(prompt, **json_mode))[1]["choices"][0][
            "message"
        ]["content"]

    kinds = [
        "greedy",
        "greedy_stream",
        "seeded",
        "cut",
        "n2",
        "logprobs",
        "stop",
        "max1",
        "max2",
        "json",
        "completions",
    ]
    records: list[dict] = []
    lock = threading.Lock()

    def worker(number: int) -> None:
        rng = random.Random(args.seed * 1000 + number)
        for _ in range(args.per_worker):
            kind, prompt = rng.choice(kinds), rng.choice(PROMPTS)
            expected = reference[prompt]
            rec: dict = {"kind": kind, "prompt": PROMPTS.index(prompt)}
            start = time.monotonic()
            try:
                if kind == "greedy":
                    status, data = chat(url, args.key, body(prompt))
                    got = data["choices"][0]["message"]["content"] if status == 200 else None
                    rec["equal"] = got == expected
                elif kind == "greedy_stream":
                    status, got, done = stream_text(url, args.key, body(prompt, stream=True), None)
                    rec["equal"], rec["done"] = got == expected, done
                elif kind == "seeded":
                    status, data = chat(
                        url, args.key, body(prompt, temperature=0.8, seed=rng.randrange(1 << 31))
                    )
                elif kind == "cut":
                    temperature = rng.choice([0, 0.8])
                    status, _, _ = stream_text(
                        url,
                        args.key,
                        body(prompt, stream=True, temperature=temperature),
                        rng.randint(1, 12),
                    )
                elif kind == "n2":
                    status, data = chat(url, args.key, body(prompt, n=2))
                    got = (
                        [c["message"]["content"] for c in data["choices"]]
                        if status == 200
                        else None
                    )
                    rec["equal"] = got == [expected, expected]
                elif kind == "logprobs":
                    status, data = chat(url, args.key, body(prompt, logprobs=True, top_logprobs=3))
                    if status == 200:
                        choice = data["choices"][0]
                        rec["equal"] = choice["message"]["content"] == expected
                        values = [t["logprob"] for t in choice["logprobs"]["content"]]
                        rec["logprobs_ok"] = all(v <= 0 and v > -1e30 for v in values)
                elif kind == "stop":
                    words = expected.split()
                    stop = words[len(words) // 2] if len(words) > 2 else "zzz"
                    status, data = chat(url, args.key, body(prompt, stop=[stop]))
                    got = data["choices"][0]["message"]["content"] if status == 200 else None
                    rec["equal"] = got == expected.split(stop)[0]
                    rec["stop"] = stop
                elif kind in ("max1", "max2"):
                    status, data = chat(url, args.key, body(prompt, max_tokens=int(kind[-1])))
                    got = data["choices"][0]["message"]["content"] if status == 200 else None
                    rec["equal"] = got is not None and expected.startswith(got) and bool(got)
                elif kind == "json":
                    status, data = chat(url, args.key, body(prompt, **json_mode))
                    got = data["choices"][0]["message"]["content"] if status == 200 else None
                    rec["equal"] = got == reference_json[prompt]
                else:
                    r = httpx.post(
                        f"{url}/v1/completions",
                        timeout=300,
                        json={
                            "model": model,
                            "prompt": prompt,
                            "max_tokens": 16,
                            "logprobs": 2,
                            "temperature": rng.choice([0, 0.8]),
                            "seed": 5,
                        },
                        headers={"Authorization": f"Bearer {args.key}"},
                    )
                    status = r.status_code
                rec["status"] = status
            except (httpx.HTTPError, KeyError, ValueError) as exc:
                rec["exception"] = f"{type(exc).__name__}: {exc}"[:200]
            rec["seconds"] = round(time.monotonic() - start, 2)
            with lock:
                records.append(rec)

    started = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["seconds"] = round(time.monotonic() - started, 1)
    health = httpx.get(f"{url}/health").json()
    final = chat(url, args.key, body(PROMPTS[0]))[1]["choices"][0]["message"]["content"]
    out.update(
        requests=len(records),
        statuses={
            str(s): sum(1 for r in records if r.get("status") == s)
            for s in sorted({r.get("status") for r in records}, key=str)
        },
        exceptions=[r for r in records if "exception" in r],
        not_equal=[r for r in records if r.get("equal") is False],
        compared=sum(1 for r in records if "equal" in r),
        bad_logprobs=[r for r in records if r.get("logprobs_ok") is False],
        batch_after=health["batch"],
        requests_after=health["requests"],
        final_greedy_equal=final == reference[PROMPTS[0]],
        load_avg_end=os.getloadavg(),
        records=records,
    )
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
