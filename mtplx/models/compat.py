"""Checks that two loaded checkpoints can work together (a target and its draft model)."""

from __future__ import annotations

from mtplx.models.base import LoadedModel


def _vocab(tokenizer: object) -> dict[str, int]:
    get_vocab = getattr(tokenizer, "get_vocab", None)
    return dict(get_vocab()) if callable(get_vocab) else {}


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Raise ValueError unless ``draft`` proposes tokens in ``target``'s vocabulary: the same
    model vocabulary size and the same tokenizer (token -> id map and special tokens)."""
    t_size, d_size = target.target.vocab_size, draft.target.vocab_size
    if t_size != d_size:
        raise ValueError(
            f"vocab size mismatch: target {target.path} has vocab_size {t_size}, "
            f"draft {draft.path} has vocab_size {d_size}"
        )
    t_vocab, d_vocab = _vocab(target.tokenizer), _vocab(draft.tokenizer)
    if t_vocab != d_vocab:
        differing = sorted(
            token
            for token in set(t_vocab) | set(d_vocab)
            if t_vocab.get(token) != d_vocab.get(token)
        )
        raise ValueError(
            f"tokenizer mismatch between target {target.path} and draft {draft.path}: "
            f"{len(differing)} tokens differ (e.g. {differing[:3]!r})"
        )
    if target.eos_token_ids != draft.eos_token_ids:
        raise ValueError(
            f"tokenizer mismatch: target eos ids {sorted(target.eos_token_ids)} != "
            f"draft eos ids {sorted(draft.eos_token_ids)}"
        )
