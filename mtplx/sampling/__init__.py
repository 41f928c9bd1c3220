"""Exact speculative sampling: the target/draft distributions and the accept / recover / bonus
rule, in three modules, each the twin of the one before it.

Glossary (docs/architecture.md):

- draft tokens: proposed by a drafter, each with its proposal distribution q.
- target distribution p: the target model's next-token distribution after the request's
  penalties, logit bias, temperature and top-k / top-p / min-p filtering
  (``mtplx.request.SamplerConfig`` holds those settings).
- accepted: a draft token x that passed ``u < min(1, p(x) / q(x))`` for a uniform u.
- recovered: the token sampled from the residual ``max(p - q, 0)`` (normalised) at the first
  rejected position.
- bonus: the token sampled from p at position K+1 when all K draft tokens were accepted.
- acceptance length: tokens committed per verify forward (accepted + 1).

The output marginal of one position is ``min(p, q) + (1 - sum(min(p, q))) * residual = p``,
so speculative decoding emits exactly what plain decoding of the target would.

- ``reference``: the plain NumPy statement of the math, one position or one row at a time,
  and the exact oracle ``speculative_output_marginal``.
- ``mlx_ops``: the vectorised MLX twins (``mx_*``) of the references, over a batch.
- ``fast_path``: what the engine calls (``distribution``, ``sample``, ``sample_logits``,
  ``verify_sampled_row``): C nodes with the MLX twins' bits on the CPU, the MLX twins
  elsewhere.

This package's own namespace holds nothing: import from the module that defines a name.
"""
