"""Data preparation (nanomega/data/prepare.py) and the run's tokenizer in train.py, sample.py and export, checked
against the `tokenizers` library's own encoding and transformers' AutoTokenizer."""
from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

import sample as sample_script
import train as train_script
from nanomega import checkpoint
from nanomega.data import sources as data
from nanomega.hf import transfer as hf
from nanomega.config import DataConfig, parse_args
from nanomega.data.sources import check_prepared, load_splits
from nanomega.eval.generate import sample
from nanomega.models import init
from nanomega.data.prepare import prepare
from nanomega.data.tokenizer import EOT, ByteTokenizer, HFTokenizer, load_run_tokenizer, train_bpe

TINY = ["--model.d_model=32", "--model.n_layers=1", "--model.n_heads=2", "--model.n_kv_heads=1",
        "--model.ffn_dim=64", "--model.max_seq_len=32", "--train.seq_len=32", "--train.batch_size=2",
        "--train.compile=false", "--train.eval_batches=1", "--train.log_every=1", "--train.eval_every=2"]


def corpus(root, n=60):
    """A folder of small text files and a JSONL of documents, with non-ASCII text."""
    (root / "sub").mkdir(parents=True)
    for i in range(n):
        (root / f"f{i:02d}.py").write_text(f"def f{i}(x):\n    return x * {i}  # ünïcode {i % 7}\n" * (1 + i % 3))
    rows = [{"text": f"document {i}: café {i * i}", "id": i} for i in range(n)] + [{"text": ""}]
    (root / "sub" / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def expected_split(key: str, fraction: float) -> bool:
    """The documented rule (docs/data.md), written out here."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") % 10_000 < fraction * 10_000


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    texts = [(f"def f{i}(x):\n    return x * {i}  # ünïcode\n document café") for i in range(300)]
    train_bpe(texts, 320).save(folder)
    return folder / "tokenizer.json"


@pytest.mark.parametrize("workers", [1, 2])
def test_prepared_tokens_are_tokenizers_encoding_of_each_document_with_eos(tmp_path, tokenizer_file, workers):
    root = corpus(tmp_path / "in")
    meta = prepare([str(root)], str(tokenizer_file), tmp_path / "out", workers=workers, val_fraction=0.2,
                   progress=False)
    ref = Tokenizer.from_file(str(tokenizer_file))
    eos = ref.token_to_id(EOT)
    want = {False: [], True: []}
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        key = f.relative_to(root).as_posix()
        if f.suffix == ".jsonl":
            docs = [(f"{key}:{n}", json.loads(line)["text"]) for n, line in enumerate(f.read_text().splitlines(), 1)]
        else:
            docs = [(key, f.read_text())]
        for k, text in docs:
            if text:
                want[expected_split(k, 0.2)].append(ref.encode(text, add_special_tokens=False).ids + [eos])
    for side, name in ((False, "train"), (True, "val")):
        tokens = np.fromfile(tmp_path / "out" / f"{name}.bin", dtype="<u2")
        assert tokens.tolist() == [t for doc in want[side] for t in doc]
        starts = np.load(tmp_path / "out" / f"{name}.docs.npy")
        assert starts.dtype == np.int64
        assert starts.tolist() == np.cumsum([0] + [len(d) for d in want[side]])[:-1].tolist()
        assert meta["splits"][name]["n_documents"] == len(want[side])
    assert meta["dtype"] == "uint16" and meta["eos_id"] == eos and meta["vocab_size"] == ref.get_vocab_size()
    assert meta["tokenizer"]["sha256"] == hashlib.sha256(ref.to_str().encode()).hexdigest()
    # a run reads the folder as it is: the val split unchanged, the folder's tokenizer the default
    splits = load_splits(DataConfig(path=str(tmp_path / "out")))
    assert np.array_equal(splits.val, [t for doc in want[True] for t in doc])
    assert parse_args([f"--data.path={tmp_path / 'out'}"]).data.tokenizer == str(tmp_path / "out" / "tokenizer")


def test_a_vocabulary_past_uint16_is_written_as_uint32(tmp_path):
    words = [f"w{i}" for i in range(70_000)]
    model = models.WordLevel({w: i for i, w in enumerate(words + ["[UNK]", "<eos>"])}, unk_token="[UNK]")
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    HFTokenizer(tok, "words", eos="<eos>").save(tmp_path / "tok")
    (tmp_path / "a.txt").write_text("w1 w69999 w65536")
    (tmp_path / "b.txt").write_text("w2 w3")
    meta = prepare([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], str(tmp_path / "tok"), tmp_path / "out",
                   val_fraction=0, progress=False)
    assert meta["dtype"] == "uint32"
    assert np.fromfile(tmp_path / "out" / "train.bin", dtype="<u4").tolist() == [1, 69999, 65536, 70001, 2, 3, 70001]


def test_the_jsonl_field_is_chosen_and_a_missing_one_refused_before_work(tmp_path, tokenizer_file):
    rows = [{"content": f"doc {i}", "text": 5} for i in range(20)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"d.jsonl:1 has no text field 'text'.*pass --field"):
        prepare([str(tmp_path / "d.jsonl")], str(tokenizer_file), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    meta = prepare([str(tmp_path / "d.jsonl")], str(tokenizer_file), tmp_path / "out", field="content",
                   val_fraction=0.1, progress=False)
    ref = Tokenizer.from_file(str(tokenizer_file))
    assert meta["n_tokens"] == sum(len(ref.encode(f"doc {i}").ids) + 1 for i in range(20))


def test_bad_inputs_are_refused_before_any_work(tmp_path, tokenizer_file):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    with pytest.raises(ValueError, match="hold no bytes"):
        prepare([str(tmp_path / "empty")], str(tokenizer_file), tmp_path / "o1", progress=False)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        prepare([str(tmp_path / "nothing")], str(tokenizer_file), tmp_path / "o2", progress=False)
    (tmp_path / "t.bin").write_bytes(b"\0\0")
    with pytest.raises(ValueError, match="already token ids"):
        prepare([str(tmp_path / "t.bin")], str(tokenizer_file), tmp_path / "o3", progress=False)
    assert not any((tmp_path / o).exists() for o in ("o1", "o2", "o3"))


def test_a_prepared_vocabulary_larger_than_the_model_is_refused_from_meta_json(tmp_path, tokenizer_file):
    prepare([str(corpus(tmp_path / "in"))], str(tokenizer_file), tmp_path / "out", val_fraction=0.2, progress=False)
    (tmp_path / "out" / "train.bin").write_bytes(b"")      # nothing is read: a scan would find nothing wrong
    with pytest.raises(ValueError, match=r"prepared with tokenizer .* of 320 ids .* model.vocab_size=256"):
        check_prepared(DataConfig(path=str(tmp_path / "out")), 256)
    with pytest.raises(SystemExit, match=r"320 ids but model.vocab_size=256"):
        train_script.main(TINY + [f"--data.path={tmp_path / 'out'}", "--model.vocab_size=256",
                                  f"--train.out_dir={tmp_path / 'run'}"])
    with pytest.raises(SystemExit, match=r"prepared with tokenizer .* but the run's is bytes"):
        train_script.main(TINY + [f"--data.path={tmp_path / 'out'}", "--data.tokenizer=bytes",
                                  "--model.vocab_size=512", f"--train.out_dir={tmp_path / 'run'}"])


def test_an_init_from_folder_whose_tokenizer_disagrees_with_config_json_is_refused(tmp_path, tokenizer_file):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "hf"
    tok = HFTokenizer.from_path(tokenizer_file)
    config = transformers.LlamaConfig(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                      bos_token_id=None, eos_token_id=tok.eos_id + 1)
    config.save_pretrained(folder)
    tok.save(folder)
    args = ["--train.compile=false", "--train.seq_len=32", f"--train.init_from={folder}",
            f"--data.path={corpus(tmp_path / 'in')}", f"--train.out_dir={tmp_path / 'run'}"]
    with pytest.raises(SystemExit, match=rf"EOS id {tok.eos_id}, but .*config.json says eos_token_id={tok.eos_id + 1}"):
        train_script.main(args)
    assert parse_args(args).data.tokenizer == str(folder)       # the folder's tokenizer is the default
    config.eos_token_id = tok.eos_id
    config.vocab_size = 300                                     # smaller than the tokenizer's 320
    config.save_pretrained(folder)
    with pytest.raises(SystemExit, match=r"has 320 ids but model.vocab_size=300"):
        train_script.main(args)
    assert not (tmp_path / "run").exists()


def test_a_folder_without_a_tokenizer_is_warned_about_not_held_to_its_special_ids(tmp_path):
    """Byte data for a folder with no tokenizer.json: the byte tokenizer has no special tokens to match
    config.json's (its NUL separator is not an EOS the model learned), so the run is warned, not refused."""
    transformers = pytest.importorskip("transformers")
    from nanomega.run import preflight
    folder = tmp_path / "hf"
    transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                             bos_token_id=1, eos_token_id=2).save_pretrained(folder)
    cfg = parse_args([f"--train.init_from={folder}", "--train.seq_len=32", f"--train.out_dir={tmp_path / 'run'}"])
    with pytest.warns(UserWarning, match="has no tokenizer.json, so this run reads its text as bytes"):
        preflight.check_tokenizer(cfg)


