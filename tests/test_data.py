"""Tests for nanomega.data.sources: tokenizer, sources, errors, and the seekable sampler."""
import hashlib
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from nanomega.config import DataConfig
from nanomega.data.sources import ByteTokenizer, Splits, builtin_corpus_files, check_vocab, load_splits, require_length
from nanomega.data.sampler import TokenSampler, eval_batches


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
    splits = load_splits(cfg(tmp_path / "one"))       # one document: its tail is validation (test_small_data.py)
    assert bytes(np.concatenate(splits).astype(np.uint8)) == b"only one document" and len(splits.val) == 2
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "a.txt").write_text("x")
    with pytest.raises(ValueError, match="one document of 1 token.*too little"):
        load_splits(cfg(tmp_path / "tiny"))
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


# ---------------------------------------------------------------- shuffle, align=bos, vocab per batch

@pytest.mark.parametrize("n", [1, 2, 3, 7, 1000, 65537])
def test_shuffle_is_a_permutation(n):
    from nanomega.data.sampler import _Shuffle
    order = [_Shuffle(n, "k")(i) for i in range(n)]
    assert sorted(order) == list(range(n))
    if n >= 1000:   # a shuffle, not the identity or a rotation; and another key gives another order
        assert sum(a == i for i, a in enumerate(order)) < n // 100
        assert order != [_Shuffle(n, "other")(i) for i in range(n)]


def test_shuffle_needs_no_memory_for_a_huge_corpus():
    # 2**40 windows (a quadrillion tokens at 1,024 per sequence): torch.randperm would need 8 TB.
    from nanomega.data.sampler import _Shuffle
    s = _Shuffle(1 << 40, "k")
    picks = [s(i) for i in range(2000)]
    assert len(set(picks)) == 2000 and all(0 <= p < 1 << 40 for p in picks)
    assert max(picks) > 1 << 38          # spread over the whole range


def documents_with_separator(lengths, sep=0):
    """Documents as runs of ids 1..; each document opens with `sep` (BOS-style, as GPT-2 shards do)."""
    out, value = [], 1
    for n in lengths:
        out.append(sep)
        out += list(range(value, value + n - 1))
        value += n - 1
    return np.array(out, dtype=np.uint16)


