"""nanomega/data/tokenizer.py against the `tokenizers` library and transformers' AutoTokenizer."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from nanomega.data.tokenizer import EOT, ByteTokenizer, HFTokenizer, load_tokenizer, train_bpe

TEXTS = ["def add(a, b):\n    return a + b\n", "Grüße, 世界! naïve café — ok\n\tTabs and  spaces.",
         "class Foo:\n    pass\n" * 5, "emoji 🙂 and \x01 control", ""]
CORPUS = [f"def f{i}(x):\n    return x * {i} + 'ünïcode {i}'\n" for i in range(200)]


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(CORPUS, 300)


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_round_trip_and_token_bytes_sum_to_the_utf8_length(kind, bpe):
    tok = ByteTokenizer() if kind == "bytes" else bpe
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        lengths = tok.token_bytes()
        assert sum(lengths[i] for i in ids) == len(text.encode("utf-8"))
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]
    assert tok.token_bytes()[tok.eos_id] == (1 if kind == "bytes" else 0)


def test_trained_bpe_is_tokenizers_own_encoding_with_eos(bpe, tmp_path):
    assert bpe.vocab_size == 300 and bpe.eos_id == bpe.tok.token_to_id(EOT) and bpe.bos_id is None
    bpe.save(tmp_path)
    reference = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))     # the library itself, not our wrapper
    for text in TEXTS:
        assert bpe.encode(text) == reference.encode(text, add_special_tokens=False).ids
    assert len(bpe.encode(CORPUS[7])) < len(CORPUS[7].encode())           # it learned merges


def test_identity_is_stable_across_save_and_load(bpe, tmp_path):
    bpe.save(tmp_path / "a")
    again = load_tokenizer(str(tmp_path / "a"))
    assert again.identity()["sha256"] == bpe.identity()["sha256"]
    assert again.eos_id == bpe.eos_id and again.vocab_size == bpe.vocab_size
    other = train_bpe(CORPUS, 320)
    assert other.identity()["sha256"] != bpe.identity()["sha256"]
    ByteTokenizer().save(tmp_path / "b")
    loaded = load_tokenizer(str(tmp_path / "b"))
    assert isinstance(loaded, ByteTokenizer) and loaded.identity() == ByteTokenizer().identity()


def test_auto_tokenizer_loads_what_save_wrote_and_encodes_identically(bpe, tmp_path):
    transformers = pytest.importorskip("transformers")
    bpe.save(tmp_path)
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert auto.eos_token_id == bpe.eos_id and len(auto) == bpe.vocab_size
    for text in TEXTS:
        assert auto.encode(text, add_special_tokens=False) == bpe.encode(text)
        assert auto.decode(bpe.encode(text)) == text


def test_folder_special_tokens_from_tokenizer_config_then_config_json(bpe, tmp_path):
    tok = Tokenizer.from_str(bpe.tok.to_str())      # a copy: the fixture is shared
    tok.add_special_tokens(["<s>", "<pad>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>", "special": True}, "eos_token": EOT}))
    (tmp_path / "config.json").write_text(json.dumps({"pad_token_id": tok.token_to_id("<pad>"), "eos_token_id": 5}))
    loaded = HFTokenizer.from_path(tmp_path)
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (tok.token_to_id("<s>"), tok.token_to_id(EOT),
                                                             tok.token_to_id("<pad>"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<missing>"}))
    with pytest.raises(ValueError, match="'<missing>' is not in its vocabulary"):
        HFTokenizer.from_path(tmp_path)


def test_train_spec_is_cached_by_corpus_and_vocab(tmp_path, monkeypatch):
    import nanomega.data.tokenizer as module
    calls = []
    real = module.train_bpe
    monkeypatch.setattr(module, "train_bpe", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    first = load_tokenizer("train:280", corpus=CORPUS, cache_dir=tmp_path)
    second = load_tokenizer("train:280", corpus=CORPUS, cache_dir=tmp_path)
    assert calls == [280] and first.identity()["sha256"] == second.identity()["sha256"]
    load_tokenizer("train:280", corpus=CORPUS[:-1], cache_dir=tmp_path)     # another corpus trains again
    assert calls == [280, 280]
    assert len(list((tmp_path / "tokenizers").iterdir())) == 2


def test_bad_specs_say_what_to_write(tmp_path):
    with pytest.raises(ValueError, match="train:<vocab size>"):
        load_tokenizer("train:lots", corpus=CORPUS)
    with pytest.raises(FileNotFoundError, match="give 'bytes', a tokenizer.json"):
        load_tokenizer(str(tmp_path / "nothing"))
    with pytest.raises(FileNotFoundError, match="tokenizer.json does not exist"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="vocab_size >= 257"):
        train_bpe(CORPUS, 100)


def test_auto_tokenizer_reads_the_byte_tokenizer_as_bytes(tmp_path):
    transformers = pytest.importorskip("transformers")
    ByteTokenizer().save(tmp_path)
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        assert auto.encode(text, add_special_tokens=False) == ByteTokenizer().encode(text)
        assert auto.decode(ByteTokenizer().encode(text)) == text
