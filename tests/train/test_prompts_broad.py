"""The broad prompt source: deterministic, every family present, a held-out split that
shares no filler word, template or text with training."""

from __future__ import annotations

import re

from mtplx.train.prompts_broad import FAMILIES, build_broad_prompts, split_pools


def test_deterministic_and_every_family_present() -> None:
    train, heldout = build_broad_prompts(0, num_train=400, num_heldout=60)
    assert (train, heldout) == build_broad_prompts(0, num_train=400, num_heldout=60)
    assert len(train) == 400 and len(heldout) == 60
    assert build_broad_prompts(1, num_train=400)[0] != train
    kinds = {p.kind for p in train}
    assert set(FAMILIES) <= kinds
    assert set(FAMILIES) <= {p.kind for p in heldout}
    multi = [p for p in train if p.kind.startswith("multi-")]
    assert multi and all(p.history and p.history[-1][0] == "assistant" for p in multi)
    assert all(not p.history for p in train if not p.kind.startswith("multi-"))
    assert len({(p.text, p.history) for p in train}) == len(train)


def test_heldout_shares_no_text_template_or_filler_with_training() -> None:
    train, heldout = build_broad_prompts(0, num_train=2000, num_heldout=100)
    keys = {(p.text, p.history) for p in train}
    assert not any((p.text, p.history) in keys for p in heldout)
    pools, follow = split_pools(0)
    for key in ("name", "city", "lang", "job"):
        assert not set(pools[True].words[key]) & set(pools[False].words[key])
        train_only = re.compile(r"\b(" + "|".join(map(re.escape, pools[False].words[key])) + r")\b")
        assert not any(train_only.search(p.text) for p in heldout), key
    assert not set(follow[True]) & set(follow[False])
    # families with four templates or more hold some templates out entirely
    for family in ("chat", "code", "maths"):
        seen = {p.topic for p in train if p.kind == family}
        held = {p.topic for p in heldout if p.kind == family}
        assert seen and held and not seen & held, family
