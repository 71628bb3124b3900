"""The token formats users already have, each written here by hand to its published layout (struct and
tofile, as nanoGPT's prepare.py, llm.c's write_datafile and Megatron's _IndexWriter lay them out; never by
a writer of ours), then read through nanomega.data.sources: tokens and splits exactly, and bad data refused."""
from __future__ import annotations

import hashlib
import pickle
import struct
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch
import pytest

import train as train_script
from nanomega.config import DataConfig, parse_args
from nanomega.data.sources import check_vocab, declared_vocab_size, load_splits, require_length
from nanomega.data.sampler import TokenSampler, eval_batches

MASK = (1 << 64) - 1


def cfg(path, val_fraction=0.1, val_path=""):
    return DataConfig(path=str(path), val_fraction=val_fraction, val_path=str(val_path))


def arr(tokens) -> np.ndarray:
    return np.asarray(tokens[0:len(tokens)], dtype=np.int64)


def write_shard(path: Path, tokens, magic=20240520, version=1, dtype="<u2", n_tokens=None) -> None:
    """llm.c / modded-nanogpt: 256 little-endian int32 (magic, version, token count, zeros), then the ids."""
    header = struct.pack("<3i", magic, version, len(tokens) if n_tokens is None else n_tokens) + bytes(253 * 4)
    path.write_bytes(header + np.asarray(tokens).astype(dtype).tobytes())


def write_indexed(prefix: Path, docs: list[list[list[int]]], code=8, dtype="<u2", magic=b"MMIDIDX\x00\x00") -> None:
    """Megatron's indexed dataset: docs is a list of documents, each a list of sequences (lists of ids)."""
    seqs = [s for d in docs for s in d]
    itemsize = np.dtype(dtype).itemsize
    lengths = [len(s) for s in seqs]
    pointers = [sum(lengths[:i]) * itemsize for i in range(len(seqs))]
    bounds = [0]
    for d in docs:
        bounds.append(bounds[-1] + len(d))
    with open(str(prefix) + ".idx", "wb") as f:
        f.write(magic + struct.pack("<Q", 1) + struct.pack("<B", code))
        f.write(struct.pack("<Q", len(seqs)) + struct.pack("<Q", len(bounds)))
        f.write(struct.pack(f"<{len(seqs)}i", *lengths) + struct.pack(f"<{len(seqs)}q", *pointers))
        f.write(struct.pack(f"<{len(bounds)}q", *bounds))
    Path(str(prefix) + ".bin").write_bytes(np.array([t for s in seqs for t in s], dtype=dtype).tobytes())


def splitmix64(x: int) -> int:
    """The published SplitMix64 finaliser, in Python integers."""
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def in_val(name: str, doc: int, val_fraction: float) -> bool:
    """The documented rule (docs/data.md): splitmix64(sha256(name)[:8] little-endian + index) % 10000."""
    salt = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return splitmix64((salt + doc) & MASK) % 10_000 < val_fraction * 10_000


def random_docs(rng, n_docs, vocab, max_seqs=3):
    return [[rng.integers(0, vocab, size=rng.integers(1, 20)).tolist() for _ in range(rng.integers(1, max_seqs + 1))]
            for _ in range(n_docs)]


# ---------------------------------------------------------------- nanoGPT

def write_nanogpt(folder: Path, rng, vocab=65) -> tuple[np.ndarray, np.ndarray]:
    folder.mkdir()
    train, val = rng.integers(0, vocab, size=3000), rng.integers(0, vocab, size=400)
    train.astype("<u2").tofile(folder / "train.bin")
    val.astype("<u2").tofile(folder / "val.bin")
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": vocab, "itos": {i: chr(65 + i) for i in range(vocab)},
                     "stoi": {chr(65 + i): i for i in range(vocab)}}, f)
    (folder / "prepare.py").write_text("# nanoGPT's preparation script lives beside its output\n")
    (folder / "input.txt").write_text("the text it tokenized\n")
    return train, val


def test_nanogpt_folder_is_its_own_split(tmp_path):
    train, val = write_nanogpt(tmp_path / "shakespeare_char", np.random.default_rng(0))
    c = cfg(tmp_path / "shakespeare_char", val_fraction=0.5)
    splits = load_splits(c)
    assert np.array_equal(arr(splits.train), train) and np.array_equal(arr(splits.val), val)   # not re-split
    assert declared_vocab_size(c) == 65
    check_vocab(splits, 65, declared_vocab_size(c))
    with pytest.raises(ValueError, match=r"meta.pkl declares vocab_size=65 but model.vocab_size=64.*"
                                         r"--model.vocab_size=65"):
        check_vocab(splits, 64, declared_vocab_size(c))