def test_align_bos_starts_every_window_at_a_document_or_within_a_long_one():
    lengths = [5, 30, 9, 3, 20, 12, 9]            # the 30- and 20-token documents need several windows of 8
    tokens = documents_with_separator(lengths)
    s = TokenSampler(tokens, T, seed=0, align="bos")
    doc_starts = np.cumsum([0] + lengths[:-1])
    expected = sorted(int(d) + k * T for d, n in zip(doc_starts, lengths) for k in range(-(-n // T))
                      if d + k * T + T + 1 <= len(tokens))
    n = s.n_windows
    assert n == len(expected)
    for epoch in range(3):
        x, y = s.batch(epoch * n, n)
        # ids are distinct apart from the separator, so a window's first two tokens name where it starts
        windows = np.lib.stride_tricks.sliding_window_view(tokens, 2)
        starts = sorted(int(np.flatnonzero(np.all(windows == row[:2].numpy(), axis=1))[0]) for row in x)
        assert starts == expected                    # every window exactly once per epoch
        assert torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(s.batch(0, n)[0], s.batch(n, n)[0])      # epochs reshuffle


def test_align_bos_on_megatron_documents_uses_the_index(tmp_path):
    from tests.test_formats import write_indexed
    docs = [[[7] * 3], [[8] * 20], [[9] * 6], [[10] * 11]]          # no separator token anywhere
    write_indexed(tmp_path / "corpus", docs)
    splits = load_splits(DataConfig(path=str(tmp_path / "corpus"), val_path=str(tmp_path / "corpus")))
    s = TokenSampler(splits.train, T, seed=1, align="bos")
    x, _ = s.batch(0, s.n_windows)
    # documents start at 0, 3, 23 and 29; the 20-token one again at 11 and 19, the 11-token one at 37, but
    # a window needs 9 of the 40 tokens, so the last start is 31
    assert s.n_windows == 6
    assert sorted(int(v) for v in x[:, 0]) == [7, 8, 8, 8, 9, 10]


def test_align_bos_blend_resumes_where_it_stopped():
    a = documents_with_separator([5, 30, 9, 3, 20])
    b = documents_with_separator([12, 12, 40], sep=0) + 1000
    b[b == 1000] = 0
    from nanomega.data.sources import Blend
    blend = Blend([a, b], [0.3, 0.7], ["a", "b"])
    whole = TokenSampler(blend, T, seed=4, align="bos").batch(0, 40)
    resumed = TokenSampler(blend, T, seed=4, align="bos").batch(25, 15)
    assert torch.equal(whole[0][25:], resumed[0]) and torch.equal(whole[1][25:], resumed[1])


def test_large_splits_are_checked_per_batch(monkeypatch):
    import nanomega.data.sources as data
    tokens = np.arange(1000, dtype=np.int64)               # ids up to 999 under a 500-id model
    with pytest.raises(ValueError, match="train split has token id 999"):
        check_vocab(Splits(tokens, tokens[:50]), 500)
    monkeypatch.setattr(data, "_SCAN_LIMIT", 100)           # as if the corpus were too big to read at start-up
    check_vocab(Splits(tokens, tokens[:50]), 500)           # start-up reads nothing
    unchecked, s = TokenSampler(tokens, T, seed=0), TokenSampler(tokens, T, seed=0, vocab_size=500)
    good = next(p for p in range(s.n_windows) if int(unchecked.batch(p, 1)[1].max()) < 500)
    bad = next(p for p in range(s.n_windows) if int(unchecked.batch(p, 1)[1].max()) >= 500)
    assert torch.equal(s.batch(good, 1)[0], unchecked.batch(good, 1)[0])
    with pytest.raises(ValueError, match=rf"training sequence {bad}\.\..*model.vocab_size=500"):
        s.batch(bad, 1)


def test_a_dtype_that_cannot_exceed_the_vocabulary_is_not_read():
    class Unreadable(np.ndarray):
        def __getitem__(self, key):
            raise AssertionError("read")
    tokens = np.zeros(100, dtype=np.uint16).view(Unreadable)
    check_vocab(Splits(tokens, tokens), 70_000)             # uint16 ids are all < 65,536


def test_align_bos_on_a_prepared_folder_reads_its_document_starts(tmp_path):
    from nanomega.data.prepare import prepare
    docs = tmp_path / "docs"
    docs.mkdir()
    texts = [f"document {k} " + "x" * (3 + 7 * k) for k in range(30)]
    for k, text in enumerate(texts):
        (docs / f"{k:02d}.txt").write_text(text)
    prepare([str(docs)], "bytes", tmp_path / "prepared", val_fraction=0.2, progress=False)
    splits = load_splits(DataConfig(path=str(tmp_path / "prepared")))
    # No separator to search for: the starts come from train.docs.npy, the first token of each document.
    s = TokenSampler(splits.train, T, seed=0, align="bos", separator=None)
    tokens = np.asarray(splits.train)
    starts = np.load(tmp_path / "prepared" / "train.docs.npy")
    lengths = np.diff(np.append(starts, len(tokens)))
    expected = [int(d) + k * T for d, n in zip(starts, lengths) for k in range(-(-int(n) // T))
                if d + k * T + T + 1 <= len(tokens)]
    rows = s.batch(0, s.n_windows)[0].numpy()
    assert s.n_windows == len(expected)
    assert sorted(map(tuple, rows)) == sorted(tuple(tokens[a:a + T]) for a in expected)
    fitting = sum(int(d) + T + 1 <= len(tokens) for d in starts)
    assert sum(bytes(row.astype(np.uint8)) == b"document" for row in rows) == fitting    # every document's first window
    with pytest.raises(ValueError, match="records no document boundaries.*neither an EOS nor a BOS"):
        TokenSampler(np.arange(100), T, seed=0, align="bos", separator=None)
