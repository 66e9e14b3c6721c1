"""The code corpus, its tokenizer and the `code` task (dblock/tasks/code_corpus.py, code.py, code_eval.py)."""
import importlib.metadata
import json
import os

import numpy as np
import pytest

from dblock.errors import ConfigError
from dblock.tasks import get_task
from dblock.tasks.code import CodeTask, bootstrap_ci, next_line, paired_bootstrap_ci
from dblock.tasks import code_corpus
from dblock.tasks.code_corpus import (SYMPY_VERSION, CodeTokenizer, TrainWindows, corpus_files, read_source,
                                      split_of, sympy_root)


def test_the_split_is_by_file_disjoint_and_a_function_of_the_path():
    train, test = corpus_files("train"), corpus_files("test")
    every = corpus_files()
    assert set(train).isdisjoint(test) and sorted(train + test) == every
    assert every == sorted(every) and len(every) > 1000
    assert 0.02 < len(test) / len(every) < 0.10            # TEST_FRACTION 0.05 of the hash range
    assert all(split_of(f) == "test" for f in test) and all(split_of(f) == "train" for f in train)
    assert all(f.startswith("sympy/") and f.endswith(".py") for f in every)
    # the rule reads the path alone: the same answer from a fresh computation
    import hashlib
    for f in every[::97]:
        h = int(hashlib.sha256(f.encode()).hexdigest()[:8], 16)
        assert split_of(f) == ("test" if h < 0.05 * 2 ** 32 else "train")


def test_training_windows_come_from_train_files_only():
    tok = CodeTokenizer.load(_bundled_tokenizer_folder())
    w = TrainWindows(tok, 64)
    assert set(w.files) == set(corpus_files("train"))
    rng = np.random.default_rng(0)
    a = [w.window(rng) for _ in range(4)]
    b = [w.window(np.random.default_rng(0)) for _ in range(1)]
    assert a[0] == b[0] and all(len(x) == 64 for x in a)       # a pure function of the generator
    text = tok.decode(a[0])
    assert any(text[:40] in read_source(f) for f in corpus_files("train"))


