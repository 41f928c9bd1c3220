"""Bars of the batching issue against a live server: greedy/seeded equality solo vs 8
concurrent for every drafter; TTFT of a short request while 7 streams run."""
import asyncio, json, statistics, sys, time
import httpx
from mtplx.bench.serve_bench import admission_gaps

URL = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"
PROMPTS = ["What is the capital of France?", "Write a Python function that checks whether a number is prime.",
           "Repeat exactly: the cat sat on the mat, and the dog sat on the log.", "Explain why the sky is blue in two sentences.",
           "List three tips for a good night's sleep.", "Write a haiku about autumn leaves.",
           "Repeat this list: apples, pears, plums, apples, pears, plums.", "Name the planets of the solar system."]

async def chat(client, model, prompt, extra):
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 48, **extra}
    r = await client.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]

async def main():
    async with httpx.AsyncClient(base_url=URL, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        results = {}
        configs = [("none", 0, {"temperature": 0}), ("ngram", 3, {"temperature": 0}), ("mtp", 2, {"temperature": 0}),
                   ("mtp+ngram", None, {"temperature": 0}), ("mtp", 2, {"temperature": 0.8, "top_p": 0.95, "seed": 11}),
                   ("ngram", 3, {"temperature": 0.7, "seed": 5}), ("none", 0, {"temperature": 0.9, "seed": 7})]
        for drafter, depth, sampler in configs:
            extra = {**sampler, "mtplx": {"drafter": drafter, "depth": depth}}
            solo = [await chat(client, model, p, extra) for p in PROMPTS]
            together = await asyncio.gather(*(chat(client, model, p, extra) for p in PROMPTS))
            same = sum(a == b for a, b in zip(solo, together))
            key = f"{drafter} depth={depth} {sampler}"
            results[key] = f"{same}/8 identical"
            print(key, results[key], flush=True)
        ttfts = []
        for _ in range(5):
            res = await admission_gaps(client, model, streams=7, prompt_tokens=30, max_tokens=200, settle_s=1.0)
            ttfts.append(res.long_ttft_s)
        print("short-prompt TTFT with 7 streams running:", [round(t, 2) for t in ttfts], "median", round(statistics.median(ttfts), 2), flush=True)
        results["ttft_short_with_7_streams_s"] = ttfts
        json.dump(results, open("/work/runs/bars.json", "w"), indent=1)

asyncio.run(main())
