"""The corpora a first user has: a folder of a few dozen small files, one document, a file that is not UTF-8, a
broken tokenizer.json. Checked against the files' own bytes, Python's decoder and the `tokenizers` library."""
from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import train as train_script
from nanomega.config import DataConfig
from nanomega.data.prepare import prepare
from nanomega.data.sources import load_splits
from nanomega.data.tokenizer import EOT, load_tokenizer
from tiers import slow

TINY = ["--model.d_model=32", "--model.n_layers=1", "--model.n_heads=2", "--model.n_kv_heads=1",
        "--model.ffn_dim=64", "--model.max_seq_len=32", "--train.seq_len=32", "--train.batch_size=2",
        "--train.compile=false", "--train.eval_batches=1", "--train.steps=2", "--train.sample_tokens=0"]
LATIN1 = "Les hommes ont oublié cette vérité, dit le renard.\n".encode("latin-1")


def rule(key: str, fraction: float) -> bool:
    """docs/data.md's split rule, written out here."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") % 10_000 < fraction * 10_000


def small_folder(root, n=40):
    """n small text files none of which the split rule sends to validation, at prepare's and train.py's
    default fractions (the commonest small corpus: the rule expects 0.2 and 0.8 documents there)."""
    root.mkdir()
    names = [f"text_{i:02d}.txt" for i in range(n)]
    assert not any(rule(name, f) for name in names for f in (0.005, 0.02))
    for i, name in enumerate(names):
        (root / name).write_text(f"Note {i}: the quick brown fox jumps over the lazy dog. " * (20 + i))
    return root, names


def test_forty_small_files_prepare_and_train_holding_out_the_last_document(tmp_path, capsys):
    root, names = small_folder(tmp_path / "texts")
    meta = prepare([str(root)], "bytes", tmp_path / "prepared", workers=1, progress=False)
    assert "holding out the last document" in capsys.readouterr().out
    texts = [(root / n).read_bytes() for n in names]
    val = np.fromfile(tmp_path / "prepared" / "val.bin", dtype="<u2")
    train = np.fromfile(tmp_path / "prepared" / "train.bin", dtype="<u2")
    assert bytes(val.astype(np.uint8)) == texts[-1] + b"\0"          # the last document, with its EOS
    assert bytes(train.astype(np.uint8)) == b"".join(t + b"\0" for t in texts[:-1])
    assert meta["splits"]["val"]["n_documents"] == 1 and meta["splits"]["train"]["n_documents"] == 39
    assert np.load(tmp_path / "prepared" / "val.docs.npy").tolist() == [0]

    # read directly with train.py's defaults (val_fraction 0.02): the same document is validation
    splits = load_splits(DataConfig(path=str(root)), seq_len=32)
    assert "holding out the last document, text_39.txt" in capsys.readouterr().out
    assert bytes(np.asarray(splits.val).astype(np.uint8)) == texts[-1]
    assert bytes(np.asarray(splits.train).astype(np.uint8)) == b"\0".join(texts[:-1])
    for data in (root, tmp_path / "prepared"):
        train_script.main(TINY + [f"--data.path={data}", f"--train.out_dir={tmp_path / data.name / 'run'}"])
        assert "step 2: train" in capsys.readouterr().out


def test_one_document_holds_out_its_tail(tmp_path, capsys):
    (tmp_path / "one").mkdir()
    text = "A single long essay. " * 400
    (tmp_path / "one" / "essay.txt").write_text(text)
    splits = load_splits(DataConfig(path=str(tmp_path / "one")), seq_len=256)
    n_val = min(max(math.ceil(len(text) * 0.02), 257), len(text) // 2)     # at least a sequence, at most half
    assert len(splits.val) == n_val and bytes(np.concatenate(splits).astype(np.uint8)) == text.encode()
    assert "last 257 tokens of its one document" in capsys.readouterr().out
    prepare([str(tmp_path / "one")], "bytes", tmp_path / "prepared", workers=1, progress=False)
    val = np.fromfile(tmp_path / "prepared" / "val.bin", dtype="<u2")
    train = np.fromfile(tmp_path / "prepared" / "train.bin", dtype="<u2")
    assert len(val) == 1025 and bytes(np.concatenate([train, val]).astype(np.uint8)) == text.encode() + b"\0"


def test_what_cannot_work_is_still_refused(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("x")
    with pytest.raises(ValueError, match="one document of 1 token"):
        load_splits(DataConfig(path=str(tmp_path / "in")))
    (tmp_path / "in" / "a.txt").write_text("")
    with pytest.raises(ValueError, match="hold no bytes"):
        prepare([str(tmp_path / "in")], "bytes", tmp_path / "out", workers=1, progress=False)


def library_bpe(files, vocab):
    """The `tokenizers` library training train_bpe's recipe from files it reads itself."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(f) for f in files], trainer)
    return tok


