"""``mtplx bench``: paired, interleaved decoding benchmarks of every drafter against plain
decoding and against mlx-lm's own plain and speculative decoding, on one model.

Modules: ``stats`` (medians, spreads, paired speedups), ``prompts`` (the shipped prompt
sets), ``backends`` (timing our engine and mlx-lm), ``runner`` (the loop), ``report``
(JSON / Markdown / PNG), ``cli`` (the subcommand). Importing this package does not import
MLX; ``cli.bench`` does, lazily.
"""
