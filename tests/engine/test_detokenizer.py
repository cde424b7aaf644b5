"""IncrementalDetokenizer on a real byte-level BPE tokenizer (the session `tokenizer` fixture):
multi-byte characters split over tokens, stop strings across token boundaries, held-back text,
stop tokens, ids past the vocabulary and special tokens.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.engine.detokenizer import IncrementalDetokenizer, StopMatcher, backend_decode
from pagedserve.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams

REPLACEMENT = "\ufffd"
MULTIBYTE = "Café naïve 日本語 is 🙂 fun; über 🎉 done."
PROMPT = "Hello there, tell me:"


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def make(tokenizer, prompt: str = PROMPT, **params) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, len(tokenizer), encode(tokenizer, prompt), SamplingParams(**params))


def stream(detok: IncrementalDetokenizer, token_ids: list[int], stop_terminated: bool = False):
    """Feed one token at a time as the engine does; returns (deltas, stop string or None).
    `stop_terminated` marks the last token as an EOS / stop token id."""
    deltas = []
    for i, token_id in enumerate(token_ids):
        last = i == len(token_ids) - 1
        stop = detok.update([token_id], stop_terminated and last)
        finished = last or stop is not None
        deltas.append(detok.get_next_output_text(finished, delta=True))
        if stop is not None:
            return deltas, stop
    return deltas, None


def first_token_completing(tokenizer, token_ids: list[int], text: str) -> int:
    """Index of the token with which `text` first appears in the decoded output."""
    return next(i for i in range(len(token_ids)) if text in tokenizer.decode(token_ids[: i + 1]))


# ---- plain decoding -----------------------------------------------------------------------


def test_multibyte_characters_are_split_over_tokens(tokenizer):
    # Guards the premise of the tests below: some token decodes to half a character.
    assert any(tokenizer.decode([t]) == REPLACEMENT for t in encode(tokenizer, MULTIBYTE))


@pytest.mark.parametrize("text", [MULTIBYTE, " é", "日本語", "🙂🎉", "plain ascii, with spaces  and\nnewlines"])
def test_deltas_concatenate_to_full_decode(tokenizer, text):
    token_ids = encode(tokenizer, text)
    deltas, stop = stream(make(tokenizer), token_ids)
    assert stop is None
    assert "".join(deltas) == tokenizer.decode(token_ids) == text
    assert not any(REPLACEMENT in d for d in deltas)  # half a character is never emitted


def test_cumulative_output_grows_by_prefixes(tokenizer):
    detok = make(tokenizer)
    token_ids = encode(tokenizer, MULTIBYTE)
    seen = []
    for i, token_id in enumerate(token_ids):
        detok.update([token_id], False)
        seen.append(detok.get_next_output_text(finished=i == len(token_ids) - 1, delta=False))
    assert all(MULTIBYTE.startswith(s) and REPLACEMENT not in s for s in seen)
    assert seen[-1] == MULTIBYTE


def test_leading_space_after_prompt_is_kept(tokenizer):
    deltas, _ = stream(make(tokenizer, prompt="Hello"), encode(tokenizer, " world"))
    assert "".join(deltas) == " world"


def test_several_tokens_in_one_update(tokenizer):
    token_ids = encode(tokenizer, MULTIBYTE)
    detok = make(tokenizer)
    for chunk in (token_ids[:3], token_ids[3:11], token_ids[11:]):
        detok.update(chunk, False)
    assert detok.get_next_output_text(finished=True, delta=False) == MULTIBYTE


def test_invalid_bytes_show_as_replacement_once_followed(tokenizer):
    # A lone continuation byte is not half a character but garbage; it shows as U+FFFD, as the
    # tokenizer decodes it, once a valid character follows.
    lone = tokenizer.convert_tokens_to_ids("¡")  # byte 0xA1 in the byte-level alphabet
    assert tokenizer.decode([lone]) == REPLACEMENT
    token_ids = encode(tokenizer, "ab") + [lone] + encode(tokenizer, "cd")
    deltas, _ = stream(make(tokenizer), token_ids)
    assert "".join(deltas) == tokenizer.decode(token_ids) == "ab" + REPLACEMENT + "cd"


def test_ids_past_vocabulary_decode_to_nothing(tokenizer):
    # The model's (padded) vocabulary may differ from the tokenizer's: use a cut-off below the
    # tokenizer's size, so ids past it are real tokens that would show if not dropped.
    vocab = 300
    words = encode(tokenizer, "one two")
    assert max(words) < vocab and tokenizer.decode([vocab, vocab + 100]) != ""
    prompt_ids = encode(tokenizer, PROMPT) + [vocab, vocab + 100]
    detok = IncrementalDetokenizer(tokenizer, vocab, prompt_ids, SamplingParams())
    deltas, _ = stream(detok, [vocab + 7] + words[:1] + [vocab, 10**6, len(tokenizer)] + words[1:] + [vocab + 1])
    assert "".join(deltas) == "one two"


@pytest.mark.parametrize("skip,expected", [(True, "hi there"), (False, "hi<|user|> there<|eos|>")])
def test_skip_special_tokens(tokenizer, skip, expected):
    user, eos = tokenizer.convert_tokens_to_ids(["<|user|>", "<|eos|>"])
    token_ids = encode(tokenizer, "hi") + [user] + encode(tokenizer, " there") + [eos]
    deltas, _ = stream(make(tokenizer, skip_special_tokens=skip), token_ids)
    assert "".join(deltas) == expected


def test_the_rust_decode_gives_transformers_text(tokenizer):
    """The detokenizer calls the Rust tokenizer's decode directly where transformers' would give
    the same text: every prefix of a text with split characters and special tokens, both ways."""
    decode = backend_decode(tokenizer)
    assert decode == tokenizer._tokenizer.decode
    user, eos = tokenizer.convert_tokens_to_ids(["<|user|>", "<|eos|>"])
    token_ids = encode(tokenizer, MULTIBYTE) + [user] + encode(tokenizer, " ok") + [eos]
    for end in range(1, len(token_ids) + 1):
        for skip in (True, False):
            assert decode(token_ids[:end], skip_special_tokens=skip) == tokenizer.decode(token_ids[:end], skip_special_tokens=skip)


def test_a_tokenizer_that_cleans_up_or_decodes_its_own_way_keeps_transformers_decode(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    assert backend_decode(tokenizer) == tokenizer.decode
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", False)

    class OwnDecode(type(tokenizer)):
        def _decode(self, token_ids, **kwargs):
            return "own"

    monkeypatch.setattr(tokenizer, "__class__", OwnDecode)
    assert backend_decode(tokenizer) == tokenizer.decode
    assert stream(make(tokenizer), encode(tokenizer, "a b"))[0][-1] == ""  # the override is what decodes


# ---- stop tokens --------------------------------------------------------------------------


def test_stop_terminated_drops_final_token_text(tokenizer):
    eos = tokenizer.eos_token_id
    detok = make(tokenizer, skip_special_tokens=False)
    deltas, _ = stream(detok, encode(tokenizer, "all done") + [eos], stop_terminated=True)
    assert "".join(deltas) == "all done"


def test_stop_terminated_keeps_final_token_with_include_stop(tokenizer):
    eos = tokenizer.eos_token_id
    detok = make(tokenizer, skip_special_tokens=False, include_stop_str_in_output=True)
    deltas, _ = stream(detok, encode(tokenizer, "all done") + [eos], stop_terminated=True)
    assert "".join(deltas) == "all done<|eos|>"


def test_stop_token_id_that_is_a_word_is_dropped(tokenizer):
    token_ids = encode(tokenizer, "all done.")
    deltas, _ = stream(make(tokenizer, stop_token_ids=[token_ids[-1]]), token_ids, stop_terminated=True)
    assert "".join(deltas) == tokenizer.decode(token_ids[:-1])


# ---- stop strings -------------------------------------------------------------------------

TEXT = "The quick brown fox jumps over the lazy dog. 日本語 and more words here"


@pytest.mark.parametrize("stop", ["fox jumps", "lazy", "日本", "s over t", "dog. 日"])
def test_stop_string_across_tokens_truncates_before_it(tokenizer, stop):
    token_ids = encode(tokenizer, TEXT)
    start = first_token_completing(tokenizer, token_ids, stop[0])
    end = first_token_completing(tokenizer, token_ids, stop)
    assert end > start  # the stop string really spans tokens
    deltas, found = stream(make(tokenizer, stop=[stop]), token_ids)
    assert found == stop
    assert len(deltas) == end + 1  # detected with the very token that completes it
    assert "".join(deltas) == TEXT[: TEXT.index(stop)]


@pytest.mark.parametrize("stop", ["fox jumps", "日本", "s over t"])
def test_stop_string_kept_with_include_stop(tokenizer, stop):
    deltas, found = stream(make(tokenizer, stop=[stop], include_stop_str_in_output=True), encode(tokenizer, TEXT))
    assert found == stop
    assert "".join(deltas) == TEXT[: TEXT.index(stop) + len(stop)]  # nothing after it


def test_earliest_stop_string_wins_whatever_the_list_order(tokenizer):
    # Both appear in one update: the one earlier in the text ends it, not the first listed.
    detok = make(tokenizer, stop=["lazy", "jumps", "brown fox"])
    assert detok.update(encode(tokenizer, TEXT), False) == "brown fox"
    assert detok.get_next_output_text(finished=True, delta=False) == "The quick "


def test_stop_string_in_prompt_is_ignored(tokenizer):
    deltas, found = stream(make(tokenizer, prompt="say stop", stop=["stop"]), encode(tokenizer, " and go"))
    assert found is None and "".join(deltas) == " and go"


def test_unmatched_stop_string_prefix_is_flushed_on_finish(tokenizer):
    text = "we wait for the lazy"
    deltas, found = stream(make(tokenizer, stop=["lazy dog"]), encode(tokenizer, text))
    assert found is None
    assert "".join(deltas) == text
    assert not "".join(deltas[:-1]).endswith("lazy")  # held back until the finish


@pytest.mark.parametrize("delta", [True, False])
def test_running_output_never_shows_a_stop_string_prefix(tokenizer, delta):
    stop = "over the lazy dog"
    token_ids = encode(tokenizer, TEXT)
    expected = TEXT[: TEXT.index(stop)]
    detok = make(tokenizer, stop=["zzz", stop])
    shown, found = "", None
    for token_id in token_ids:
        found = detok.update([token_id], False)
        if found is not None:
            break
        text = detok.get_next_output_text(finished=False, delta=delta)
        shown = shown + text if delta else text
        # Not one character of the stop string's occurrence may have been shown.
        assert expected.startswith(shown), shown
    assert found == stop
    assert len(shown) >= len(expected) - (len(stop) - 1)  # held back no more than needed
    rest = detok.get_next_output_text(finished=True, delta=delta)
    final = shown + rest if delta else rest
    assert final == expected


def test_cumulative_output_shorter_than_hold_back_shows_nothing(tokenizer):
    # Output "hel" is shorter than the 4 chars held back for "hello": all of it may start the stop
    # string, so nothing shows (a negative slice end must not show "he").
    detok = make(tokenizer, stop=["hello"])
    detok.update(encode(tokenizer, "hel"), False)
    assert detok.get_next_output_text(finished=False, delta=False) == ""
    assert detok.get_next_output_text(finished=False, delta=True) == ""
    assert detok.get_next_output_text(finished=True, delta=False) == "hel"


# ---- one pass over the new text (issue 19: 200k stop strings cost 50 ms per token) ----------


def naive_find_stop(stop: list[str], text: str, new_text_start: int) -> tuple[int, str] | None:
    """The detokenizer's former search, the reference: one `str.find` per stop string."""
    best = None
    for s in stop:
        index = text.find(s, max(0, new_text_start - len(s) + 1))
        if index != -1 and (best is None or index < best[0]):
            best = (index, s)
    return best


