"""Position-1 acceptance vs the head's confidence (max softmax over its logits), T=0."""
import json, sys
import numpy as np
import mtplx  # noqa
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.sampling import SamplerConfig
from mtplx.bench.prompts import encode_prompt
from mtplx.train.multi_draft import plain_answer, position_one_distributions
from mtplx.train.compare import prompt_messages
from mtplx.train.data import chat_prompt_ids

model = load(ensure_default_model())
cfg = SamplerConfig(temperature=0.0)
sets = {
    "more-chat": [encode_prompt(model.tokenizer, json.loads(l)["prompt"]) for l in open("benchmarks/prompts-more/chat.jsonl")],
    "benchmarks": [chat_prompt_ids(model.tokenizer, t, h) for t, h in prompt_messages("benchmarks", 12)],
}
out = {}
for name, prompts in sets.items():
    acc, conf = [], []
    for prompt in prompts:
        tokens = plain_answer(model, prompt, cfg, 96)
        p, q, scores = position_one_distributions(model, tokens, len(prompt), cfg)
        s = scores - scores.max(axis=1, keepdims=True)
        e = np.exp(s); sm = e / e.sum(axis=1, keepdims=True)
        acc += list((scores.argmax(1) == p.argmax(1)).astype(float)); conf += list(sm.max(1))
    acc, conf = np.array(acc), np.array(conf)
    out[name] = {"acc": acc.tolist(), "conf": conf.tolist()}
    print(name, len(acc), "acceptance %.3f" % acc.mean())
    for tau in (0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6):
        m = conf >= tau; f = m.mean(); a = acc[m].mean() if m.any() else 0
        for cv, ch in ((0.14, 0.075),):
            gated = (1 + f * a) / (1 + f * cv + ch); plain_head = (1 + f*a) / (1 + f*(cv+ch))
            print(f"  tau {tau:.1f}: drafted {f:.2f}, acc among drafted {a:.3f}, model speed gated(head always) {gated:.3f} / ungated {(1+acc.mean())/(1+cv+ch):.3f} / gated(free head) {plain_head:.3f}")
json.dump(out, open("/work/runs/s10/gate.json", "w"))
