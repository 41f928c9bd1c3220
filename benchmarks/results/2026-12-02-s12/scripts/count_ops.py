import mtplx, re, collections
import mlx.core as mx
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.models.batched import batched_target
model = load(ensure_default_model())
bt = batched_target(model.target, 16)
row = bt.new_row()
o = bt.forward([row], [mx.array(list(range(5, 105)), mx.int32)], "last"); mx.eval(o[0].logits)
o = bt.forward([row], [mx.array([7], mx.int32)], "all")
mx.export_to_dot("/tmp/fwd.dot", o[0].logits)
txt = open("/tmp/fwd.dot").read()
labels = re.findall(r'label ="?([A-Za-z_]+)', txt) or re.findall(r'label="([^"]+)"', txt)
c = collections.Counter(l.split()[0] for l in labels)
print(sum(c.values()), c.most_common(40))