def test_a_latin1_file_reads_with_replacement_characters_everywhere(tmp_path, capsys):
    root, names = small_folder(tmp_path / "texts")
    (root / names[3]).write_bytes(LATIN1 * 30)           # not UTF-8: the library's own file reader refuses it
    with pytest.raises(Exception, match="valid UTF-8"):
        library_bpe(sorted(root.iterdir()), 300)
    # the policy: Python's decoder with errors="replace", so the library trains on those (valid) files
    fixed = tmp_path / "fixed"
    fixed.mkdir()
    for name in names:
        (fixed / name).write_text((root / name).read_bytes().decode("utf-8", errors="replace"))
    reference = library_bpe(sorted(fixed.iterdir()), 300)
    cache = tmp_path / "cache"
    ours = load_tokenizer("train:300", corpus=sorted(root.iterdir()), cache_dir=cache)
    assert ours.tok.to_str() == reference.to_str()

    meta = prepare([str(root)], "train:300", tmp_path / "prepared", workers=2, cache_dir=cache, progress=False)
    ids = np.concatenate([np.fromfile(tmp_path / "prepared" / f"{s}.bin", dtype="<u2") for s in ("train", "val")])
    expected = [reference.encode((fixed / n).read_text(), add_special_tokens=False).ids + [ours.eos_id]
                for n in names[:-1] + names[-1:]]
    assert ids.tolist() == sum(expected, [])
    assert meta["tokenizer"]["sha256"] == ours.identity()["sha256"]
    # the byte tokenizer decodes nothing: its ids are the file's bytes, in prepare and read directly alike
    prepare([str(root)], "bytes", tmp_path / "bytes", workers=1, progress=False)
    train = np.fromfile(tmp_path / "bytes" / "train.bin", dtype="<u2")
    assert bytes(train.astype(np.uint8)).count(LATIN1) == 30
    splits = load_splits(DataConfig(path=str(root)))
    assert bytes(np.asarray(splits.train).astype(np.uint8)).count(LATIN1) == 30


@slow
def test_a_bpe_trains_on_the_builtin_corpus_which_holds_files_that_are_not_utf8(tmp_path, capsys):
    """The standard library holds Latin-1 and KOI8-R files (test/encoded_modules): ~25 s here."""
    train_script.main(TINY + ["--data.tokenizer=train:512", f"--data.cache_dir={tmp_path / 'cache'}",
                              f"--train.out_dir={tmp_path / 'run'}"])
    assert "step 2: train" in capsys.readouterr().out
    assert load_tokenizer(str(tmp_path / "run" / "tokenizer")).vocab_size == 512


def test_a_truncated_tokenizer_json_is_refused_naming_the_file(tmp_path):
    root, _ = small_folder(tmp_path / "texts")
    tok = load_tokenizer("train:300", corpus=sorted(root.iterdir()), cache_dir=tmp_path / "cache")
    tok.save(tmp_path / "tok")
    file = tmp_path / "tok" / "tokenizer.json"
    file.write_bytes(file.read_bytes()[:200])
    with pytest.raises(ValueError, match=f"{file} is not a readable tokenizer.json .*truncated.*copy it again"):
        load_tokenizer(str(tmp_path / "tok"))
    with pytest.raises(SystemExit, match="error: .*tokenizer.json is not a readable tokenizer.json"):
        train_script.main(TINY + [f"--data.path={root}", f"--data.tokenizer={file}", "--model.vocab_size=320",
                                  f"--train.out_dir={tmp_path / 'run'}"])
    (tmp_path / "tok" / "tokenizer.json").write_text(tok.tok.to_str())
    (tmp_path / "tok" / "tokenizer_config.json").write_text('{"eos_token": ')
    with pytest.raises(ValueError, match="tokenizer_config.json is not valid JSON"):
        load_tokenizer(str(tmp_path / "tok"))