def test_train_py_with_a_trained_bpe_samples_and_exports_with_it(tmp_path, capsys, monkeypatch):
    transformers = pytest.importorskip("transformers")
    root = corpus(tmp_path / "in")
    out = tmp_path / "run"
    cfg = parse_args(TINY + [f"--data.path={root}", "--data.tokenizer=train:300", "--data.val_fraction=0.3",
                             f"--data.cache_dir={tmp_path / 'cache'}", f"--train.out_dir={out}", "--train.steps=4",
                             "--train.sample_tokens=12"])
    assert cfg.model.vocab_size == 300                 # follows the tokenizer
    record = train_script.train(cfg)
    assert record["step"] == 4 and math.isfinite(record["val_bpb"])
    [trained] = (tmp_path / "cache" / "tokenizers").iterdir()
    ref = Tokenizer.from_file(str(trained / "tokenizer.json"))
    assert (out / "tokenizer" / "tokenizer.json").read_text() == (trained / "tokenizer.json").read_text()
    printed = capsys.readouterr().out
    assert "--- sample ---\ndef " in printed
    # bits per byte with the BPE's byte counts: below nats/token / ln 2, as its tokens stand for several bytes
    assert record["val_bpb"] < record["val_loss"] / math.log(2) / 1.5

    # sample.py decodes with the run's tokenizer: its text is the library's decoding of the same ids
    ckpt = checkpoint.latest(out)
    monkeypatch.setattr(sys, "argv", ["sample.py", f"--ckpt={ckpt}", "--prompt=def f", "--tokens=10", "--seed=3"])
    sample_script.main()
    text = capsys.readouterr().out.split("\n", 1)[1].split("\n" + "-" * 40)[0]
    params, _, _ = checkpoint.load(ckpt, init(cfg.model, device="meta"))
    prompt = torch.tensor([ref.encode("def f", add_special_tokens=False).ids])
    ids = sample(params, cfg.model, prompt, 10, 0.8, 40, torch.Generator().manual_seed(3))[0].tolist()
    assert text == ref.decode(ids, skip_special_tokens=False)

    # export writes the tokenizer: AutoTokenizer encodes as the library does, config.json names its EOS
    hf.export(out, tmp_path / "hf")
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert auto.encode("def f(x): café", add_special_tokens=False) == ref.encode("def f(x): café").ids
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == ref.token_to_id(EOT)

    # the run is tied to its tokenizer: resuming with another, or a swapped tokenizer folder, is refused
    with pytest.raises(SystemExit, match=r"was trained with tokenizer .* resume with --data.tokenizer="):
        train_script.main(TINY + [f"--data.path={root}", "--data.tokenizer=bytes", "--model.vocab_size=300",
                                  f"--train.out_dir={out}", "--train.resume=true", "--train.steps=6"])
    shutil.rmtree(out / "tokenizer")
    ByteTokenizer().save(out / "tokenizer")
    with pytest.raises(ValueError, match="put that run's tokenizer folder back"):
        load_run_tokenizer(ckpt, checkpoint.read_meta(ckpt)["tokenizer"])


