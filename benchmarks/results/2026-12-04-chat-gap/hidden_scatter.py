"""The prefix cache's per-step hidden-state store, alone: a one-row scatter into a
[16, capacity, 576] float32 store, evaluated each time (median ms of 200)."""

import time, mlx.core as mx

for cap in (256, 1024):
    store = mx.zeros((16, cap, 576))
    mx.eval(store)
    h = mx.random.normal((1, 576))
    mx.eval(h)
    ts = []
    for i in range(200):
        t = time.perf_counter()
        flat = store.reshape(16 * cap, -1)
        flat[mx.array([i % cap], mx.int32)] = h[mx.array([0], mx.int32)]
        store = flat.reshape(store.shape)
        mx.eval(store)
        ts.append(time.perf_counter() - t)
    ts.sort()
    print(cap, "median ms", round(1e3 * ts[100], 3), "MB", 16 * cap * 576 * 4 / 1e6)