def test_meta_pkl_that_would_run_code_is_refused(tmp_path):
    write_nanogpt(tmp_path / "d", np.random.default_rng(0))
    with open(tmp_path / "d" / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 65, "path": Path("x")}, f)     # a class: unpickling it would import code
    with pytest.raises(pickle.UnpicklingError, match="only plain dicts"):
        declared_vocab_size(cfg(tmp_path / "d"))


# ---------------------------------------------------------------- modded-nanogpt / llm.c shards

@pytest.mark.parametrize("magic,version,dtype,vocab", [(20240520, 1, "<u2", 50257), (20240801, 7, "<u4", 128256)],
                         ids=["gpt2_v1_uint16", "llama3_v7_uint32"])
def test_single_shard_split_by_position(tmp_path, magic, version, dtype, vocab):
    tokens = np.random.default_rng(1).integers(0, vocab, size=1000)
    write_shard(tmp_path / "s.bin", tokens, magic, version, dtype)
    splits = load_splits(cfg(tmp_path / "s.bin", val_fraction=0.05))
    assert np.array_equal(arr(splits.train), tokens[:950]) and np.array_equal(arr(splits.val), tokens[950:])
    check_vocab(splits, vocab)
    with pytest.raises(ValueError, match=f"token id {tokens.max()} but model.vocab_size=1000"):
        check_vocab(splits, 1000)


def test_shard_folder_concatenates_train_and_val_in_name_order(tmp_path):
    rng = np.random.default_rng(2)
    shards = {name: rng.integers(0, 50257, size=n) for name, n in
              [("fineweb_train_000002.bin", 300), ("fineweb_val_000000.bin", 200), ("fineweb_train_000001.bin", 500),
               ("fineweb_train_000003.bin", 7)]}
    (tmp_path / "fw").mkdir()
    for name, tokens in shards.items():
        write_shard(tmp_path / "fw" / name, tokens)
    splits = load_splits(cfg(tmp_path / "fw"))
    train = np.concatenate([shards[f"fineweb_train_00000{i}.bin"] for i in (1, 2, 3)])
    assert len(splits.train) == len(train) and np.array_equal(arr(splits.train), train)
    assert np.array_equal(arr(splits.val), shards["fineweb_val_000000.bin"])
    for a, b in [(0, 807), (499, 501), (790, 807), (800, 800), (123, 456)]:     # slices across shard boundaries
        assert np.array_equal(splits.train[a:b], train[a:b])
    x, y = TokenSampler(splits.train, 16, seed=3).batch(0, 64)   # the sampler reads the stream as an array
    ref = TokenSampler(train, 16, seed=3).batch(0, 64)
    assert x.equal(ref[0]) and y.equal(ref[1])
    assert all(a.equal(b) for got, want in zip(eval_batches(splits.val, 16, 4, 3),
                                               eval_batches(shards["fineweb_val_000000.bin"], 16, 4, 3))
               for a, b in zip(got, want))


def test_shard_folder_without_val_shard_is_split_by_position(tmp_path):
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, 50257, size=400), rng.integers(0, 50257, size=100)
    (tmp_path / "fw").mkdir()
    write_shard(tmp_path / "fw" / "part_000.bin", a)
    write_shard(tmp_path / "fw" / "part_001.bin", b)
    splits = load_splits(cfg(tmp_path / "fw", val_fraction=0.3))
    both = np.concatenate([a, b])
    assert np.array_equal(arr(splits.train), both[:350]) and np.array_equal(arr(splits.val), both[350:])


# ---------------------------------------------------------------- Megatron indexed dataset

@pytest.mark.parametrize("code,dtype,vocab", [(8, "<u2", 50000), (4, "<i4", 150000)], ids=["uint16", "int32"])
def test_indexed_dataset_split_by_document(tmp_path, code, dtype, vocab):
    docs = random_docs(np.random.default_rng(4), 200, vocab)
    write_indexed(tmp_path / "corpus_text_document", docs, code, dtype)
    side = [in_val("corpus_text_document", d, 0.2) for d in range(len(docs))]
    assert any(side) and not all(side)
    want = [np.array([t for d, v in zip(docs, side) if v == is_val for s in d for t in s]) for is_val in (False, True)]
    for given in ("corpus_text_document", "corpus_text_document.bin", "corpus_text_document.idx"):
        splits = load_splits(cfg(tmp_path / given, val_fraction=0.2))
        assert np.array_equal(arr(splits.train), want[0]) and np.array_equal(arr(splits.val), want[1])
    check_vocab(splits, vocab)
    # Whole when validation comes from elsewhere: every document in order, no separator inserted.
    (tmp_path / "val.txt").write_text("held out")
    whole = load_splits(cfg(tmp_path / "corpus_text_document", val_path=tmp_path / "val.txt"))
    assert np.array_equal(arr(whole.train), [t for d in docs for s in d for t in s])