def test_another_sympy_version_is_one_error_naming_both(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.13.3")
    code_corpus._all_files.cache_clear()
    with pytest.raises(ConfigError, match=rf"sympy {SYMPY_VERSION}.*sympy 1\.13\.3"):
        sympy_root()
    code_corpus._all_files.cache_clear()


def _bundled_tokenizer_folder():
    from dblock.weights_path import CHECKPOINTS_DIR
    return os.path.join(CHECKPOINTS_DIR, "code-masked")


def test_the_bundled_tokenizer_is_rebuilt_bit_for_bit_from_the_corpus():
    """The tokenizer is data made by code: building it again from the pinned corpus gives the bundled file."""
    built = CodeTokenizer.build()
    bundled = CodeTokenizer.load(_bundled_tokenizer_folder())
    assert json.loads(built.hf.to_str()) == json.loads(bundled.hf.to_str())


def test_the_tokenizer_loads_in_transformers_and_round_trips(tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = _bundled_tokenizer_folder()
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    ours = CodeTokenizer.load(folder)
    assert (hf.pad_token_id, hf.eos_token_id, hf.bos_token_id, hf.mask_token_id) == (0, 1, 2, 3)
    assert len(hf) == ours.vocab_size == 2048
    for f in corpus_files("test")[:5]:
        text = read_source(f)[:3000] + "\n\tünïcødé → ∑ 😀\r\n"
        ids = hf.encode(text, add_special_tokens=False)
        assert ids == ours.encode(text)
        assert hf.decode(ids) == text == ours.decode(ids)
    chat = hf.apply_chat_template([{"role": "system", "content": "x"}, {"role": "user", "content": "def f(x):"}],
                                  tokenize=False)
    assert chat == "def f(x):"


def test_code_examples_are_deterministic_and_cut_at_line_ends():
    task = get_task("code")
    a, b = task.examples("test", 12), CodeTask().examples("test", 20)
    assert a == b[:12] and len({e.prompt for e in a}) == 12
    assert task.examples("test", 4, start=8) == a[8:12]
    assert {e.kind for e in a} == {"body", "block"}
    other = get_task("code:seed=1").examples("test", 12)
    assert other != a
    test_text = "".join(read_source(f) for f in corpus_files("test"))
    for e in a:
        assert e.answer.startswith("\n") and next_line(e.answer) == e.final and e.final.strip()
        assert e.prompt + e.answer[:200] in test_text           # cut from a held-out file, at a line end
        assert len(e.prompt) <= 320
        if e.kind == "block":
            assert e.prompt.rstrip().endswith(":")


def test_grading_and_per_request_scores():
    task = CodeTask()
    e = task.examples("test", 1)[0]
    tok = CodeTokenizer.load(_bundled_tokenizer_folder())
    ref = tok.encode(e.answer)
    assert task.grade(e.prompt, e.answer, example=e)
    assert task.score(e, e.answer, ref, ref) == {"next_line_exact": True, "token_accuracy": 1.0,
                                                 "answer_token_accuracy": 1.0}
    wrong = "\n" + e.final + "x"
    s = task.score(e, wrong, tok.encode(wrong), ref)
    assert not s["next_line_exact"] and 0.0 <= s["token_accuracy"] < 1.0
    assert task.score(e, "", [], ref)["token_accuracy"] == 0.0
    # the whole answer (64 ids): the first block right and the second wrong gives 1.0 on the first block, 0.5 here
    assert len(ref) >= 64
    half = ref[:32] + [(t + 1) % 2048 for t in ref[32:64]]
    h = task.score(e, "", half, ref)
    assert h["token_accuracy"] == 1.0 and h["answer_token_accuracy"] == 0.5
    assert task.grade(e.prompt, e.answer) and not CodeTask(seed=1).examples("test", 1)[0] == e
    with pytest.raises(ValueError, match="example="):
        CodeTask().grade(e.prompt, e.answer)


def test_the_schedule_comparison_grader_scores_code_and_arithmetic():
    """`prompts_and_grader` (what compare-schedules and the notebooks grade with): on the code task a dict of next
    line exact and token accuracy, the output cut at its first EOS; on an arithmetic task True/False."""
    from dblock.tasks.evaluate import TokenizerAdapter, prompts_and_grader
    from dblock.weights_path import resolve_model_path
    adapter = TokenizerAdapter.from_folder(resolve_model_path("code-masked"))
    exs = CodeTask().examples("test", 2)
    prompts, grader = prompts_and_grader(CodeTask(), adapter, exs)
    assert prompts == [adapter.encode(e.prompt) for e in exs]
    right = adapter.encode(exs[0].answer) + [adapter.eos_id] + adapter.encode("junk")
    assert grader(prompts[0], right) == {"correct": True, "token_accuracy": 1.0, "answer_token_accuracy": 1.0}
    g = grader(prompts[1], adapter.encode("x"))
    assert g["correct"] is False and 0.0 <= g["token_accuracy"] < 1.0
    arith = get_task("arith")
    a_ad = TokenizerAdapter.from_folder(resolve_model_path("tiny-masked"))
    ex = arith.examples("test", 1)
    (p,), ag = prompts_and_grader(arith, a_ad, ex)
    assert ag(p, a_ad.encode(ex[0].answer)) is True and ag(p, a_ad.encode(ex[0].answer + "1")) is False


def test_bootstrap_cis_cover_the_mean_and_are_deterministic():
    vals = [0, 1, 1, 0, 1, 1, 1, 0, 1, 1]
    lo, hi = bootstrap_ci(vals)
    assert lo <= 0.7 <= hi and lo > 0.2 and hi <= 1.0
    assert bootstrap_ci(vals) == [lo, hi] and bootstrap_ci([0.5]) == [0.5, 0.5]
    d = paired_bootstrap_ci(vals, vals)
    assert d == [0.0, 0.0]
    with pytest.raises(ValueError):
        paired_bootstrap_ci([1, 2], [1])
