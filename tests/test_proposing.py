"""Proposing a step's drafts (``mtplx.proposing``)."""

from __future__ import annotations

import numpy as np
import pytest

from mtplx.drafters import NgramDrafter
from mtplx.proposing import propose_rows
from mtplx.request import SamplerConfig
from tests.test_speculative import GREEDY, ScriptedDrafter


def test_lookup_rows_propose_in_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows that draft from n-gram lookup this step (lookup drafters, and a lookup-first
    mix whose source is the lookup) propose in one ``propose_batch`` call; the row whose
    mix drafts from its model proposes on its own; every draft is the row's alone."""
    from dataclasses import dataclass

    from mtplx.drafters import LookupFirstDrafter

    @dataclass(eq=False)
    class Row:
        tokens: list[int]
        drafter: object
        config: SamplerConfig = GREEDY
        seed: int = 0
        token_counts: None = None
        grammar: None = None

    vocab = 40
    repeating = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    mixes = []
    for source in ("ngram", "scripted"):
        mix = LookupFirstDrafter(NgramDrafter(), ScriptedDrafter(list(range(30)), vocab))
        mix.reset(repeating)
        mix.use(source)
        mixes.append(mix)
    rows = [Row(repeating, NgramDrafter()), Row([1, 2, 1, 2], NgramDrafter())]
    rows += [Row(repeating, mix) for mix in mixes]
    calls: list[int] = []
    one_pass = NgramDrafter.propose_batch

    def counted(self, drafters, *args):  # type: ignore[no-untyped-def]
        calls.append(len(drafters))
        return one_pass(self, drafters, *args)

    monkeypatch.setattr(NgramDrafter, "propose_batch", counted)
    drafts = propose_rows([(row, 3) for row in rows], vocab)  # type: ignore[misc]
    assert calls == [3]
    for row, draft in zip(rows, drafts, strict=True):
        assert not isinstance(draft, Exception)
        alone = propose_rows([(row, 3)], vocab)[0]  # type: ignore[list-item]
        assert not isinstance(alone, Exception)
        assert draft.tokens.tolist() == alone.tokens.tolist() and draft.num_drafted == 3
        assert all(np.array_equal(q, a) for q, a in zip(draft.qs, alone.qs, strict=True))
    assert calls == [3]  # a row alone proposes through its own ``propose``
