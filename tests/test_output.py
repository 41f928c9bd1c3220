"""Stop strings across token boundaries and streaming text release."""

from __future__ import annotations

from mtplx.output import TextEmitter


class PieceDetokenizer:
    """A detokenizer whose token i is the text PIECES[i]."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def reset(self) -> None:
        self.text, self.offset = "", 0

    def add_token(self, token: int) -> None:
        self.text += self.pieces[token]

    def finalize(self) -> None:
        pass

    @property
    def last_segment(self) -> str:
        segment, self.offset = self.text[self.offset :], len(self.text)
        return segment


def _run(pieces: list[str], stop: list[str]) -> tuple[list[str], bool, str]:
    emitter = TextEmitter(PieceDetokenizer(pieces), stop)
    released = []
    for token in range(len(pieces)):
        released.append(emitter.add(token))
        if emitter.stopped:
            break
    return released, emitter.stopped, emitter.flush()


def test_stop_string_across_token_boundaries_is_not_emitted() -> None:
    released, stopped, tail = _run(["Hello", " wor", "ld", "!!", " more"], ["world!"])
    assert stopped and "".join(released) == "Hello " and tail == ""


def test_text_that_could_start_a_stop_string_is_held_then_released() -> None:
    released, stopped, tail = _run(["a", "b", "c", "x"], ["bcd"])
    assert not stopped
    assert released == ["a", "", "", "bcx"]
    assert tail == ""


def test_held_text_comes_out_at_the_end() -> None:
    released, stopped, tail = _run(["one", " tw"], [" two"])
    assert not stopped and "".join(released) == "one" and tail == " tw"


def test_stop_inside_one_token_cuts_the_token_text() -> None:
    released, stopped, _ = _run(["ab", "cSTOPde"], ["STOP"])
    assert stopped and released == ["ab", "c"]


def test_earliest_of_several_stop_strings_wins() -> None:
    released, stopped, _ = _run(["x", "yz", "w"], ["zw", "y"])
    assert stopped and "".join(released) == "x"


def test_no_stop_strings_releases_everything_at_once() -> None:
    released, stopped, tail = _run(["a", "b"], [])
    assert released == ["a", "b"] and not stopped and tail == ""


def test_the_matched_stop_string_is_recorded():
    emitter = TextEmitter(PieceDetokenizer(["say ", "END", " now"]), ["STOP", "END", "EN"])
    for piece in range(3):
        emitter.add(piece)
        if emitter.stopped:
            break
    # "EN" and "END" both start at the same place; the first listed of them wins.
    assert emitter.stopped and emitter.matched == "END"
    assert TextEmitter(PieceDetokenizer(["a"]), ["x"]).matched is None


class _Vocabulary:
    """The slice of a Hugging Face tokenizer mlx-lm's detokenizers read: token strings."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.tokens[i] for i in ids]


# Word-initial tokens carry the space: "Ġ" in byte-level BPE (the default model's, GPT-2's),
# "▁" in SentencePiece (Llama's).
_BPE = ["a", "Ġtime", ",", "Ġthe", "Ġcity", "Ċ"]
_SPM = ["a", "▁time", ",", "▁the", "▁city", "<0x0A>"]


def _text(detokenizer: object, tokens: list[int], primer: int | None) -> str:
    emitter = TextEmitter(detokenizer, (), primer)
    return "".join(emitter.add(t) for t in tokens) + emitter.flush()


def test_a_continuation_keeps_its_first_space_under_both_conventions() -> None:
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

    for detokenizer in (
        BPEStreamingDetokenizer(_Vocabulary(_BPE)),
        SPMStreamingDetokenizer(_Vocabulary(_SPM)),
    ):
        tokens = [1, 2, 3, 4, 5, 1]
        # Continuing a prompt: the concatenation of the tokens' text.
        assert _text(detokenizer, tokens, primer=0) == " time, the city\n time"
        # A reply of its own: the first token's word-initial space is dropped.
        assert _text(detokenizer, tokens, primer=None) == "time, the city\n time"
