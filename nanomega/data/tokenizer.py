"""Tokenizers: UTF-8 bytes, or any Hugging Face `tokenizers` tokenizer (a tokenizer.json, a model folder,
or a byte-level BPE trained here on the corpus).

Every tokenizer has the same small surface, which data preparation, training, sampling and export use:
    name, vocab_size, eos_id, bos_id, pad_id           (bos_id / pad_id may be None)
    stop_ids                     the ids generation stops at: the EOS, and the end-of-turn ids the model's
                                 folder names (Hugging Face's generate stops at generation_config's eos_token_id)
    encode(text) -> ids          no special tokens added: the caller decides where documents start and end
    encode_batch(texts)          the same for many texts (the `tokenizers` library runs them in parallel)
    decode(ids) -> str
    token_bytes() -> list[int]   how many bytes of UTF-8 text each id stands for (0 for special tokens):
                                 what turns nats per token into bits per byte (nanomega.run.metrics)
    identity() -> dict           kind, name and the sha256 of its serialised form: names the tokenizer in
                                 caches and in prepared data's meta.json
    save(folder)                 files that load_tokenizer(folder) reads back; for a `tokenizers` tokenizer
                                 also what transformers.AutoTokenizer.from_pretrained(folder) reads

load_tokenizer(spec) turns a --data.tokenizer value into one of them: "bytes", a tokenizer.json, a folder
(a Hugging Face model folder, or one this module saved), or "train:<vocab>" (a BPE trained on the corpus
and cached by the corpus's hash and the vocabulary size, so a second run loads it instead of training).
This module imports nothing from nanomega (the ground layer).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from pathlib import Path

EOT = "<|endoftext|>"        # the trained BPE's end-of-text token (GPT-2's name for it)


def read_text(raw: bytes) -> str:
    """A text document's bytes as text: UTF-8, a byte that is not UTF-8 replaced by U+FFFD. The one decoding
    policy of the BPE trainer, data preparation and every tokenizer's reading of text files (docs/data.md):
    real corpora hold a stray Latin-1 file (the standard library does), and a run should not die on it. The
    byte tokenizer decodes nothing: its ids are the file's bytes as they are."""
    return raw.decode("utf-8", errors="replace")
_BYTES_FILE = "nanomega_tokenizer.json"     # what ByteTokenizer.save writes: there is nothing else to store
_GENERATION_FILE = "generation_config.json"  # transformers' file; its eos_token_id lists where generation ends


