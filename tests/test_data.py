"""Tests for nanomega.data: tokenizer, sources, errors, and the seekable sampler."""
import hashlib
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from nanomega.config import DataConfig
from nanomega.data import (ByteTokenizer, Splits, TokenSampler, builtin_corpus_files, check_vocab,
                           eval_batches, load_splits, require_length)


def cfg(path="", val_fraction=0.1, cache_dir=""):
    return DataConfig(path=str(path), val_fraction=val_fraction, cache_dir=str(cache_dir))


# ---------------------------------------------------------------- tokenizer

def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "héllo wörld, 日本語 🙂\n\tend"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < tok.vocab_size == 256
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text
    assert tok.decode([104, 300, 105, 256]) == "hi"          # padded-vocab ids are dropped
    assert tok.decode([0xC3]) == "\ufffd"                     # truncated UTF-8 is replaced


# ---------------------------------------------------------------- built-in corpus

@pytest.fixture(scope="module")
def builtin(tmp_path_factory):
    c = cfg(val_fraction=0.02, cache_dir=tmp_path_factory.mktemp("cache"))
    return c, load_splits(c)


def test_builtin_files_exclude_site_packages():
    files = builtin_corpus_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = [f.relative_to(root).as_posix() for f in files]
    assert len(files) > 100 and rel == sorted(rel)
    assert all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in r.split("/") or "dist-packages" in r.split("/") for r in rel)


def test_builtin_cached_and_deterministic(builtin):
    c, first = builtin
    cached = sorted(Path(c.cache_dir).iterdir())
    assert [p.name.split(".")[-2:] for p in cached] == [["train", "bin"], ["val", "bin"]]
    assert cached[0].name.startswith("stdlib-py")
    mtimes = [p.stat().st_mtime_ns for p in cached]
    second = load_splits(c)
    assert [p.stat().st_mtime_ns for p in cached] == mtimes     # reused, not rewritten
    assert np.array_equal(first.train, second.train) and np.array_equal(first.val, second.val)
    assert first.train.dtype == np.uint16 and first.train.ndim == 1


def test_builtin_split_by_document(builtin):
    _, splits = builtin
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = {False: [], True: []}
    for f in builtin_corpus_files():   # the split rule, written out independently
        h = int.from_bytes(hashlib.sha256(f.relative_to(root).as_posix().encode()).digest()[:8], "little")
        docs[h % 10_000 < 200].append(f.read_bytes())
    assert docs[True] and docs[False]
    assert splits.train.tobytes()[::2] == b"\0".join(docs[False])   # low byte of each uint16 token
    assert splits.val.tobytes()[::2] == b"\0".join(docs[True])
    assert int(splits.train.max()) < 256


# ---------------------------------------------------------------- other sources