def test_indexed_folder_salts_each_prefix(tmp_path):
    rng = np.random.default_rng(5)
    (tmp_path / "mg").mkdir()
    docs = {"b_text_document": random_docs(rng, 60, 1000), "a_text_document": random_docs(rng, 60, 1000)}
    for name, d in docs.items():
        write_indexed(tmp_path / "mg" / name, d)
    splits = load_splits(cfg(tmp_path / "mg", val_fraction=0.25))
    want = [[t for name in sorted(docs) for i, d in enumerate(docs[name]) if in_val(name, i, 0.25) == is_val
             for s in d for t in s] for is_val in (False, True)]
    assert np.array_equal(arr(splits.train), want[0]) and np.array_equal(arr(splits.val), want[1])


# ---------------------------------------------------------------- separate validation source

def test_val_path_reads_validation_from_another_source(tmp_path):
    (tmp_path / "train.txt").write_text("train text " * 50)
    (tmp_path / "val.txt").write_text("validation text")
    splits = load_splits(cfg(tmp_path / "train.txt", val_path=tmp_path / "val.txt"))
    assert bytes(arr(splits.train).astype(np.uint8)) == b"train text " * 50        # nothing held out of train
    assert bytes(arr(splits.val).astype(np.uint8)) == b"validation text"
    # A source that names its validation part gives that part; any other, all of it.
    train, val = write_nanogpt(tmp_path / "nano", np.random.default_rng(6))
    splits = load_splits(cfg(tmp_path / "train.txt", val_path=tmp_path / "nano"))
    assert np.array_equal(arr(splits.val), val)
    splits = load_splits(cfg(tmp_path / "nano", val_path=tmp_path / "val.txt"))
    assert np.array_equal(arr(splits.train), train)
    with pytest.raises(FileNotFoundError, match="data.val_path='.*missing.bin'.*does not exist"):
        load_splits(cfg(tmp_path / "train.txt", val_path=tmp_path / "missing.bin"))


# ---------------------------------------------------------------- bad data

def test_bad_shards_are_refused_naming_the_file_and_the_fix(tmp_path):
    tokens = np.arange(100)
    write_shard(tmp_path / "v2.bin", tokens, version=2)
    with pytest.raises(ValueError, match=r"v2.bin: magic 20240520 .* has version 1, but this header says version 2"):
        load_splits(cfg(tmp_path / "v2.bin"))
    write_shard(tmp_path / "v1_as_llama.bin", tokens, magic=20240801, version=1, dtype="<u4")
    with pytest.raises(ValueError, match="has version 7, but this header says version 1"):
        load_splits(cfg(tmp_path / "v1_as_llama.bin"))
    write_shard(tmp_path / "short.bin", tokens, n_tokens=150)
    with pytest.raises(ValueError, match=r"short.bin has 1,224 bytes but its header says 150 uint16 tokens, so "
                                         r"1,324 bytes are expected .*truncated"):
        load_splits(cfg(tmp_path / "short.bin"))
    (tmp_path / "magic").mkdir()          # a shard whose magic is wrong, beside good ones, is not read as uint16
    write_shard(tmp_path / "magic" / "fineweb_train_000001.bin", tokens)
    write_shard(tmp_path / "magic" / "fineweb_train_000002.bin", tokens, magic=20240521)
    write_shard(tmp_path / "magic" / "fineweb_val_000000.bin", tokens)
    with pytest.raises(ValueError, match=r"without one \(fineweb_train_000002.bin; .* starts with 20240521, not a "
                                         r"shard magic \[20240520, 20240801\]\); rewrite the damaged shards"):
        load_splits(cfg(tmp_path / "magic"))
    (tmp_path / "fw").mkdir()                                        # a truncated shard inside a folder too
    write_shard(tmp_path / "fw" / "fineweb_train_000001.bin", tokens)
    write_shard(tmp_path / "fw" / "fineweb_val_000000.bin", tokens, n_tokens=101)
    with pytest.raises(ValueError, match="fineweb_val_000000.bin has .* truncated"):
        load_splits(cfg(tmp_path / "fw"))


