"""Grammar bars against a local server with an API key (loopback only): 16 unsatisfiable
regexes and 16 ``{"$ref": "#"}`` schemas then a normal chat; a 1,000-deep ``$defs`` chain
and a 5,000-rule Lark chain; a 2.4 MB grammar with /health watched; no backtrace in any
reply. Prints one JSON object.

    python grammar_bars.py --port 8130 --key KEY --pid SERVER_PID
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import threading
import time

import httpx

MARKERS = ("backtrace", "panicked", "stack backtrace", "rust_begin_unwind", "src/", ".rs:")


def watch(url: str, stop: threading.Event, samples: list[float]) -> None:
    while not stop.is_set():
        start = time.monotonic()
        with contextlib.suppress(httpx.HTTPError):
            httpx.get(f"{url}/health", timeout=30)
        samples.append(time.monotonic() - start)
        time.sleep(0.1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=8130)
    p.add_argument("--key", required=True)
    p.add_argument("--pid", type=int, required=True)
    args = p.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {args.key}"},
                          timeout=300)  # fmt: skip
    model = client.get("/v1/models").json()["data"][0]["id"]
    hi = [{"role": "user", "content": "hi"}]
    out: dict = {"load_avg": os.getloadavg()}
    backtraces: list[str] = []

    def post(body: dict) -> tuple[httpx.Response, float]:
        start = time.monotonic()
        r = client.post("/v1/chat/completions", json={"model": model, "messages": hi, **body})
        if any(marker in r.text for marker in MARKERS):
            backtraces.append(r.text[:300])
        return r, round(time.monotonic() - start, 3)

    def summary(r: httpx.Response, seconds: float) -> dict:
        error = r.json().get("error") if r.status_code != 200 else None
        return {"status": r.status_code, "seconds": seconds, "code": error and error.get("code"),
                "message": error and error["message"][:160]}  # fmt: skip

    statuses = []
    for _ in range(16):
        r, _s = post({"max_tokens": 4, "mtplx": {"regex": "[^\\s\\S]"}})
        statuses.append(r.status_code)
    out["unsat_regex_x16"] = sorted(set(statuses))
    statuses = []
    for _ in range(16):
        r, _s = post({"max_tokens": 4, "response_format": {"type": "json_schema",
                      "json_schema": {"name": "x", "schema": {"$ref": "#"}}}})  # fmt: skip
        statuses.append(r.status_code)
    out["ref_root_x16"] = sorted(set(statuses))
    out["chat_after_32"] = summary(*post({"max_tokens": 4}))
    out["health_after_32"] = client.get("/health").json()["status"]

    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(999)}
    defs["d999"] = {"type": "string"}
    schema = {"$ref": "#/$defs/d0", "$defs": defs}
    out["defs_chain_1000"] = summary(*post({"max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}))  # fmt: skip
    lark = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(4999)) + 'r4999: "a"\n'
    out["lark_chain_5000"] = summary(*post({"max_tokens": 4, "mtplx": {"grammar": lark}}))
    out["alive_after_chains"] = os.path.exists(f"/proc/{args.pid}")

    stop, samples = threading.Event(), []
    watcher = threading.Thread(target=watch, args=(url, stop, samples))
    watcher.start()
    big = "start: " + " | ".join(f'"t{i}"' for i in range(200_000))
    out["grammar_bytes"] = len(big)
    out["grammar_2.4MB"] = summary(*post({"max_tokens": 4, "mtplx": {"grammar": big}}))
    # Just under the size cap: the subprocess check must bound it in time.
    under = "start: " + " | ".join(f'"t{i}"' for i in range(23_500))
    out["grammar_under_cap_bytes"] = len(under)
    out["grammar_under_cap"] = summary(*post({"max_tokens": 4, "mtplx": {"grammar": under}}))
    regex = "|".join(f"w{i}" for i in range(40_000))[:262_000]
    out["regex_under_cap"] = summary(*post({"max_tokens": 4, "mtplx": {"regex": regex}}))
    enum = {"type": "string", "enum": [f"v{i}" for i in range(27_000)]}
    out["enum_30k"] = summary(*post({"max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": enum}}}))  # fmt: skip
    stop.set()
    watcher.join()
    out["health_max_s_during_big_grammars"] = round(max(samples), 3)
    out["health_probes"] = len(samples)
    out["chat_at_end"] = summary(*post({"max_tokens": 4}))
    out["backtraces_in_replies"] = backtraces
    out["alive_at_end"] = os.path.exists(f"/proc/{args.pid}")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