# A tiny alphabet, so stop strings overlap, repeat, share prefixes and straddle updates often.
_TEXT = st.text(alphabet="ab日🙂", max_size=12)


@settings(max_examples=400, deadline=None)
@given(stop=st.lists(st.text(alphabet="ab日🙂", min_size=1, max_size=5), min_size=1, max_size=6), chunks=st.lists(_TEXT, max_size=12))
def test_stop_matcher_equals_one_find_per_stop_string(stop, chunks):
    """Text grows chunk by chunk, as the detokenizer's does: after every chunk both searches give
    the same stop string at the same index (earliest wins, ties to the first listed), or none."""
    matcher, text = StopMatcher(stop), ""
    for chunk in chunks:
        start, text = len(text), text + chunk
        expected = naive_find_stop(stop, text, start)
        assert matcher.find(text, start) == expected, (stop, text, start)
        if expected is not None:
            return


@settings(max_examples=200, deadline=None)
@given(stop=st.lists(st.text(alphabet="ab", min_size=1, max_size=4), min_size=1, max_size=4), text=st.text(alphabet="ab", max_size=20), data=st.data())
def test_stop_matcher_equals_naive_on_any_text_and_start(stop, text, data):
    """Even on text that already holds a stop string before the window (which the detokenizer
    never produces: it would have stopped), the answers agree."""
    start = data.draw(st.integers(0, len(text)))
    assert StopMatcher(stop).find(text, start) == naive_find_stop(stop, text, start)


