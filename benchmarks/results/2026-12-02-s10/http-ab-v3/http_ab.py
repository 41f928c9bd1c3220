"""A/B over HTTP with the openai client: the server's default (adaptive mtp+ngram) vs plain
decoding (mtplx.depth 0) on fresh ordinary chat prompts, alternating order per pair."""
import json, statistics, sys, time
from openai import OpenAI

PROMPTS = [
    "What should I pack for a three-day hiking trip in the mountains?",
    "Can you explain how a refrigerator keeps food cold?",
    "Give me some tips for staying focused while working from home.",
    "Why do leaves change color in the autumn?",
    "How do I politely decline an invitation to a party?",
    "What is the difference between a virus and a bacterium?",
    "Suggest a simple dinner I can cook with eggs, spinach and cheese.",
    "How does compound interest work? Give a small example.",
    "What are some good ways to make new friends after moving to a new city?",
    "Explain what a black hole is in simple terms.",
    "My tomato plants have yellow leaves. What could be wrong?",
    "Write a short thank-you note to a teacher who helped me this year.",
]
url, out, reps, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
client = OpenAI(base_url=url + "/v1", api_key="x")
records = []
for temp in (0.0, 0.6):
    for rep in range(reps):
        for i, prompt in enumerate(PROMPTS):
            modes = ["plain", "default"] if (rep + i) % 2 == 0 else ["default", "plain"]
            for mode in modes:
                extra = {"mtplx": {"depth": 0}} if mode == "plain" else {}
                if temp > 0:
                    extra["seed"] = 1000 * rep + i
                t0 = time.perf_counter(); first = last = None; chunks = 0; usage = mt = None
                stream = client.chat.completions.create(
                    model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": prompt}],
                    max_tokens=max_tokens, temperature=temp, stream=True,
                    stream_options={"include_usage": True}, extra_body=extra)
                for chunk in stream:
                    d = chunk.model_dump()
                    if chunk.choices and chunk.choices[0].delta.content:
                        now = time.perf_counter(); first = first or now; last = now; chunks += 1
                    if chunk.usage:
                        usage = chunk.usage.completion_tokens
                        mt = d.get("mtplx") or (d.get("usage") or {}).get("mtplx")
                rec = dict(temp=temp, rep=rep, prompt=i, mode=mode, tokens=usage, ttft=first - t0,
                           decode_tps=(usage - 1) / (last - first) if usage > 1 and last > first else None, mtplx=mt)
                records.append(rec)
                print(json.dumps(rec), flush=True)
json.dump(records, open(out, "w"))