def test_a_text_folder_is_read_with_the_runs_tokenizer_and_cached(tmp_path, tokenizer_file, monkeypatch):
    root = tmp_path / "in"
    root.mkdir()
    for i in range(40):
        (root / f"f{i:02d}.txt").write_text(f"document {i}: café\n" * (1 + i % 4))
    tok = HFTokenizer.from_path(tokenizer_file)
    ref = Tokenizer.from_file(str(tokenizer_file))
    cfg = DataConfig(path=str(root), val_fraction=0.25, cache_dir=str(tmp_path / "cache"))
    splits = load_splits(cfg, tok=tok)
    for side, tokens in ((False, splits.train), (True, splits.val)):
        docs = [ref.encode(f.read_text()).ids for f in sorted(root.iterdir()) if expected_split(f.name, 0.25) == side]
        joined = [t for k, d in enumerate(docs) for t in ([ref.token_to_id(EOT)] if k else []) + d]
        assert np.asarray(tokens).tolist() == joined
    # a second read comes from the cache: no document is encoded again
    monkeypatch.setattr(HFTokenizer, "encode_batch", lambda *a: pytest.fail("encoded again"))
    again = load_splits(cfg, tok=tok)
    assert np.array_equal(again.train, splits.train) and np.array_equal(again.val, splits.val)