def test_bad_indexed_datasets_are_refused(tmp_path):
    docs = random_docs(np.random.default_rng(7), 20, 100)
    write_indexed(tmp_path / "bad_magic", docs, magic=b"TNTIDX\x00\x00\x00")
    with pytest.raises(ValueError, match=r"bad_magic.idx starts with b'TNTIDX.*not Megatron's b'MMIDIDX"):
        load_splits(cfg(tmp_path / "bad_magic"))
    write_indexed(tmp_path / "floats", docs, code=7, dtype="<f4")
    with pytest.raises(ValueError, match="dtype code 7; token ids need an integer code"):
        load_splits(cfg(tmp_path / "floats"))
    write_indexed(tmp_path / "cut", docs)
    data = Path(str(tmp_path / "cut") + ".bin")
    data.write_bytes(data.read_bytes()[:-2])
    with pytest.raises(ValueError, match=r"cut.bin has .* bytes but .*cut.idx indexes .* tokens .*write both again"):
        load_splits(cfg(tmp_path / "cut"))


def test_token_folders_are_never_read_as_text(tmp_path):
    (tmp_path / "mixed").mkdir()
    write_shard(tmp_path / "mixed" / "data_train_000000.bin", np.arange(100))
    (tmp_path / "mixed" / "notes.txt").write_text("some text")
    with pytest.raises(ValueError, match=r"mixes token files \(data_train_000000.bin.*\) with other files "
                                         r"\(notes.txt.*move the text files out"):
        load_splits(cfg(tmp_path / "mixed"))
    (tmp_path / "two_formats").mkdir()
    write_indexed(tmp_path / "two_formats" / "doc", random_docs(np.random.default_rng(8), 10, 100))
    np.save(tmp_path / "two_formats" / "extra.npy", np.arange(10))
    with pytest.raises(ValueError, match=r"Megatron indexed datasets .* \(extra.npy\) with no .idx"):
        load_splits(cfg(tmp_path / "two_formats"))
    (tmp_path / "only_val").mkdir()
    write_shard(tmp_path / "only_val" / "fineweb_val_000000.bin", np.arange(100))
    with pytest.raises(ValueError, match="only validation files"):
        load_splits(cfg(tmp_path / "only_val"))


# ---------------------------------------------------------------- end to end

def test_train_py_trains_on_a_nanogpt_folder(tmp_path):
    write_nanogpt(tmp_path / "nano", np.random.default_rng(9))
    out = tmp_path / "run"
    args = ["--model.d_model=16", "--model.n_layers=1", "--model.n_heads=2", "--model.n_kv_heads=1",
            "--model.ffn_dim=32", "--model.max_seq_len=16", "--model.vocab_size=65", "--train.seq_len=16",
            "--train.batch_size=2", "--train.steps=2", "--train.compile=false", "--train.eval_batches=1",
            "--train.sample_tokens=0", "--train.log_every=1", f"--data.path={tmp_path / 'nano'}",
            f"--data.cache_dir={tmp_path}", f"--train.out_dir={out}"]
    record = train_script.train(parse_args(args), quiet=True)
    assert record["step"] == 2 and np.isfinite(record["loss"])
    write_shard(tmp_path / "more.bin", np.random.default_rng(12).integers(0, 65, size=2000))
    blend = [f"--data.path=0.6 {tmp_path / 'nano'} 0.4 {tmp_path / 'more.bin'}", f"--train.out_dir={tmp_path / 'rb'}"]
    record = train_script.train(parse_args(args + blend), quiet=True)
    assert record["step"] == 2 and np.isfinite(record["loss"])
    with pytest.raises(ValueError, match="meta.pkl declares vocab_size=65 but model.vocab_size=64"):
        train_script.train(parse_args(args + ["--model.vocab_size=64", f"--train.out_dir={tmp_path / 'r2'}"]),
                           quiet=True)


# ---------------------------------------------------------------- blends

def megatron_blend_order(weights: list[Fraction], n: int) -> list[int]:
    """Megatron's build_blending_indices (helpers.cpp), written out in exact arithmetic: sample j comes
    from the dataset with the largest weights[k] * max(j, 1) - taken[k], the first on a tie."""
    total = sum(weights)
    w, taken, order = [x / total for x in weights], [0] * len(weights), []
    for j in range(n):
        errors = [w[k] * max(j, 1) - taken[k] for k in range(len(w))]
        k = errors.index(max(errors))
        order.append(k)
        taken[k] += 1
    return order


