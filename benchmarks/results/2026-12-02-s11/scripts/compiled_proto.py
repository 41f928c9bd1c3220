"""Prototype: SlotTarget forward with compiled layer halves and a compiled attention core over
the store's whole capacity. Bitwise comparison with the current forward, and build/eval time."""
import time, statistics, copy
import mtplx  # noqa
import mlx.core as mx
from mlx_lm.models.activations import swiglu
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.models import batched as B

class Compiled(B.SlotTarget):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        attn = self.trunk.inner.layers[0].self_attn
        heads, kvh = attn.n_heads, attn.n_kv_heads
        rep = heads // kvh
        f0 = self._fused[0]
        q_end = f0.q_size + f0.kv_size
        I = f0.intermediate
        rope = attn.rope
        def pre(x, norm_w, qkv_w, positions, eps):
            h = mx.fast.rms_norm(x, norm_w, eps)
            qkv = (h @ qkv_w.T)[0]
            n = qkv.shape[0]
            roped = rope(qkv[:, :q_end].reshape(n, heads + kvh, 1, -1), offset=positions)
            return roped[:, :heads], roped[:, heads:], qkv[:, q_end:].reshape(n, kvh, 1, -1)
        def core(queries, all_keys, all_values, visible, scale):
            R, _, T, d = queries.shape
            C = all_keys.shape[-1]
            grouped = (queries * scale).reshape(R, kvh, rep * T, d)
            scores = (grouped @ all_keys).reshape(R, kvh, rep, T, C)
            scores = mx.where(visible, scores, -mx.inf)
            weights = mx.exp(scores - mx.max(scores, axis=-1, keepdims=True)).reshape(R, kvh, rep * T, C)
            summed = weights @ all_values
            attended = summed[..., :d] / summed[..., d:]
            return attended.reshape(R, heads, T, d).transpose(0, 2, 1, 3).reshape(R * T, heads * d)
        def post(x, attended, o_w, norm_w, gate_up, down, eps):
            x = x + attended[None] @ o_w.T
            h = mx.fast.rms_norm(x, norm_w, eps)
            gu = h @ gate_up.T
            return x + swiglu(gu[..., :I], gu[..., I:]) @ down.T
        self._pre, self._core, self._post = mx.compile(pre), mx.compile(core), mx.compile(post)

    def _layers(self, x, groups, positions):
        if any(g.max_tokens > self._query_block for g in groups):
            return super()._layers(x, groups, positions)
        cap = self._capacity
        for layer, store, fused in zip(self.trunk.inner.layers, self._stores, self._fused, strict=True):
            attn = layer.self_attn
            ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
            q_all, k_all, v_all = self._pre(x, ln1.weight, fused.qkv, positions, ln1.eps)
            outs = []
            for group in groups:
                rows, tokens = group.num_slots, group.max_tokens
                def padded(p, nh):
                    return p[group.to_padded].reshape(rows, tokens, nh, -1).transpose(0, 2, 1, 3)
                keys = padded(k_all, attn.n_kv_heads)
                values = padded(v_all, attn.n_kv_heads)
                values = mx.concatenate([values, mx.ones((*values.shape[:-1], 1), values.dtype)], -1)
                for name, new in (("keys", keys), ("values", values)):
                    stored = getattr(store, name)
                    width = stored.shape[-1]
                    flat = stored.reshape(-1, width)
                    flat[group.write_at] = new.reshape(-1, width)
                    setattr(store, name, flat.reshape(stored.shape))
                window = slice(group.first_slot, group.first_slot + rows)
                all_keys = store.keys[window].transpose(0, 1, 3, 2)
                all_values = store.values[window]
                visible = group.wide_mask
                out = self._core(padded(q_all, attn.n_heads), all_keys, all_values, visible, attn.scale)
                outs.append(out[group.to_packed])
            attended = mx.concatenate(outs) if len(outs) > 1 else outs[0]
            x = self._post(x, attended, attn.o_proj.weight, ln2.weight, fused.gate_up, layer.mlp.down_proj.weight, ln2.eps)
        return x

    def _group(self, rows, counts, start):
        g = super()._group(rows, counts, start)
        T = g.max_tokens
        query_end = g.offsets[:, None] + mx.arange(T)[None, :]
        g.wide_mask = (mx.arange(self._capacity)[None, None, :] <= query_end[:, :, None])[:, None, None]
        return g

model = load(ensure_default_model())
ref = B.SlotTarget(model.target, 16)
new = Compiled(model.target, 16)
import random
random.seed(0)
def run(bt, plan):
    rows = [bt.new_row() for _ in range(3)]
    outs = []
    for step in plan:
        feed = [(rows[i], mx.array(t, mx.int32)) for i, t in step]
        o = bt.forward([r for r, _ in feed], [t for _, t in feed], "all")
        mx.eval([x.logits for x in o])
        outs.append([x.logits for x in o])
    for r in rows: bt.release(r)
    return outs
plan = [[(0, list(range(5, 37)))], [(1, list(range(40, 80)))], [(0, [3]), (1, [4, 5])], [(0, [6, 7, 8]), (1, [9]), (2, list(range(7, 20)))], [(2, [1, 2])], [(0, [11]), (1, [12]), (2, [13, 14, 15, 16, 17])]]
# note: _group for wide masks needs capacity known before the mask: ensure capacity early
for bt in (ref, new): bt._ensure_capacity(256)
r = run(ref, plan); n = run(new, plan)
same = all(bool(mx.array_equal(a, b).item()) for sa, sb in zip(r, n) for a, b in zip(sa, sb))
print("bitwise equal:", same)
# timing: one row, 100-token prompt, then 1- and 2-token forwards
for name, bt in (("ref", ref), ("new", new)):
    row = bt.new_row()
    o = bt.forward([row], [mx.array([(7 + i % 50) for i in range(100)], mx.int32)], "last"); mx.eval(o[0].logits)
    for n_tok in (1, 2, 1, 2):
        bs, es = [], []
        for i in range(25):
            toks = mx.array([11 + (i + j) % 40 for j in range(n_tok)], mx.int32)
            t0 = time.perf_counter(); o = bt.forward([row], [toks], "all"); t1 = time.perf_counter(); mx.eval(o[0].logits); t2 = time.perf_counter()
            bs.append(t1 - t0); es.append(t2 - t1); bt.trim(row, n_tok)
        print(name, n_tok, "build %.1f eval %.1f total %.1f" % (statistics.median(bs) * 1e3, statistics.median(es) * 1e3, statistics.median([a + b for a, b in zip(bs, es)]) * 1e3), flush=True)
    bt.release(row)
