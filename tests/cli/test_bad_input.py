"""Every bad input a careless user gave the command line gets one clear error naming the culprit, and changes
nothing (the contract of tests/fuzz/harness.py: exit 2, one stderr line `dblock: error: ...`, no internal error,
no file created or changed, no hang), each with the message fragments it must carry. Then the special-token
rule for text prompts (`dblock.tasks.tokenizer.encode_prompt`) on the bundled tokenizer and on tokenizers whose
vocabularies can spell `<eos>`."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from dblock.weights_path import CHECKPOINTS_DIR
from tests.fuzz.harness import check_contract, run_cli

SEED = str(2 ** 64)
CUDA = torch.cuda.is_available()

# (id, argv with {tiny} = a make-tiny llada2_moe folder and {cwd} = the working folder, message fragments)
CASES = [
    # --- bounds equal to the server's, refused before allocating or loading
    ("prompt-100k-chars", ["generate", "--model", "tiny-masked", "--prompt", "1" * 100_000],
     ["--prompt", "100000 characters", "at most 65536"]),
    ("block-size-1e6", ["generate", "--model", "tiny-masked", "--prompt-ids", "5,6", "--block-size", "1000000"],
     ["--block-size 1000000", "4096 positions", "1..4096"]),
    ("prompt-5000-tokens", ["generate", "--model", "tiny-masked", "--prompt", "1" * 5000, "--max-new-tokens", "8"],
     ["--prompt", "5000 prompt tokens", "--max-new-tokens 8", "4096 (max_position_embeddings)"]),
    ("max-new-tokens-1e9", ["generate", "--model", "{tiny}", "--prompt-ids", "5", "--max-new-tokens", "1000000000"],
     ["--max-new-tokens 1000000000", "[1, 16777216]"]),
    ("max-new-tokens-past-positions", ["generate", "--model", "{tiny}", "--prompt-ids", "5", "--max-new-tokens",
                                       "5000"], ["--prompt-ids", "need 5008 positions", "--max-new-tokens <= 4095"]),
    ("batch-size-neg", ["generate", "--model", "tiny-masked", "--prompt-ids", "5", "--batch-size", "-1"],
     ["--batch-size -1", "must be positive", "[1, "]),
    ("batch-size-0", ["generate", "--model", "tiny-masked", "--prompt-ids", "5", "--batch-size", "0"],
     ["--batch-size 0", "must be positive"]),
    ("temperature-nan", ["generate", "--model", "tiny-uniform", "--prompt-ids", "5", "--temperature", "nan,nan"],
     ["--temperature nan,nan", "not finite", "[0.001, 1000]"]),
    ("temperature-inf", ["generate", "--model", "tiny-uniform", "--prompt-ids", "5", "--temperature", "inf,inf"],
     ["--temperature inf,inf", "not finite"]),
    ("temperature-reversed", ["generate", "--model", "tiny-uniform", "--prompt-ids", "5", "--temperature",
                              "0.4,0.8"], ["--temperature 0.4,0.8", "t_max=0.4 < t_min=0.8"]),
    ("entropy-bound-nan", ["generate", "--model", "tiny-uniform", "--prompt-ids", "5", "--entropy-bound", "nan"],
     ["--entropy-bound nan", "not a finite number", ">= 0"]),
    ("confidence-nan", ["generate", "--model", "tiny-uniform", "--prompt-ids", "5", "--confidence", "nan"],
     ["--confidence nan", "not a finite number"]),
    ("threshold-1.5", ["generate", "--model", "tiny-masked", "--prompt-ids", "5", "--threshold", "1.5"],
     ["--threshold 1.5", "(0, 1]"]),
    ("seed-2**64", ["generate", "--model", "tiny-masked", "--prompt-ids", "5", "--seed", SEED],
     [f"--seed {SEED}", "[0, 2**63-1]"]),
    ("seed-negative", ["generate", "--model", "tiny-masked", "--prompt-ids", "5", "--seed=-1"],
     ["--seed -1", "[0, 2**63-1]"]),
    ("threads-0", ["--threads", "0", "info", "tiny-masked"], ["--threads 0", "must be positive"]),
    # the same checks on every command that takes these options
    ("eval-seed", ["eval", "--model", "tiny-masked", "--n", "2", "--seed", SEED], [f"--seed {SEED}"]),
    ("eval-seeds", ["eval", "--model", "tiny-masked", "--n", "2", "--seeds", f"0,{SEED}"], ["--seeds", SEED]),
    ("eval-n-0", ["eval", "--model", "tiny-masked", "--n", "0"], ["--n 0", "must be positive"]),
    ("eval-batch-size", ["eval", "--model", "tiny-masked", "--n", "2", "--batch-size", "0"], ["--batch-size 0"]),
    ("eval-max-new-tokens", ["eval", "--model", "tiny-masked", "--n", "2", "--max-new-tokens", "5000"],
     ["--task", "--max-new-tokens 5000", "max_position_embeddings"]),
    ("eval-task-inf-weight", ["eval", "--model", "tiny-masked", "--n", "2", "--task", "arith:add=inf,rev=1"],
     ["--task arith:add=inf,rev=1", "finite"]),
    ("eval-temperature", ["eval", "--model", "tiny-uniform", "--n", "2", "--temperature", "inf,inf"],
     ["--temperature inf,inf"]),
    ("verify-seed", ["verify", "--model", "tiny-masked", "--task", "arith", "--n", "2", "--seed", SEED],
     [f"--seed {SEED}"]),
    ("verify-block-size", ["verify", "--model", "tiny-masked", "--task", "arith", "--n", "2", "--block-size",
                           "1000000"], ["--block-size 1000000", "4096"]),
    ("verify-batch-size", ["verify", "--model", "tiny-masked", "--task", "arith", "--batch-size=-1"],
     ["--batch-size -1"]),
    ("compare-seeds", ["compare-schedules", "--model", "tiny-masked", "--task", "arith", "--n", "2", "--seeds",
                       SEED], ["--seeds", SEED]),
    ("compare-seed-span", ["compare-schedules", "--model", "tiny-masked", "--task", "arith", "--n", "2", "--seeds",
                           str(2 ** 63 - 1)], ["--seeds", "beyond 2**63-1"]),
    ("compare-threshold", ["compare-schedules", "--model", "tiny-masked", "--task", "arith", "--threshold", "nan"],
     ["--threshold nan"]),
    ("compare-batch-size", ["compare-schedules", "--model", "tiny-masked", "--task", "arith", "--batch-size", "0"],
     ["--batch-size 0"]),
    ("serve-seed", ["serve", "--model", "tiny-masked", "--seed", SEED], [f"--seed {SEED}"]),
    ("serve-temperature", ["serve", "--model", "tiny-uniform", "--temperature", "0.4,0.8"],
     ["--temperature 0.4,0.8"]),
    ("serve-block-size", ["serve", "--model", "tiny-masked", "--block-size", "0"], ["--block-size 0"]),
    ("serve-block-size-1e6", ["serve", "--model", "tiny-masked", "--block-size", "1000000"],
     ["--block-size 1000000", "4096 positions"]),
    ("serve-max-new-tokens", ["serve", "--model", "tiny-masked", "--max-new-tokens", "5000", "--max-tokens-limit",
                              "100000"], ["--max-new-tokens 5000", "--max-new-tokens <= 4095"]),
    ("make-tiny-seed", ["make-tiny", "--family", "llada2_moe", "--out", "new", "--seed", SEED], [f"--seed {SEED}"]),
    ("simulate-seed", ["simulate", "oba", "--seed", SEED], [f"--seed {SEED}"]),
    # --- special tokens: literal text stays text
    ("prompt-eos-text", ["generate", "--model", "tiny-masked", "--prompt", "1+1=<eos>"],
     ["--prompt", "character '<' at position 4", "'<eos>' is a special token", "--allow-special-tokens"]),
    ("prompt-mask-text", ["generate", "--model", "tiny-masked", "--prompt", "1<mask>2"],
     ["character '<' at position 1", "'<mask>'"]),
    # --- errors that name the culprit
    ("corrupt-tokenizer", ["generate", "--model", "{cwd}/tm", "--prompt", "1+1="],
     ["tokenizer.json: not a valid tokenizer.json"]),
    ("unknown-char", ["generate", "--model", "tiny-masked", "--prompt", "1+hello"],
     ["--prompt", "character 'h' at position 2", "not in the tokenizer's vocabulary"]),
    ("out-is-file-make-tiny", ["make-tiny", "--family", "llada2_moe", "--out", "afile"],
     ["--out afile", "not a folder"]),
    ("out-is-file-train-tiny", ["train-tiny", "--family", "llada2_moe", "--out", "afile", "--steps", "1"],
     ["--out afile", "not a folder"]),
    ("out-in-file-verify", ["verify", "--model", "tiny-masked", "--task", "arith", "--n", "1", "--out", "afile/r.json"],
     ["--out afile/r.json", "is not a folder"]),
    ("device-cuda", ["generate", "--model", "tiny-masked", "--prompt-ids", "5", "--device",
                     "cuda:99" if CUDA else "cuda"],
     ["--device cuda", "CUDA device(s)" if CUDA else "CUDA is not available in this torch build"]),
    ("device-bogus", ["generate", "--model", "tiny-masked", "--prompt-ids", "5", "--device", "tpu9"],
     ["--device 'tpu9'"]),
    ("prompts-missing-compare", ["compare-schedules", "--model", "tiny-masked", "--prompts", "nope.txt"],
     ["--prompts nope.txt", "no such file"]),
    ("prompts-folder-compare", ["compare-schedules", "--model", "tiny-masked", "--prompts", "full"],
     ["--prompts full", "is a folder"]),
    ("prompts-bad-json-compare", ["compare-schedules", "--model", "tiny-masked", "--prompts", "bad_ids.txt"],
     ["--prompts bad_ids.txt line 2", "not a JSON list of token ids"]),
    ("prompts-binary-compare", ["compare-schedules", "--model", "tiny-masked", "--prompts", "binary.txt"],
     ["--prompts binary.txt", "not UTF-8"]),
    ("prompts-missing-verify", ["verify", "--model", "tiny-masked", "--prompts", "nope.txt"],
     ["--prompts nope.txt", "no such file"]),
    ("prompts-bad-json-verify", ["verify", "--model", "tiny-masked", "--prompts", "bad.json"],
     ["--prompts bad.json", "not valid JSON"]),
    ("prompts-bad-item-verify", ["verify", "--model", "tiny-masked", "--prompts", "items.json"],
     ["--prompts items.json item 2", "list of token ids"]),
    ("prompts-eos-text-verify", ["verify", "--model", "tiny-masked", "--prompts", "eos.txt"],
     ["--prompts eos.txt line 1", "character '<'"]),
    ("serve-port-70000", ["serve", "--model", "tiny-masked", "--port", "70000"],
     ["--port 70000", "[1, 65535]", "0 for any free port"]),
    ("serve-port-neg", ["serve", "--model", "tiny-masked", "--port=-5"], ["--port -5", "[1, 65535]"]),
    ("serve-max-queue-0", ["serve", "--model", "tiny-masked", "--max-queue", "0"],
     ["--max-queue 0", "must be positive"]),
    ("serve-kv-budget-1", ["serve", "--model", "tiny-masked", "--kv-budget-tokens", "1"],
     ["--kv-budget-tokens 1", "give at least 16"]),
    ("serve-device", ["serve", "--model", "tiny-masked", "--device", "cuda:99" if CUDA else "cuda"], ["--device"]),
    ("model-empty", ["generate", "--model", "", "--prompt-ids", "5"], ["--model: empty"]),
]


@pytest.fixture
def cwd(tmp_path):
    """The working folder: a plain file, a folder holding a file, prompt files good and bad, a copy of
    tiny-masked whose tokenizer.json is cut short."""
    (tmp_path / "afile").write_text("")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    (tmp_path / "bad_ids.txt").write_text("[5, 6]\n[5, x]\n")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00bad")
    (tmp_path / "bad.json").write_text("[[5, 6], ")
    (tmp_path / "items.json").write_text(json.dumps([[5, 6], [5, "a"]]))
    (tmp_path / "eos.txt").write_text("1+1=<eos>\n")
    tm = tmp_path / "tm"
    shutil.copytree(os.path.join(CHECKPOINTS_DIR, "tiny-masked"), tm)
    text = (tm / "tokenizer.json").read_text()
    (tm / "tokenizer.json").write_text(text[: len(text) // 2])
    return tmp_path


@pytest.mark.parametrize("argv, needles", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_one_clear_line(argv, needles, cwd, tiny_dirs):
    argv = [a.replace("{tiny}", tiny_dirs["llada2_moe"]).replace("{cwd}", str(cwd)) for a in argv]
    o = run_cli(argv, str(cwd), timeout_s=60)
    assert o.rc == 2, (argv[:6], o.rc, o.err[-500:])
    assert check_contract(o) == "refused"
    for needle in needles:
        assert needle in o.err, (needle, o.err)


# ---- the special-token rule -----------------------------------------------------------------------------------

def test_allow_special_tokens_opts_in(tmp_path):
    o = run_cli(["generate", "--model", "tiny-masked", "--prompt", "1+1=<eos>", "--allow-special-tokens",
                 "--max-new-tokens", "4", "--json"], str(tmp_path))
    assert o.rc == 0, o.err
    assert json.loads(o.out)["counters"]["per_request"][0]["prompt_len"] == 5     # 1 + 1 = <eos>


def _word_tokenizer():
    """A word-level tokenizer whose vocabulary holds `<eos>` as an ordinary word too, and a BOS template."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<mask>": 3, "hi": 4, "there": 5, "[UNK]": 6, "<": 7, ">": 8,
             "eos": 9}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(s, special=True) for s in ("<pad>", "<eos>", "<bos>", "<mask>")])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return tok


