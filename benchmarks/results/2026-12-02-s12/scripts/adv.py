"""Disconnects and mixed rows while MTP cycles run one step ahead; then greedy == plain."""
import asyncio, json, random
import httpx
URL = "http://127.0.0.1:8017/v1/chat/completions"
MODEL = "SmolLM2-135M-Instruct"
def body(i, **kw):
    b = {"model": MODEL, "messages": [{"role": "user", "content": f"Tell me about topic number {i}, briefly."}],
         "max_tokens": 80, "temperature": 0.0 if i % 2 else 0.8, "stream": True}
    b.update(kw); return b
async def stream(client, b, cut_after=None):
    n = 0
    async with client.stream("POST", URL, json=b) as r:
        assert r.status_code == 200, r.status_code
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                n += 1
                if cut_after is not None and n >= cut_after:
                    return ("cut", n)
    return ("done", n)
async def main():
    async with httpx.AsyncClient(timeout=300) as client:
        tasks = []
        for i in range(12):
            extra = {"mtplx": {"drafter": "mtp", "depth": 1 + i % 3}} if i % 3 else {}
            if i % 4 == 0: extra["frequency_penalty"] = 0.5
            tasks.append(stream(client, body(i, **extra), cut_after=(5 + i) if i % 2 == 0 else None))
        res = await asyncio.gather(*tasks, return_exceptions=True)
        print(res)
        # greedy equality after the storm
        texts = []
        for extra in ({"mtplx": {"depth": 0}}, {"mtplx": {"drafter": "mtp", "depth": 2}}, {}):
            b = body(1, stream=False, **extra)
            r = await client.post(URL, json=b); r.raise_for_status()
            texts.append(r.json()["choices"][0]["message"]["content"])
        print("greedy same text:", texts[0] == texts[1] == texts[2])
        h = await client.get("http://127.0.0.1:8017/health"); print("health", h.status_code)
asyncio.run(main())