def _byte_to_char() -> dict[int, str]:
    """The byte-level BPE alphabet (GPT-2's): each byte as one printable character. Printable Latin-1
    bytes stand for themselves; the other 68 (controls, space, soft hyphen...) take the characters from
    U+0100 on, in byte order. Used to count the bytes behind a byte-level token."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class ByteTokenizer:
    """UTF-8 bytes as tokens: no training, no files, and every string round-trips.

    Documents are joined with NUL (id 0), which never occurs in source code or text: that is its EOS."""
    name = "bytes"
    vocab_size = 256
    eos_id = 0
    bos_id = None
    pad_id = None
    stop_ids = (0,)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        # Ids >= 256 can come from a model with a padded vocabulary; they mean nothing here.
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_bytes(self) -> list[int]:
        """The bytes of text each id stands for (validation bits per byte, nanomega.run.metrics): one each."""
        return [1] * self.vocab_size

    def _serialised(self) -> str:
        return json.dumps({"kind": "bytes", "vocab_size": self.vocab_size, "eos_id": self.eos_id}, sort_keys=True)

    def identity(self) -> dict:
        return {"kind": "bytes", "name": self.name, "sha256": hashlib.sha256(self._serialised().encode()).hexdigest()}

    def save(self, folder) -> None:
        """nanomega_tokenizer.json (what load_tokenizer reads) and the same byte vocabulary as a `tokenizers`
        byte-level BPE without merges (id = byte value), so an exported byte-level model loads with
        transformers.AutoTokenizer too. NUL is not declared EOS there: it is an ordinary byte of text."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        Path(folder).mkdir(parents=True, exist_ok=True)
        Path(folder, _BYTES_FILE).write_text(self._serialised() + "\n")
        tok = Tokenizer(models.BPE({c: b for b, c in _byte_to_char().items()}, []))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.save(str(Path(folder, "tokenizer.json")))
        Path(folder, "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}, indent=2) + "\n")


def separator_id(tok) -> int | None:
    """The token that separates documents: the EOS (written after each document), else the BOS (written
    before it); None when the tokenizer has neither. Data joining, the sampler's document starts and an
    empty evaluation context all use it."""
    return tok.eos_id if tok.eos_id is not None else tok.bos_id


def _token_content(value) -> str | None:
    """A special token as tokenizer_config.json / special_tokens_map.json write it: a string, or an
    AddedToken dict with its text under "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}): it may be truncated; copy it again from where the "
                         "tokenizer came from, or delete it") from None
    return content if isinstance(content, dict) else {}


def _ids(value) -> list[int]:
    """A *_token_id entry of config.json / generation_config.json: one id, a list of them, or absent."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


class HFTokenizer:
    """A `tokenizers.Tokenizer` (Hugging Face's fast tokenizer library) with BOS / EOS / PAD ids.

    From a tokenizer.json file, or a folder holding one. In a folder the special tokens are named by
    tokenizer_config.json (bos_token, eos_token, pad_token; a string or an AddedToken dict), else by
    special_tokens_map.json, else config.json's bos_token_id / eos_token_id / pad_token_id; a token name
    is turned into its id by the tokenizer's own vocabulary, so the two files cannot disagree silently.
    """

    def __init__(self, tokenizer, name: str, bos: str | None = None, eos: str | None = None,
                 pad: str | None = None, ids: dict | None = None, stop: list[int] = ()):
        self.tok, self.name = tokenizer, name
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        ids = ids or {}
        for role, text in (("bos", bos), ("eos", eos), ("pad", pad)):
            token_id = tokenizer.token_to_id(text) if text is not None else ids.get(role)
            if text is not None and token_id is None:
                raise ValueError(f"tokenizer {name}: its {role} token {text!r} is not in its vocabulary; "
                                 f"fix {role}_token in tokenizer_config.json")
            setattr(self, f"{role}_id", token_id)
        # the EOS first, then the folder's other end ids (an instruct model's end-of-turn), each once
        wanted = [self.eos_id, *stop] if self.eos_id is not None else list(stop)
        self.stop_ids = tuple(dict.fromkeys(i for i in wanted if 0 <= i < self.vocab_size))

    @classmethod
    def from_path(cls, path) -> "HFTokenizer":
        from tokenizers import Tokenizer
        path = Path(os.path.expanduser(str(path)))
        folder = path if path.is_dir() else path.parent
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(
                f"{file} does not exist; give a tokenizer.json or a folder holding one (a folder with only a "
                "sentencepiece tokenizer.model can be converted: python -c \"from transformers import AutoTokenizer; "
                f"AutoTokenizer.from_pretrained('{folder}').save_pretrained('{folder}')\")")
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as e:     # the library raises a bare Exception ("EOF while parsing a value ...")
            raise ValueError(f"{file} is not a readable tokenizer.json ({e}); it may be truncated or from a newer "
                             "`tokenizers`: copy it again from where it came from (a cached train:<vocab> "
                             f"tokenizer: delete {folder} and it is trained again)") from None
        names = {}
        for source in ("tokenizer_config.json", "special_tokens_map.json"):
            content = _read_json(folder / source)
            for role in ("bos", "eos", "pad"):
                if role not in names and _token_content(content.get(f"{role}_token")) is not None:
                    names[role] = _token_content(content[f"{role}_token"])
        config = _read_json(folder / "config.json")
        ids = {}
        for role in ("bos", "eos", "pad"):
            value = _ids(config.get(f"{role}_token_id"))   # some configs list several EOS ids; the first ends documents
            if value:
                ids[role] = value[0]
        # generation stops at every id generation_config.json and config.json call an end (Llama 3's and Qwen's
        # instruct models list the end-of-turn token there), as transformers' generate does
        stop = _ids(_read_json(folder / _GENERATION_FILE).get("eos_token_id")) + _ids(config.get("eos_token_id"))
        return cls(tokenizer, str(path), names.get("bos"), names.get("eos"), names.get("pad"), ids, stop)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast (tokenizers >= 0.21): the same ids without character offsets, ~25% faster
        return [e.ids for e in self.tok.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        # A model's vocabulary may be padded past the tokenizer's (a multiple of 64): those ids mean nothing.
        return self.tok.decode([i for i in ids if 0 <= i < self.vocab_size], skip_special_tokens=False)

    def token_bytes(self) -> list[int]:
        """Bytes of text per id. A byte-level tokenizer's token is spelled in the byte alphabet (one
        character per byte); byte-fallback tokens <0xNN> are one byte; otherwise the UTF-8 length of the
        token decoded alone (a metaspace "▁" counts as the space it stands for). Special tokens: 0."""
        spec = json.loads(self.tok.to_str())
        byte_level = "ByteLevel" in json.dumps(spec.get("decoder"))
        alphabet = {c: b for b, c in _byte_to_char().items()}
        special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        out = []
        for i in range(self.vocab_size):
            piece = self.tok.id_to_token(i)
            if i in special or piece is None:
                out.append(0)
            elif byte_level and all(c in alphabet for c in piece):
                out.append(len(piece))
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                out.append(1)
            else:
                out.append(len(piece.replace("▁", " ").encode("utf-8")))
        return out

    @functools.cached_property
    def _sha256(self) -> str:
        # its serialised form is megabytes for a large vocabulary (Qwen's 151k: ~11 MB), and the identity is
        # asked for by every cache key, check and checkpoint: hashed once (the tokenizer is never changed)
        return hashlib.sha256(self.tok.to_str().encode("utf-8")).hexdigest()

    def identity(self) -> dict:
        return {"kind": "tokenizers", "name": self.name, "sha256": self._sha256}

    def save(self, folder) -> None:
        """tokenizer.json plus the two small files transformers reads for the special tokens."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.tok.save(str(folder / "tokenizer.json"))
        special = {f"{role}_token": self.tok.id_to_token(getattr(self, f"{role}_id"))
                   for role in ("bos", "eos", "pad") if getattr(self, f"{role}_id") is not None}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, **special}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
        if self.stop_ids != ((self.eos_id,) if self.eos_id is not None else ()):   # end-of-turn ids besides the EOS
            (folder / _GENERATION_FILE).write_text(json.dumps({"eos_token_id": list(self.stop_ids)}, indent=2) + "\n")


def train_bpe(texts_or_files, vocab_size: int, eos: str = EOT, min_frequency: int = 2) -> HFTokenizer:
    """A byte-level BPE (GPT-2's scheme: any text encodes, nothing is unknown) with `eos` as its one special
    token and end-of-text id. `texts_or_files`: strings are texts, Path objects are files to read."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    base = 256 + 1
    if vocab_size < base:
        raise ValueError(f"a byte-level BPE needs vocab_size >= {base} (256 bytes and {eos}); got {vocab_size}")
    items = list(texts_or_files)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[eos],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    files = [p for p in items if isinstance(p, Path)]
    texts = [t for t in items if not isinstance(t, Path)]
    if files and texts:
        raise ValueError("train_bpe takes texts or files, not both; pass Path objects or strings")
    if files:       # read here, not by the library (which stops at the first byte that is not UTF-8): read_text
        tok.train_from_iterator(_lines(files), trainer)
    else:
        tok.train_from_iterator(texts, trainer)
    return HFTokenizer(tok, f"bpe-{vocab_size}", eos=eos)


def _lines(files: list[Path]):
    """The files' lines, each with its newline: what `tokenizers` feeds its trainer from a file, so a corpus of
    UTF-8 files trains the tokenizer its own file reader would."""
    for path in files:
        text = read_text(path.read_bytes())
        start = 0
        while start < len(text):
            end = text.find("\n", start)
            end = len(text) if end < 0 else end + 1
            yield text[start:end]
            start = end


def corpus_hash(corpus) -> str:
    """sha256 over the corpus's contents, document by document (strings, or Path objects read as bytes)."""
    h = hashlib.sha256()
    for doc in corpus:
        data = doc.read_bytes() if isinstance(doc, Path) else doc.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))     # lengths too, so ["ab", "c"] differs from ["a", "bc"]
        h.update(data)
    return h.hexdigest()


def load_tokenizer(spec: str, corpus=None, cache_dir=None):
    """A tokenizer from a --data.tokenizer value (see the module docstring). `corpus` (texts or Paths) is
    needed only by "train:<vocab>"; the trained tokenizer is kept under `cache_dir` (default
    ~/.cache/nanomega/tokenizers) in a folder named by the vocabulary size and the corpus's hash."""
    if spec in ("", "bytes"):
        return ByteTokenizer()
    if spec.startswith("train:"):
        vocab_size = vocab_size_of(spec)
        if corpus is None:
            raise ValueError(f"tokenizer {spec!r} trains on the corpus, but no corpus was given")
        corpus = list(corpus)
        cache = Path(os.path.expanduser(str(cache_dir or "~/.cache/nanomega"))) / "tokenizers"
        folder = cache / f"bpe-{vocab_size}-{corpus_hash(corpus)[:16]}"
        if (folder / "tokenizer.json").is_file():
            return HFTokenizer.from_path(folder)
        tok = train_bpe(corpus, vocab_size)
        # Save under a temporary name and rename, so a concurrent run never reads half a folder.
        tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
        tok.save(tmp)
        try:
            os.replace(tmp, folder)
        except OSError:       # another run finished first: its folder is the same tokenizer
            shutil.rmtree(tmp, ignore_errors=True)
        return HFTokenizer.from_path(folder)
    path = Path(os.path.expanduser(spec))
    if path.is_dir() and (path / _BYTES_FILE).is_file():
        return ByteTokenizer()
    if path.exists():
        return HFTokenizer.from_path(path)
    raise FileNotFoundError(f"tokenizer {spec!r}: no such file or folder; give 'bytes', a tokenizer.json, a "
                            "folder holding one (a Hugging Face model folder), or train:<vocab size>")


def vocab_size_of(spec: str) -> int:
    """The vocabulary size a --data.tokenizer value gives, without training anything ("train:<vocab>": vocab)."""
    if spec.startswith("train:"):
        try:
            return int(spec[len("train:"):])
        except ValueError:
            raise ValueError(f"tokenizer {spec!r}: write train:<vocab size>, e.g. train:4096") from None
    return load_tokenizer(spec).vocab_size


def separator_of(spec: str) -> int | None:
    """The separator (separator_id) a --data.tokenizer value gives, without training anything: a trained BPE's
    end-of-text token is its first (train_bpe's one special token), NUL for bytes."""
    if spec.startswith("train:"):
        return 0
    return separator_id(load_tokenizer(spec))


# A run keeps its tokenizer in <out_dir>/tokenizer, beside its checkpoints, and each checkpoint's meta.json
# records the tokenizer's identity(). Beside, not inside each checkpoint: it is written once per run, not
# once per checkpoint (a Hugging Face tokenizer.json is ~10 MB), the checkpoint writer and its CRC list are
# left alone, and the identity in every checkpoint still catches a folder swapped for another tokenizer.
RUN_FOLDER = "tokenizer"


def load_run_tokenizer(checkpoint_dir, identity: dict | None):
    """The tokenizer checkpoint `checkpoint_dir` (<out_dir>/ckpt-N) was trained with: <out_dir>/tokenizer,
    checked against the checkpoint's recorded identity. A checkpoint from before runs stored a tokenizer
    (identity None, no folder) was trained on bytes."""
    folder = Path(checkpoint_dir).parent / RUN_FOLDER
    if identity is None and not folder.is_dir():
        return ByteTokenizer()
    if not folder.is_dir():
        raise FileNotFoundError(f"{checkpoint_dir} was trained with tokenizer {identity.get('name')} "
                                f"(sha256 {identity.get('sha256', '')[:12]}...), stored in {folder}, which is missing; "
                                "copy the run's tokenizer folder back beside its checkpoints")
    tok = load_tokenizer(str(folder))
    if identity is not None and tok.identity()["sha256"] != identity.get("sha256"):
        raise ValueError(f"{folder} holds tokenizer {tok.identity()['sha256'][:12]}..., but {checkpoint_dir} was "
                         f"trained with {identity.get('sha256', '')[:12]}... ({identity.get('name')}); put that "
                         "run's tokenizer folder back")
    return tok
