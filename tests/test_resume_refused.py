"""A refused resume changes nothing: every file of the run folder is byte-identical afterwards (sha256 before and
after), and sample.py and the Hugging Face export still read the run."""
from __future__ import annotations

import hashlib
import sys

import pytest

import sample as sample_script
import train as train_script
from nanomega.data.tokenizer import load_tokenizer
from nanomega.hf import transfer as hf

TINY = ["--model.d_model=32", "--model.n_layers=1", "--model.n_heads=2", "--model.n_kv_heads=1",
        "--model.ffn_dim=64", "--model.max_seq_len=32", "--train.seq_len=32", "--train.batch_size=2",
        "--train.compile=false", "--train.eval_batches=1", "--train.sample_tokens=0"]


def fingerprint(folder) -> dict:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def run(tmp_path):
    """A byte-level run of 2 steps on a small text folder, and a BPE trained on the same text."""
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(12):
        (texts / f"page_{i:02d}.txt").write_text(f"Page {i} of a small corpus, in plain words. " * 30)
    out = tmp_path / "run"
    train_script.main(TINY + [f"--data.path={texts}", f"--train.out_dir={out}", "--train.steps=2"])
    load_tokenizer("train:300", corpus=sorted(texts.iterdir()), cache_dir=tmp_path / "cache").save(tmp_path / "bpe")
    return texts, out, tmp_path


@pytest.mark.parametrize("change, refusal", [
    (["--data.tokenizer=train:300", "--model.vocab_size=320"], "was trained with tokenizer bytes"),
    (["--data.tokenizer={bpe}", "--model.vocab_size=320"], "was trained with tokenizer bytes"),
    (["--model.d_model=48"], "tok_embed"),
    (["--model.n_layers=2"], "lacks tensor 'layers.1"),
    (["--optim.name=sgd"], "which the optimizer state expects"),
], ids=["train-bpe", "tokenizer-file", "width", "depth", "optimizer"])
def test_a_refused_resume_leaves_every_file_as_it_was(run, change, refusal, capsys, monkeypatch):
    texts, out, tmp = run
    before = fingerprint(out)
    assert "tokenizer/nanomega_tokenizer.json" in before and any(k.startswith("ckpt-") for k in before)
    args = TINY + [f"--data.path={texts}", f"--train.out_dir={out}", "--train.steps=4", "--train.resume=true",
                   f"--data.cache_dir={tmp / 'cache'}"] + [c.format(bpe=tmp / "bpe") for c in change]
    with pytest.raises(SystemExit, match=refusal):
        train_script.main(args)
    assert fingerprint(out) == before

    # the intact run still samples and exports, with its own (byte) tokenizer
    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", ["sample.py", f"--out_dir={out}", "--prompt=Page", "--tokens=5"])
    sample_script.main()
    assert capsys.readouterr().out.split("\n")[1].startswith("Page")
    hf.export(out, tmp / "hf")
    assert (tmp / "hf" / "config.json").is_file() and fingerprint(out) == before


def test_an_accepted_resume_writes_the_runs_tokenizer(run, capsys):
    """The other side: a run resumed with its own tokenizer goes on (the check refuses only a different one)."""
    texts, out, tmp = run
    train_script.main(TINY + [f"--data.path={texts}", f"--train.out_dir={out}", "--train.steps=3",
                              "--train.resume=true", f"--data.tokenizer={out / 'tokenizer'}"])
    assert "resumed from" in capsys.readouterr().out
    assert (out / "ckpt-00000003").is_dir()
