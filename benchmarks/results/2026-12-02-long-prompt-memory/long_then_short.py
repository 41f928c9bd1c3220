"""Live server: decode speed of short chat requests before and after one long prompt, and the
server's RSS. Usage: python long_then_short.py PORT PID (run from the repository root)."""
import json, statistics, sys, time
from pathlib import Path

from openai import OpenAI

port, pid = int(sys.argv[1]), int(sys.argv[2])
client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
MODEL = client.models.list().data[0].id
prompts = [json.loads(l)["prompt"] for l in open(Path(__file__).parents[2] / "prompts-more" / "chat.jsonl")][:3]


def rss() -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return 0.0


def decode_rate(prompt: str) -> float:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}],
        max_tokens=64, temperature=0, stream=True, extra_body={"mtplx": {"depth": 0}, "ignore_eos": True},
    )
    times = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0])


def phase(name: str) -> None:
    rates = [decode_rate(p) for p in prompts for _ in range(2)]
    print(f"{name}: decode tok/s median {statistics.median(rates):.2f} (min {min(rates):.2f} max {max(rates):.2f}); RSS {rss():.0f} MiB", flush=True)


phase("fresh")
words = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex "
         "jovial bankers near old mills ").split()
long_text = " ".join(words[i % len(words)] + str(i % 97) for i in range(1100))
started = time.perf_counter()
r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_text}], max_tokens=1)
print(f"long prompt: {r.usage.prompt_tokens} tokens, {time.perf_counter() - started:.1f} s; RSS {rss():.0f} MiB", flush=True)
time.sleep(1)
phase("after the long prompt")