def _byte_tokenizer():
    """A byte-level BPE (every character encodable) with the four specials."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["hi there <eos> 1+1=2"] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<eos>", "<bos>", "<mask>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def test_encode_prompt_never_makes_control_tokens_from_text():
    from dblock.prompts import load_tokenizer
    from dblock.tasks.tokenizer import CharTokenizer, PromptError, encode_prompt

    byte = _byte_tokenizer()
    eos, mask = byte.token_to_id("<eos>"), byte.token_to_id("<mask>")
    ids = encode_prompt(byte, "hi <eos> there <mask>")
    assert eos not in ids and mask not in ids and len(ids) > 6              # spelled as ordinary characters
    assert eos in encode_prompt(byte, "hi <eos>", allow_special=True)
    assert byte.encode_special_tokens is False                              # the caller's tokenizer untouched

    word = _word_tokenizer()
    with pytest.raises(PromptError, match=r"'<eos>' at position 3 encodes to the control token '<eos>'"):
        encode_prompt(word, "hi <eos> there")                               # a vocabulary word spelling EOS
    assert encode_prompt(word, "hi there") == [2, 4, 5]                      # the template's BOS is allowed
    assert encode_prompt(word, "hi there", add_special_tokens=False) == [4, 5]
    assert encode_prompt(word, "hi <eos>", allow_special=True) == [2, 4, 1]
    with pytest.raises(PromptError, match="control token 'there'"):
        encode_prompt(word, "hi there", control_ids={5})                     # the model's own control ids

    hf = load_tokenizer(os.path.join(CHECKPOINTS_DIR, "tiny-masked"))
    char = CharTokenizer()
    for tok in (hf, char):
        assert encode_prompt(tok, "12+3=") == char.encode("12+3=")
        assert encode_prompt(tok, "1<eos>", allow_special=True) == [5, 1]
        with pytest.raises(PromptError, match=r"character '<' at position 1"):
            encode_prompt(tok, "1<eos>")
        with pytest.raises(PromptError, match=r"character 'h' at position 2"):
            encode_prompt(tok, "1 h", name="--prompt", allow_special=True)
        with pytest.raises(PromptError, match="empty"):
            encode_prompt(tok, "")
        with pytest.raises(PromptError, match="at most 4 are accepted"):
            encode_prompt(tok, "12345", max_chars=4)
