import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from splitserve.workers.model.tokenizer import tiny_tokenizer
from splitserve.workers.output.detokenizer import (
    MAX_PENDING,
    IncrementalDetokenizer,
    window_decoder,
)
from splitserve.workers.output.stop_checker import find_stop_string, stop_holdback

TEXT = "你好 🙂 naïve"


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def stream(tok, ids, prompt=(), skip_special_tokens=True):
    detok = IncrementalDetokenizer(tok, list(prompt), skip_special_tokens)
    return detok, [detok.add_token(t) for t in ids]


def test_multibyte_characters_split_across_tokens(tok):
    ids = tok.encode(TEXT)
    assert len(ids) > len(TEXT)  # CJK and emoji are byte tokens
    detok, pieces = stream(tok, ids, prompt=tok.encode("Hello world"))
    assert "".join(pieces) == detok.text == TEXT
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[:3] == ["", "", "你"]  # three byte tokens, one character
    assert "🙂" in pieces and detok.flush() == ""


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_pieces_concatenate_to_decode_for_random_ids(tok, skip_special_tokens):
    rng = random.Random(0)
    prompt = tok.encode("The capital of France is")
    for _ in range(300):
        # Byte tokens of multi-byte characters, special tokens, ids beyond the vocabulary.
        ids = [rng.randrange(len(tok) + 20) for _ in range(rng.randint(0, 40))]
        detok, pieces = stream(tok, ids, prompt, skip_special_tokens)
        pieces.append(detok.flush())
        assert "".join(pieces) == detok.text
        assert detok.text == tok.decode(ids, skip_special_tokens=skip_special_tokens), ids


def test_complete_characters_need_no_flush(tok):
    rng = random.Random(1)
    alphabet = "ab ,.你好世界🙂ïé\n"
    for _ in range(100):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        detok, pieces = stream(tok, tok.encode(text), prompt=tok.encode("Hi"))
        assert "".join(pieces) == text
        assert all("\ufffd" not in p for p in pieces)


def test_special_tokens_skipped_or_kept(tok):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("Hi") + [im_end] + tok.encode(" there")
    chat_prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    prompt = tok.encode(chat_prompt + "<|im_start|>assistant\n")
    assert stream(tok, ids, prompt)[0].text == "Hi there"
    assert stream(tok, ids, prompt, skip_special_tokens=False)[0].text == "Hi<|im_end|> there"


def test_prompt_ending_mid_character_does_not_leak_into_output(tok):
    ids = tok.encode("你x")
    detok, pieces = stream(tok, ids[1:], prompt=ids[:1])
    assert detok.text == "x"


def stream_with_stop(tok, text, stop, include):
    detok = IncrementalDetokenizer(tok, tok.encode("Hello"))
    for t in tok.encode(text):
        piece = detok.add_token(t)
        hit = find_stop_string(detok.text, len(piece), stop, include)
        if hit:
            return hit, piece
    return None, None


def test_stop_string_across_token_boundaries(tok):
    text = "The capital of France is Paris."
    pieces = [tok.decode([t]) for t in tok.encode(text)]
    assert not any("is Par" in p for p in pieces)  # spans ' is' and ' Paris'
    hit, last_piece = stream_with_stop(tok, text, ["Paris!", "is Par"], include=False)
    assert hit == ("The capital of France ", "is Par") and last_piece == " Paris"
    hit, _ = stream_with_stop(tok, text, ["is Par"], include=True)
    assert hit == ("The capital of France is Par", "is Par")
    hit, _ = stream_with_stop(tok, TEXT, ["好 🙂"], include=False)  # over held-back bytes
    assert hit == ("你", "好 🙂")
    assert stream_with_stop(tok, text, ["Paris!"], include=False) == (None, None)


def test_find_stop_string_searches_only_the_tail_and_takes_the_earliest():
    assert find_stop_string("abcXYZ", 1, ["abc"], False) is None  # old text, found earlier
    assert find_stop_string("abcXYZ", 4, ["abc"], False) == ("", "abc")
    assert find_stop_string("xxabcd", 4, ["cd", "ab"], False) == ("xx", "ab")
    assert find_stop_string("xxabcd", 4, ["cd", "ab"], True) == ("xxab", "ab")
    assert find_stop_string("xxab", 1, ["b", "ab"], False) == ("xx", "ab")
    assert find_stop_string("", 0, ["a"], False) is None


def test_stop_holdback():
    assert stop_holdback("Hello wor", ["world"]) == 3
    assert stop_holdback("Hello wor", ["xyz", "or!", "r!"]) == 2
    assert stop_holdback("abc", ["abc"]) == 0  # a complete stop is find_stop_string's job
    assert stop_holdback("a", ["abc"]) == 1
    assert stop_holdback("Hello", []) == 0


def test_window_stays_short_on_garbage(tok):
    lead_byte = tok.encode("你")[0]  # never completed below
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = [lead_byte] * 12 + [im_end] * 20 + tok.encode(" ok")
    detok = IncrementalDetokenizer(tok, tok.encode("Hello"))
    for t in ids:
        detok.add_token(t)
        assert len(detok._ids) <= 2 * MAX_PENDING
    assert detok.text + detok.flush() == tok.decode(ids, skip_special_tokens=True)


def test_window_decoder_decodes_as_the_tokenizer(tok):
    """The Rust backend's decode stands in for ``tokenizer.decode`` only where the two
    agree: a tokenizer that cleans up tokenization spaces keeps its own decode."""
    rng = random.Random(2)
    for skip in (True, False):
        fast = window_decoder(tok, skip)
        for _ in range(200):
            ids = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 12))]
            assert fast(ids) == tok.decode(ids, skip_special_tokens=skip), ids
    backend = Tokenizer(models.WordLevel({"hello": 0, ".": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(cleanup=False)
    cleaning = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=True)
    assert backend.decode([0, 1]) == "hello ."
    assert window_decoder(cleaning, True)([0, 1]) == cleaning.decode([0, 1]) == "hello."