def test_detokenizer_truncates_as_the_naive_search_would(tokenizer):
    text = "aXbXab ab abab XX end"
    stops = [["ab", "b"], ["b", "ab"], ["XX", "X"], ["end", "d"], ["Xa"]]
    for stop in stops:
        for include in (False, True):
            found_index, found = naive_find_stop(stop, text, 0) or (None, None)
            deltas, got = stream(make(tokenizer, stop=stop, include_stop_str_in_output=include), encode(tokenizer, text))
            assert got == found
            assert "".join(deltas) == text[: found_index + (len(found) if include else 0)], (stop, include)


def test_per_step_stop_search_does_not_grow_with_the_output(tokenizer):
    """With the most stop strings allowed, at their longest, each step searches its new text plus
    the longest stop string's overlap: the 2,000th token costs what the 20th did."""
    stop = [chr(0x4E00 + i) * MAX_STOP_STRING_CHARS for i in range(MAX_STOP_STRINGS)]  # never generated
    detok = make(tokenizer, stop=stop)
    token_ids = encode(tokenizer, "the quick brown fox jumps over the lazy dog. " * 200)
    scanned, new_chars = [], []
    for token_id in token_ids[:2000]:
        before_chars, before_scanned = len(detok.output_text), detok.stop_matcher.num_scanned_chars
        assert detok.update([token_id], False) is None
        scanned.append(detok.stop_matcher.num_scanned_chars - before_scanned)
        new_chars.append(len(detok.output_text) - before_chars)
    assert len(detok.output_text) > 4000  # far past the 255-character overlap
    overlap = MAX_STOP_STRING_CHARS - 1
    assert all(s <= n + overlap for s, n in zip(scanned, new_chars))
    assert max(scanned[-500:]) <= max(scanned[100:600])  # flat once the text passes the overlap
