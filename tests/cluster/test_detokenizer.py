import random

import pytest
from _tiny_tokenizer import EOS, byte_level_bpe
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from shardserve.cluster.detokenizer import IncrementalDetokenizer, backend_decode


@pytest.fixture(scope="module", params=["tokenizers", "transformers"])
def tokenizer(request):
    tok = byte_level_bpe()
    if request.param == "transformers":
        return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    return tok


def encode(tokenizer, text: str) -> list[int]:
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.encode(text).ids
    return tokenizer.encode(text, add_special_tokens=False)


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], bool]:
    """Feeds ids one at a time like the engine; returns every delta handed out and whether a stop matched."""
    deltas, stopped = [], False
    for t in ids:
        stopped = detok.add_token(t)
        deltas.append(detok.take_delta(final=stopped))
        if stopped:
            return deltas, True
    detok.flush()
    deltas.append(detok.take_delta(final=True))
    return deltas, False


def test_streamed_text_equals_full_decode_for_multibyte_characters(tokenizer):
    prompt = encode(tokenizer, "the fox says")
    text = " héllo 日本語 🙂 world, ça va? Ωμέγα 🇺🇳"
    ids = encode(tokenizer, text)
    deltas, stopped = stream(IncrementalDetokenizer(tokenizer, prompt), ids)
    assert not stopped
    assert "".join(deltas) == text == tokenizer.decode(ids)
    assert not any("\ufffd" in d for d in deltas)


def test_random_unicode_streams_exactly(tokenizer):
    rng = random.Random(0)
    alphabet = list("abc xyz.,!") + ["é", "ß", "日", "語", "🙂", "🚀", "Ω", "\u0301"]
    for _ in range(20):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        ids = encode(tokenizer, text)
        deltas, _ = stream(IncrementalDetokenizer(tokenizer, [5]), ids)
        assert "".join(deltas) == tokenizer.decode(ids)


def test_incomplete_character_is_held_until_its_last_byte(tokenizer):
    ids = encode(tokenizer, "🙂")
    assert len(ids) == 4  # one byte per token
    detok = IncrementalDetokenizer(tokenizer, [5])
    texts = []
    for t in ids:
        detok.add_token(t)
        texts.append(detok.take_delta(final=False))
    assert texts == ["", "", "", "🙂"]


def test_stop_string_spanning_tokens_is_cut_and_never_streamed(tokenizer):
    ids = encode(tokenizer, "hello world STOP here and more")
    assert any(tokenizer.decode([t]) == " STOP" for t in ids)  # "OP he" spans " STOP" and " here"
    detok = IncrementalDetokenizer(tokenizer, [5], stop=["OP he"])
    deltas, stopped = stream(detok, ids)
    assert stopped and detok.stopped_by == "OP he"
    assert detok.text == "hello world ST"
    assert "".join(deltas) == "hello world ST"
    streamed = ""
    for d in deltas[:-1]:  # before the final delta, only text that can no longer become a stop string
        streamed += d
        assert "hello world ST".startswith(streamed)
    assert len(deltas) < len(ids)  # stopped at the token that completed it


def test_first_completed_stop_string_wins_and_earliest_start_among_those(tokenizer):
    ids = encode(tokenizer, "the quick brown fox jumps")
    assert any(tokenizer.decode([t]) == " brown" for t in ids)  # "own" and "brow" complete with one token
    detok = IncrementalDetokenizer(tokenizer, [5], stop=["quick brown fox", "own", "brow"])
    _, stopped = stream(detok, ids)
    assert stopped and detok.text == "the quick " and detok.stopped_by == "brow"


def test_stop_string_inside_one_token_with_multibyte_text_before(tokenizer):
    ids = encode(tokenizer, "héllo 🙂 world again")
    detok = IncrementalDetokenizer(tokenizer, [5], stop=["orl"])
    deltas, stopped = stream(detok, ids)
    assert stopped and "".join(deltas) == "héllo 🙂 w"


