import mtplx  # noqa
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.train.multi_draft import verify_costs
model = load(ensure_default_model())
for ctx in (60, 300):
    c = verify_costs(model, 5, context=ctx, repeats=9)
    print(ctx, {k: round(v * 1e3, 1) for k, v in c.items()}, {k: round(v / c[1], 3) for k, v in c.items()}, flush=True)
