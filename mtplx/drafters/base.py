"""The Drafter protocol and the draft sampler every drafter draws its tokens with."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Protocol, cast

import mlx.core as mx
import numpy as np

from mtplx import fused_layer
from mtplx.arrays import scalar_int
from mtplx.request import SamplerConfig
from mtplx.sampling.fast_path import distribution, sample

if TYPE_CHECKING:
    from mtplx.grammar import GrammarState


@functools.lru_cache(maxsize=4)
def _vocab_ids(size: int) -> mx.array:
    """[size] int32 0 .. size - 1, evaluated: a constant of a greedy draft's q."""
    ids = mx.arange(size, dtype=mx.int32)
    mx.eval(ids)
    return ids


def _flat(logits: mx.array) -> mx.array:
    """[V] logits as given, others reshaped (a node only where the shape changes)."""
    return logits if logits.ndim == 1 else logits.reshape(-1)


class DraftSampler:
    """Draws the draft tokens of one cycle and records q, the distribution each was drawn from.

    The same sampler settings as the target (temperature, penalties, bias, filters) apply, so
    q is close to p; at temperature 0 the draft is the one-hot argmax. Penalty counts include
    the earlier draft tokens of the cycle, as the target's p at that position does. Logits over
    a reduced draft vocabulary are scattered into the full vocabulary with -inf elsewhere, so q
    is exactly zero outside it and acceptance stays exact.

    With a grammar, each draft token is drawn from q masked by the grammar state after the
    earlier draft tokens (the same mask the target's p gets at that position), and advances
    the state; the masks are kept for the verification. Where the grammar allows nothing
    the drafter can propose (it is complete, or its next tokens are outside a reduced draft
    vocabulary), the draft ends: ``num_valid`` tokens count, the rest are discarded.
    """

    def __init__(
        self,
        config: SamplerConfig,
        vocab_size: int,
        uniforms: mx.array,
        token_counts: mx.array | None = None,
        draft_vocab: mx.array | None = None,
        grammar: GrammarState | None = None,
    ) -> None:
        """uniforms: [k] one per draft position; token_counts: [V]; draft_vocab: [V'] target
        token id of each draft-vocabulary entry; grammar: the sequence's grammar state
        (advanced by the draft tokens; the caller rolls it back)."""
        self.config = config
        self.vocab_size = vocab_size
        self.uniforms = uniforms
        self.token_counts = token_counts if config.has_penalties else None
        self.draft_vocab = draft_vocab
        self.num_drawn = 0
        self.grammar = grammar
        self.masks: list[mx.array] = []  # [V] bool, the grammar mask of each valid position
        self.num_valid = 0  # draft tokens the grammar allowed, in a row (all without one)
        self._ended = False
        # The draft vocabulary on the host, for grammar masks only (a copy a cycle otherwise).
        self._draft_ids: np.ndarray | None = None
        if draft_vocab is not None and grammar is not None:
            self._draft_ids = np.array(draft_vocab)

    def _grammar_mask(self) -> mx.array | None:
        """[V] bool mask for the next draft position; None without a grammar or once the
        draft has ended (that token is then drawn unmasked and discarded)."""
        if self.grammar is None or self._ended:
            return None
        allowed = self.grammar.allowed()
        if allowed is None or (self._draft_ids is not None and not allowed[self._draft_ids].any()):
            self._ended = True
            return None
        mask = mx.array(allowed)
        self.masks.append(mask)
        return mask

    def __call__(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        """logits: the next draft position's [V] or [V'] (or [1, .., 1, V]: read flat) ->
        (token [] int32, q [V])."""
        mask = self._grammar_mask()
        if self.draft_vocab is not None and not self.config.logit_bias:
            # Filter and draw over the V' draft entries, then scatter q into [V]: the token is
            # drawn from exactly the q that is reported, at a fraction of the full-row cost.
            counts = self._counts()
            if counts is not None:
                counts = counts[:, self.draft_vocab]
            small_mask = None if mask is None else mask[self.draft_vocab][None]
            if self.config.is_greedy and counts is None and small_mask is None:
                # The one-hot's argmax is the logits' own (their first maximum), and q the
                # one-hot at the token: built from the token, where the one-hot over V' and
                # its scatter into [V] are ~8 ops for the engine thread to build (no greedy
                # verdict reads q).
                if fused_layer.available():  # one node where MLX's ops are 4
                    token = fused_layer.greedy_draft(logits, self.draft_vocab)
                else:
                    index = mx.argmax(logits.astype(mx.float32))
                    token = self.draft_vocab[index].astype(mx.int32)
                q = (_vocab_ids(self.vocab_size) == token).astype(mx.float32)
            else:
                # [1, V']
                small = distribution(_flat(logits)[None], self.config, counts, small_mask)
                token = self.draft_vocab[self._draw(small)].astype(mx.int32)
                q = mx.zeros((self.vocab_size,), mx.float32)
                q[self.draft_vocab] = small[0]
        else:
            logits = _flat(logits)
            if self.draft_vocab is not None:  # logit_bias is keyed by full-vocabulary ids
                full = mx.full((self.vocab_size,), -mx.inf, dtype=mx.float32)
                full[self.draft_vocab] = logits.astype(mx.float32)
                logits = full
            masks = None if mask is None else mask[None]
            q = distribution(logits[None], self.config, self._counts(), masks)[0]
            token = self._draw(q[None]).astype(mx.int32)
        if self.token_counts is not None:
            self.token_counts = self.token_counts + (mx.arange(self.vocab_size) == token)
        self.num_drawn += 1
        if self.grammar is None:
            self.num_valid = self.num_drawn
        elif mask is not None:
            # The next position's mask depends on this token: read it now (constrained
            # drafts are drawn one synchronised token at a time).
            self.grammar.consume(scalar_int(token))
            self.num_valid += 1
        return token, q

    def _draw(self, probs: mx.array) -> mx.array:
        """probs [1, n] -> index [] of the next draft token (argmax when greedy)."""
        if self.config.is_greedy:
            return mx.argmax(probs[0])
        uniform = self.uniforms[self.num_drawn : self.num_drawn + 1]
        return sample(probs, uniform)[0]

    def _counts(self) -> mx.array | None:
        return None if self.token_counts is None else self.token_counts[None]


class Drafter(Protocol):
    """Proposes draft tokens for one sequence and keeps its own state in step with the
    committed history (never with rejected draft tokens)."""

    name: str

    @property
    def draft_vocab(self) -> mx.array | None:
        """Target token id of each entry of the drafter's logits when it drafts over a
        reduced vocabulary ([V'] int32), else None."""
        ...

    def reset(self, prompt_ids: list[int]) -> None:
        """Start a new sequence whose committed history is ``prompt_ids``'s first token."""
        ...

    def commit(self, new_tokens: list[int], target_hidden: mx.array | None) -> None:
        """Append committed tokens to the history.

        new_tokens: [n] the tokens committed since the last call; target_hidden: [1, n, H],
        row i the target's hidden state at the position whose next token is new_tokens[i]
        (None when the drafter declared it does not read hidden states)."""
        ...

    def propose(
        self, history: list[int], k: int, sample: DraftSampler
    ) -> tuple[list[mx.array], list[mx.array]]:
        """Up to k draft tokens (each a scalar int32 array, left lazy) with their q ([V] each).
        May return fewer than k, or none, when it has nothing to propose."""
        ...

    @property
    def needs_hidden(self) -> bool:
        """Whether ``commit`` reads the target's hidden states."""
        ...

    @property
    def sources(self) -> tuple[str, ...]:
        """What it can draft from: n-gram lookup (``"ngram"``) and / or a model drafter's
        name; a lookup-first drafter has both, and drafts from the one it last ``use``d."""
        ...

    def use(self, source: str) -> None:
        """Draft the next cycle from ``source`` (one of ``sources``)."""
        ...

    def match_length(self, history: list[int]) -> int:
        """Its n-gram lookup's match length for ``history`` (0: no match, or no lookup)."""
        ...

    @property
    def batch_key(self) -> object:
        """Drafters with the same key (not None) propose together in one
        ``propose_batch`` (the MTP head: one head forward for all its rows); None: it
        proposes alone. A mix answers for the source it drafts from now (``active``)."""
        ...

    def active(self) -> Drafter:
        """The drafter that proposes the next cycle: itself, or a mix's current source."""
        ...

    def propose_batch(
        self,
        drafters: list[Drafter],
        histories: list[list[int]],
        ks: list[int],
        samplers: list[DraftSampler],
    ) -> list[tuple[list[mx.array], list[mx.array]]]:
        """``propose`` of every drafter in ``drafters`` (active ones sharing this one's
        ``batch_key``), each row's result bitwise what it proposes alone."""
        ...

    @property
    def commits_lazily(self) -> bool:
        """Whether the drafter takes a cycle's commit before its verdict is read
        (``commit_lazy``, then ``settle``), so its drafting cycles can run one step ahead."""
        ...

    def commit_lazy(self, tokens: mx.array, target_hidden: mx.array, num_valid: mx.array) -> None:
        """Feed a cycle's verified positions with the count that holds still computing:
        tokens [k+1] int32, target_hidden [1, k+1, H], num_valid [] int32 (lazy). Only
        called when ``commits_lazily``."""
        ...

    def settle(self, num_rejected: int) -> None:
        """The last lazy commit's verdict, read: ``num_rejected`` draft tokens were not
        accepted."""
        ...


class OneSource:
    """The draft sources of a drafter that drafts from one source, its ``name``; the match
    length is a lookup's (0 here: a model drafter does not look up)."""

    name: str

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.name,)

    def use(self, source: str) -> None:
        if source != self.name:
            raise ValueError(f"unknown draft source {source!r}; sources: {self.sources}")

    def match_length(self, history: list[int]) -> int:
        return 0


class CommitsEagerly:
    """The lazy-commit capability of a drafter that only takes read verdicts (``commit``):
    its cycles are never run one step ahead, so the lazy calls never come."""

    commits_lazily = False

    def commit_lazy(self, tokens: mx.array, target_hidden: mx.array, num_valid: mx.array) -> None:
        raise NotImplementedError(f"{type(self).__name__} commits only read verdicts")

    def settle(self, num_rejected: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} commits only read verdicts")


class ProposesAlone:
    """The batch capability of a drafter that proposes row by row: no shared key, and a
    batch is each row's own ``propose``."""

    batch_key: object = None

    def active(self) -> Drafter:
        return cast("Drafter", self)

    def propose_batch(
        self,
        drafters: list[Drafter],
        histories: list[list[int]],
        ks: list[int],
        samplers: list[DraftSampler],
    ) -> list[tuple[list[mx.array], list[mx.array]]]:
        return [
            d.propose(h, k, s) for d, h, k, s in zip(drafters, histories, ks, samplers, strict=True)
        ]