def test_blend_draws_by_weight_and_resumes_anywhere(tmp_path):
    rng = np.random.default_rng(10)
    a = rng.integers(0, 1000, size=5000)                 # each source in its own id range: a row names its source
    docs = random_docs(rng, 100, 1000)
    docs = [[[t + 1000 for t in s] for s in d] for d in docs]
    write_shard(tmp_path / "a.bin", a)
    write_indexed(tmp_path / "mg", docs)
    c = cfg(f"0.7 {tmp_path / 'a.bin'} 0.3 {tmp_path / 'mg'}", val_fraction=0.1)
    splits = load_splits(c)
    parts = [load_splits(cfg(tmp_path / "a.bin", val_fraction=0.1)), load_splits(cfg(tmp_path / "mg", val_fraction=0.1))]
    # Validation: each source's own held-out part, mixed by the training weights.
    for got, part in zip(splits.val.parts, parts):
        assert np.array_equal(arr(got), arr(part.val))
    rows = torch.cat([x for x, _ in eval_batches(splits.val, 8, 10, 10)])
    from_a = rows.max(dim=1).values < 1000
    assert int(from_a.sum()) == 70                                   # 0.7 of 100 sequences
    for k, (rows_k, part) in enumerate(((rows[from_a], parts[0]), (rows[~from_a], parts[1]))):
        last = len(part.val) - 9                                      # spread evenly over its own part
        want = [arr(part.val)[i * last // (len(rows_k) - 1):][:8] for i in range(len(rows_k))]
        assert np.array_equal(rows_k.numpy(), np.stack(want)), k
    check_vocab(splits, 2000)
    with pytest.raises(ValueError, match="token id 1"):
        check_vocab(splits, 1000)

    order = megatron_blend_order([Fraction(7, 10), Fraction(3, 10)], 10_000)
    assert order.count(0) == 7000
    seq = 8
    blended = TokenSampler(splits.train, seq, seed=4)
    singles = [TokenSampler(p.train, seq, seed=4) for p in parts]
    for start in (0, 9_990, 123_456):                 # the first period, across a period's end, far on (a resume)
        x, y = blended.batch(start, 20)
        for row, i in enumerate(range(start, start + 20)):
            block, j = divmod(i, 10_000)
            k = order[j]
            local = block * (7000 if k == 0 else 3000) + order[:j].count(k)
            want = singles[k].batch(local, 1)
            assert x[row].equal(want[0][0]) and y[row].equal(want[1][0])
            assert (int(x[row].min()) >= 1000) == (k == 1)


def test_blend_spec_errors(tmp_path):
    write_shard(tmp_path / "a.bin", np.arange(100))
    write_shard(tmp_path / "big.bin", np.arange(1000))
    splits = load_splits(cfg(f"0.5 {tmp_path / 'big.bin'} 0.5 {tmp_path / 'a.bin'}"))
    with pytest.raises(ValueError, match=r"train \(.*a.bin\) split has 90 tokens but train.seq_len=128"):
        require_length(splits, 128)
    with pytest.raises(ValueError, match="not weight-path pairs"):
        load_splits(cfg(f"0.5 {tmp_path / 'a.bin'} 0.5"))
    with pytest.raises(ValueError, match="must be positive"):
        load_splits(cfg(f"0.5 {tmp_path / 'a.bin'} -1 {tmp_path / 'a.bin'}"))
    with pytest.raises(FileNotFoundError, match="data.path=.*missing.bin.*does not exist"):
        load_splits(cfg(f"0.5 {tmp_path / 'a.bin'} 0.5 {tmp_path / 'missing.bin'}"))


def test_blend_periods_take_their_quotas_for_any_weights():
    from nanomega.data.sources import Blend
    rng = np.random.default_rng(11)
    for _ in range(4):
        weights = (rng.random(int(rng.integers(2, 7))) + 1e-3).tolist()
        blend = Blend([np.zeros(10)] * len(weights), weights, [str(i) for i in range(len(weights))])
        counts = np.bincount(blend.order, minlength=len(weights))
        assert counts.sum() == 10_000
        assert np.all(np.abs(counts - np.asarray(weights) / sum(weights) * 10_000) < 1)   # rounded, not drifted
        # Megatron's rule on the rounded weights, written out, gives the same order.
        assert megatron_blend_order([Fraction(int(c), 10_000) for c in counts], 10_000) == blend.order.tolist()