def test_no_stop_check_only_decodes(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [5], stop=["fox"])
    for t in encode(tokenizer, "the fox"):
        assert not detok.add_token(t, check_stop=False)
    assert detok.text == "the fox"


def test_special_tokens_add_no_text(tokenizer):
    eos = 0
    assert tokenizer.decode([eos], skip_special_tokens=False) == "<eos>"
    detok = IncrementalDetokenizer(tokenizer, [5])
    for t in encode(tokenizer, "hello") + [eos]:
        detok.add_token(t)
    detok.flush()
    assert detok.take_delta(final=True) == "hello"


def test_include_stop_str_keeps_the_stop_string_and_nothing_after_it(tokenizer):
    ids = encode(tokenizer, "hello world STOP here and more")
    detok = IncrementalDetokenizer(tokenizer, [5], stop=["OP he"], include_stop_str=True)
    deltas, stopped = stream(detok, ids)
    assert stopped and detok.stopped_by == "OP he"
    assert detok.text == "".join(deltas) == "hello world STOP he"


def test_the_rust_decode_is_called_only_where_it_gives_transformers_text():
    """backend_decode: a transformers fast tokenizer without the space cleanup decodes through its Rust tokenizer
    (the same text as its decode over random ids, special tokens and broken characters included); with the cleanup
    on, through transformers."""
    plain = PreTrainedTokenizerFast(tokenizer_object=byte_level_bpe(), eos_token=EOS, clean_up_tokenization_spaces=False)
    fast = backend_decode(plain)
    assert fast == plain.backend_tokenizer.decode
    rng = random.Random(1)
    vocab = plain.backend_tokenizer.get_vocab_size()
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        for skip in (True, False):
            assert fast(ids, skip_special_tokens=skip) == plain.decode(ids, skip_special_tokens=skip)
    cleaning = PreTrainedTokenizerFast(tokenizer_object=byte_level_bpe(), eos_token=EOS,
                                       clean_up_tokenization_spaces=True)
    assert backend_decode(cleaning) == cleaning.decode
    raw = byte_level_bpe()  # a tokenizers.Tokenizer is called as it is
    assert backend_decode(raw) == raw.decode


def test_skipped_special_tokens_do_not_grow_the_window(tokenizer):
    """Special tokens between words leave the text as a full decode gives it, and a long run of them costs no more
    per decode: each decode's window stays a few tokens long."""
    eos = 0
    sizes = []

    class Counting:  # the tokenizer, counting the ids each decode gets
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def decode(self, ids, **kwargs):
            sizes.append(len(ids))
            return tokenizer.decode(ids, **kwargs)

    counting = Counting()
    counting.backend_tokenizer = getattr(tokenizer, "backend_tokenizer", tokenizer)
    ids = encode(tokenizer, "hello") + [eos] * 500 + encode(tokenizer, " world") + [eos]
    detok = IncrementalDetokenizer(counting, [5])
    detok._decode_ids = counting.decode  # count every decode
    for t in ids:
        detok.add_token(t)
    detok.flush()
    assert detok.take_delta(final=True) == "hello world" == tokenizer.decode(ids, skip_special_tokens=True)
    assert max(sizes) <= 12
    kept = IncrementalDetokenizer(tokenizer, [5], skip_special_tokens=False)
    for t in encode(tokenizer, "hi") + [eos]:
        kept.add_token(t)
    kept.flush()
    assert kept.text == "hi<eos>"


def test_a_tokenizer_that_cannot_be_hashed_still_skips_its_special_tokens():
    class Unhashable:  # transformers-like: decode and all_special_ids, and __eq__ without __hash__
        all_special_ids = [0]

        def __eq__(self, other):
            return self is other

        def decode(self, ids, skip_special_tokens=True):
            return "".join("" if (i == 0 and skip_special_tokens) else chr(97 + i % 26) for i in ids)

    tok = Unhashable()
    detok = IncrementalDetokenizer(tok, [1, 2])
    for t in [3, 0, 4, 0, 0]:
        detok.add_token(t)
    detok.flush()
    assert detok.text == "de" and detok._ids[-2:] == [3, 4]  # the special ids stayed out of the window