def test_text_file(tmp_path):
    text = "línea número %d — ünïcode\n"
    text = "".join(text % i for i in range(200))
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    splits = load_splits(cfg(tmp_path / "t.txt", val_fraction=0.1))
    data = text.encode("utf-8")
    assert len(splits.val) == -(-len(data) // 10)
    assert bytes(np.concatenate(splits).astype(np.uint8)) == data
    assert ByteTokenizer().decode(np.concatenate(splits)) == text
    # With seq_len, at least one sequence is held out even when val_fraction is tiny.
    assert len(load_splits(cfg(tmp_path / "t.txt", val_fraction=0.001), seq_len=64).val) == 65


def test_folder(tmp_path):
    contents = {f"d{i % 3}/f{i}.txt": f"doc {i} ünï\n" * (i + 1) for i in range(40)}
    for rel, text in contents.items():
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text(text, encoding="utf-8")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("hidden")
    (tmp_path / ".hidden.txt").write_text("hidden")
    splits = load_splits(cfg(tmp_path, val_fraction=0.3))
    got = [bytes(s.astype(np.uint8)).split(b"\0") for s in splits]
    assert got[0] and got[1]
    assert sorted(got[0] + got[1]) == sorted(t.encode() for t in contents.values())
    assert not set(got[0]) & set(got[1])
    assert np.array_equal(load_splits(cfg(tmp_path, val_fraction=0.3)).val, splits.val)


def test_bin_and_npy(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 50_000, size=1000)
    tokens.astype("<u2").tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", tokens.astype(np.int32))
    for name in ("t.bin", "t.npy"):
        splits = load_splits(cfg(tmp_path / name, val_fraction=0.05))
        assert len(splits.val) == 50
        assert np.array_equal(np.concatenate(splits), tokens)
        check_vocab(splits, 50_000)


# ---------------------------------------------------------------- errors

def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_splits(cfg(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load_splits(cfg(tmp_path / "empty.txt"))
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(ValueError, match="empty"):
        load_splits(cfg(tmp_path / "emptydir"))
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(ValueError, match="odd.*uint16"):
        load_splits(cfg(tmp_path / "odd.bin"))
    np.save(tmp_path / "2d.npy", np.zeros((4, 4), dtype=np.int64))
    with pytest.raises(ValueError, match="2-D.*1-D integer"):
        load_splits(cfg(tmp_path / "2d.npy"))
    np.save(tmp_path / "float.npy", np.zeros(16, dtype=np.float32))
    with pytest.raises(ValueError, match="1-D integer"):
        load_splits(cfg(tmp_path / "float.npy"))
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "a.txt").write_text("only one document")
    with pytest.raises(ValueError, match="no document fell into the (val|train) split"):
        load_splits(cfg(tmp_path / "one"))
    with pytest.raises(ValueError, match="val_fraction"):
        load_splits(cfg(tmp_path / "one", val_fraction=0.0))

    splits = Splits(np.arange(1000, dtype=np.uint16), np.arange(100, dtype=np.uint16))
    with pytest.raises(ValueError, match=r"validation split has 100 tokens but train.seq_len=256 needs at "
                                         r"least 257.*--data.val_fraction"):
        require_length(splits, 256)
    require_length(splits, 99)
    with pytest.raises(ValueError, match="token id 999 but model.vocab_size=256"):
        check_vocab(splits, 256)
    check_vocab(splits, 1000)
    with pytest.raises(ValueError, match="needs at least"):
        TokenSampler(splits.val, 100, seed=0)
    with pytest.raises(ValueError, match="validation split .* needs at least"):
        eval_batches(splits.val, 100, 4, 2)


# ---------------------------------------------------------------- sampler

TOKENS = np.arange(1000, dtype=np.uint16)   # token == position, so a window is named by its first token
T = 8


def test_sampler_deterministic_and_pure():
    a, b = TokenSampler(TOKENS, T, seed=1), TokenSampler(TOKENS, T, seed=1)
    a.batch(3, 5), a.batch(400, 7)                      # earlier calls must not matter
    for p in (0, 17, 250):
        assert all(torch.equal(u, v) for u, v in zip(a.batch(p, 6), b.batch(p, 6)))
    assert not torch.equal(a.batch(0, 6)[0], TokenSampler(TOKENS, T, seed=2).batch(0, 6)[0])


def test_sampler_seekable_and_shifted():
    s = TokenSampler(TOKENS, T, seed=0)
    n = s.n_windows
    for p, B, k in ((0, 16, 5), (n - 3, 8, 2), (2 * n - 1, 4, 1)):   # includes epoch boundaries
        x, y = s.batch(p, B)
        x1, y1 = TokenSampler(TOKENS, T, seed=0).batch(p, k)
        x2, y2 = TokenSampler(TOKENS, T, seed=0).batch(p + k, B - k)
        assert torch.equal(x, torch.cat([x1, x2])) and torch.equal(y, torch.cat([y1, y2]))
        assert x.shape == (B, T) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(y[:, -1], x[:, -1] + 1)
    assert s.epoch_of(n - 1) == 0 and s.epoch_of(n) == 1


def test_sampler_epochs():
    s = TokenSampler(TOKENS, T, seed=0)
    n = s.n_windows
    starts = []
    for e in range(3):
        first = s.batch(e * n, n)[0][:, 0]
        shift = int(first.min())
        assert 0 <= shift < T
        assert sorted(((first - shift) // T).tolist()) == list(range(n))   # every window exactly once
        assert torch.all((first - shift) % T == 0)
        starts.append(first)
    assert not torch.equal(starts[0], starts[1]) and not torch.equal(starts[1], starts[2])
    tiny = TokenSampler(np.arange(T + 1), T, seed=0)                       # exactly one sequence
    assert torch.equal(tiny.batch(0, 3)[0], torch.arange(T).repeat(3, 1))


def test_eval_batches():
    batches = eval_batches(TOKENS, T, 4, 3)
    assert len(batches) == 3 and all(x.shape == (4, T) for x, _ in batches)
    starts = torch.cat([x[:, 0] for x, _ in batches])
    assert starts[0] == 0 and starts[-1] + T + 1 == len(TOKENS)             # spans the whole split
    assert torch.all(starts.diff() >= T)                                  # no overlapping inputs
    assert all(torch.equal(x[:, 1:], y[:, :-1]) for x, y in batches)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, eval_batches(TOKENS, T, 4, 3)))
    few = eval_batches(np.arange(50), T, 4, 10)                           # 6 windows fit
    assert len(few) == 1 and few[0][0].shape == (4, T)
    assert eval_batches(np.arange(20), T, 4, 10)[0][0].shape == (2, T)    # fewer than one batch