def test_train_spec_learns_from_the_jsonl_texts_not_the_json(tmp_path):
    rows = [{"text": f"the number {i} ünïcode", "meta": "x" * 50} for i in range(200)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    meta = prepare([str(tmp_path / "d.jsonl")], "train:280", tmp_path / "out", val_fraction=0.1,
                   cache_dir=tmp_path / "cache", progress=False)
    ref = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer" / "tokenizer.json"))
    assert ref.token_to_id("Ġnumber") is not None and ref.token_to_id("xx") is None   # merged from the field only
    assert meta["n_tokens"] == sum(len(ref.encode(r["text"]).ids) + 1 for r in rows)


def test_the_builtin_corpus_is_read_with_the_runs_tokenizer(tmp_path, tokenizer_file, monkeypatch):
    root = Path(sysconfig.get_paths()["stdlib"])
    files = data.builtin_corpus_files()[:40]             # a few files keep it fast; the rule is the same
    monkeypatch.setattr(data, "builtin_corpus_files", lambda: files)
    cfg = DataConfig(val_fraction=0.2, cache_dir=str(tmp_path))
    ref = Tokenizer.from_file(str(tokenizer_file))
    splits = load_splits(cfg, tok=HFTokenizer.from_path(tokenizer_file))
    for side, tokens in ((False, splits.train), (True, splits.val)):
        docs = [ref.encode(f.read_bytes().decode("utf-8", "replace")).ids for f in files
                if expected_split(f.relative_to(root).as_posix(), 0.2) == side]
        joined = [t for k, d in enumerate(docs) for t in ([ref.token_to_id(EOT)] if k else []) + d]
        assert np.asarray(tokens).tolist() == joined
    # bytes, given or not, are the stream they always were: the bytes of the files joined by NUL
    for tok in (None, ByteTokenizer()):
        plain = load_splits(cfg, tok=tok)
        want = b"\0".join(f.read_bytes() for f in files if not expected_split(f.relative_to(root).as_posix(), 0.2))
        assert plain.train.dtype == np.uint16 and bytes(np.asarray(plain.train, dtype=np.uint8)) == want
