"""Character tokenizer: id map, round trips on task samples, parity with the `tokenizers` library."""

import pytest
import tokenizers

from dblock.tasks import BOS_ID, EOS_ID, MASK_ID, PAD_ID, CharTokenizer, answer_text, get_task


@pytest.fixture(scope="module")
def tok():
    return CharTokenizer()


def test_fixed_vocab(tok):
    assert (PAD_ID, EOS_ID, BOS_ID, MASK_ID) == (0, 1, 2, 3)
    assert tok.vocab_size == 32 and tok.vocab_size % 8 == 0
    assert tok.encode("0123456789") == list(range(4, 14))
    assert tok.encode("<eos><pad>") == [EOS_ID, PAD_ID]


def test_unknown_character_names_it(tok):
    with pytest.raises(ValueError, match="'x'"):
        tok.encode("12x3")
    with pytest.raises(ValueError, match="'<'"):
        tok.encode("1<3")


def test_decode(tok):
    ids = tok.encode("12+3") + [EOS_ID, PAD_ID, MASK_ID, BOS_ID]
    assert tok.decode(ids) == "12+3"
    assert tok.decode(ids, skip_special=False) == "12+3<eos><pad><mask><bos>"
    assert answer_text(tok.encode("=>5") + [EOS_ID] + tok.encode("=>6"), tok) == "=>5"


def test_round_trip_and_library_parity(tok, tmp_path):
    path = tok.save(tmp_path)
    assert path.name == "tokenizer.json"
    hf = tokenizers.Tokenizer.from_file(str(path))
    assert hf.get_vocab_size() == tok.vocab_size
    loaded = CharTokenizer.load(tmp_path)
    assert loaded.vocab == tok.vocab
    task = get_task("arith")
    samples = task.examples("train", 300) + task.examples("test", 300)
    for e in samples:
        for text in (e.prompt, e.answer, e.prompt + e.answer + "<eos>"):
            ids = tok.encode(text)
            assert hf.encode(text).ids == ids == loaded.encode(text)
            assert len(ids) == len(text.replace("<eos>", "#"))  # one token per character
        assert tok.decode(tok.encode(e.answer)) == e.answer
        assert hf.decode(tok.encode(e.answer)) == e.answer
    assert hf.encode(" 1 <mask>").ids == tok.encode(" 1 <mask>") == [25, 5, 25, MASK_ID]
