"""Batches from token splits: a seekable random sampler for training, fixed windows for validation.

The sampler is a pure function of (seed, position), so resuming from a checkpoint only needs the number of
sequences consumed so far; its epoch order is a keyed shuffle that holds nothing per window (_Shuffle), so a
trillion-token corpus costs no memory. The splits come from nanomega/data/sources.py (arrays, memory-mapped files,
formats.TokenStream pieces, or a Blend of sources).
"""
from __future__ import annotations

import hashlib

import numpy as np
import torch

from nanomega.data.formats import TokenStream
from nanomega.data.sources import Blend, out_of_vocab, too_short

DATA_ORDER = "shuffle"    # TokenSampler's epoch order (_Shuffle); checkpoints record it as "data_order"
_U64 = (1 << 64) - 1


def check_data_order(stored, checkpoint: str) -> None:
    """Refuse to resume a run whose checkpoint drew its batches in another order: it would go on over other
    sequences than it would have seen. Runs before the keyed shuffle drew a torch.randperm per epoch and
    recorded no "data_order" (or "randperm")."""
    if stored != DATA_ORDER:
        raise ValueError(f"checkpoint {checkpoint} drew its batches in data order {stored or 'randperm'!r} (a "
                         f"torch.randperm per epoch), which this version no longer draws (only {DATA_ORDER!r}); "
                         "resume it with nanomega at commit 12e7aa1, the last that draws it, or start a new run "
                         "in another --train.out_dir")


def _rows(tokens, starts, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.stack([np.asarray(tokens[s:s + seq_len + 1], dtype=np.int64) for s in starts])
    rows = torch.from_numpy(rows)
    return rows[:, :-1], rows[:, 1:]


class _Shuffle:
    """A pseudo-random bijection of range(n) named by a key, in O(1) memory: a four-round Feistel network
    over the smallest even number of bits that covers n, with outputs >= n walked back in (cycle walking,
    Black & Rogaway 2002; at most 4 domain values per index on average). It replaces torch.randperm(n),
    whose n int64 indices per rank would be 8 GB for a trillion-token corpus at 1,024 tokens per sequence."""

    def __init__(self, n: int, key: str):
        bits = max(2, (n - 1).bit_length())
        self.n, self.half = n, (bits + 1) // 2
        self.keys = [int.from_bytes(hashlib.sha256(f"{key}:{r}".encode()).digest()[:8], "little") for r in range(4)]

    def _mix(self, x: int, key: int) -> int:
        z = (x + key + 0x9E3779B97F4A7C15) & _U64     # splitmix64's finaliser: every input bit moves every output bit
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
        return (z ^ (z >> 31)) & ((1 << self.half) - 1)

    def __call__(self, i: int) -> int:
        mask = (1 << self.half) - 1
        x = i
        while True:
            left, right = x >> self.half, x & mask
            for key in self.keys:
                left, right = right, left ^ self._mix(right, key)
            x = (left << self.half) | right
            if x < self.n:
                return x


def document_starts(tokens, separator: int | None, chunk: int = 1 << 24) -> np.ndarray:
    """Where documents begin (int64, sorted, starting with 0). Megatron's indexed datasets (a TokenStream of
    documents) and prepared folders (their *.docs.npy) record their documents' first tokens; in any other
    source documents begin at every `separator` token, which then opens the sequence as its BOS, as
    modded-nanogpt's align_to_bos does: the source is read once, a chunk at a time (e.g. 1 s per GB of
    uint16 tokens on one core)."""
    if isinstance(tokens, TokenStream) and tokens.documents:
        starts = tokens.ends - tokens.length
        return starts[tokens.length > 0]
    if getattr(tokens, "document_starts", None) is not None:     # a prepared folder's *.docs.npy
        return np.asarray(tokens.document_starts, dtype=np.int64)
    if separator is None:
        raise ValueError("data.align=bos needs to know where documents start, but this source records no document "
                         "boundaries and the tokenizer has neither an EOS nor a BOS token to find them by; prepare "
                         "the data with python -m nanomega.data prepare, or use --data.align=none")
    found = [np.zeros(1, np.int64)]
    for a in range(0, len(tokens), chunk):
        hits = np.flatnonzero(np.asarray(tokens[a:a + chunk]) == separator) + a
        found.append(hits[hits > 0])
    return np.concatenate(found)


class TokenSampler:
    """Random windows of seq_len + 1 tokens, a pure function of (seed, position).

    align="none" (default): epoch e cuts the stream at shift_e + k * seq_len (k < n_windows) and visits
    those windows in the order shuffle_e; shift_e and shuffle_e are named by (seed, e), so successive
    epochs see different cuts and orders. Sequence number i is window shuffle_e(i % n_windows) of epoch
    e = i // n_windows. n_windows leaves room for any shift in [0, seq_len) when the data allows, so
    each epoch skips under two windows' worth of tokens at the ends.
    align="bos": every window starts where a document does (document_starts), or seq_len further into a
    document longer than one sequence, so no document's text is skipped; a window runs on into the next
    document when its own is short. Windows that would pass the end of the stream are left out.
    Nothing held grows with the corpus but the document starts (align="bos" only, 8 bytes a document).
    vocab_size > 0 refuses any batch holding an id the model cannot embed (check_vocab's complement).
    """

    def __init__(self, tokens, seq_len: int, seed: int, align: str = "none", separator: int = 0, vocab_size: int = 0):
        self.blend = tokens if isinstance(tokens, Blend) else None
        self.tokens, self.seq_len, self.seed, self.align, self.vocab_size = tokens, seq_len, seed, align, vocab_size
        if self.blend is not None:      # one sampler per source, each walking its own epochs (Blend.locate)
            self.parts = [TokenSampler(t, seq_len, seed, align, separator, vocab_size) for t in tokens.parts]
            return
        if len(tokens) < seq_len + 1:
            raise too_short("train", len(tokens), seq_len)
        if align == "bos":
            starts = document_starts(tokens, separator)
            lengths = np.diff(np.append(starts, len(tokens)))
            per_doc = -(-lengths // seq_len)                       # windows a document starts: ceil(len / seq_len)
            self.doc_starts, self.window_ends = starts, np.cumsum(per_doc)
            self.n_windows = self._count_fitting(last=len(tokens) - seq_len - 1)
            self.max_shift = 0
        else:
            self.n_windows = max(1, (len(tokens) - 1) // seq_len - 1)
            self.max_shift = min(seq_len - 1, len(tokens) - 1 - self.n_windows * seq_len)
        self._cached = None   # (epoch, shift, shuffle): a speed-up only, never changes results

    def _starts(self, windows: np.ndarray) -> np.ndarray:
        """align="bos": the first token of each window number (document, then seq_len steps into it)."""
        doc = np.searchsorted(self.window_ends, windows, side="right")
        before = np.where(doc > 0, self.window_ends[np.maximum(doc - 1, 0)], 0)
        return self.doc_starts[doc] + (windows - before) * self.seq_len

    def _count_fitting(self, last: int) -> int:
        # Window starts grow with the window number, so the fitting ones are a prefix: bisect for its end.
        lo, hi = 0, int(self.window_ends[-1])
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if self._starts(np.array([mid]))[0] <= last else (lo, mid)
        return lo

    def epoch_of(self, position: int) -> int:
        return position // self.n_windows

    def _epoch(self, epoch: int) -> tuple[int, "_Shuffle"]:
        if self._cached is None or self._cached[0] != epoch:
            digest = hashlib.sha256(f"{self.seed}:{epoch}".encode()).digest()
            shift = int.from_bytes(digest[:8], "little") % (self.max_shift + 1)
            self._cached = (epoch, shift, _Shuffle(self.n_windows, f"{self.seed}:{epoch}"))
        return self._cached[1], self._cached[2]

    def batch(self, position: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequences position .. position + batch_size - 1 as (x, y) int64 [B, T]; may span epochs."""
        if self.blend is not None:
            where = map(self.blend.locate, range(position, position + batch_size))
            rows = [self.parts[k].batch(n, 1) for k, n in where]
            return torch.cat([x for x, _ in rows]), torch.cat([y for _, y in rows])
        windows = []
        for i in range(position, position + batch_size):
            epoch, j = divmod(i, self.n_windows)
            shift, shuffle = self._epoch(epoch)
            windows.append((shift, int(shuffle(j))))
        if self.align == "bos":
            starts = self._starts(np.array([w for _, w in windows], dtype=np.int64)).tolist()
        else:
            starts = [shift + w * self.seq_len for shift, w in windows]
        x, y = _rows(self.tokens, starts, self.seq_len)
        # check_vocab reads at most _SCAN_LIMIT tokens at start-up; every id the model sees passes here (microseconds)
        if self.vocab_size and (int(y.max()) >= self.vocab_size or int(x.min()) < 0):
            bad = int(y.max()) if int(y.max()) >= self.vocab_size else int(x.min())
            raise out_of_vocab(f"training sequence {position}.. (tokens from {starts[0]})", bad, self.vocab_size)
        return x, y


def eval_batches(tokens, seq_len: int, batch_size: int, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed windows spread evenly over the split, so every evaluation measures the same text.

    If fewer than batch_size * n_batches windows fit, fewer full batches are used (same shapes, so a
    compiled model is not recompiled); if not even one full batch fits, one smaller batch.
    A Blend's validation is mixed like its training: the first batch_size * n_batches sequences of the
    blend's order name their sources (each source's share is its weight), and each source's windows are
    spread evenly over its own held-out part (overlapping where it holds fewer).
    """
    if isinstance(tokens, Blend):
        sources = [tokens.locate(i)[0] for i in range(batch_size * n_batches)]
        counts = np.bincount(sources, minlength=len(tokens.parts))
        spread = [iter(_spread(part, seq_len, int(c))) for part, c in zip(tokens.parts, counts)]
        rows = [_rows(tokens.parts[k], [next(spread[k])], seq_len) for k in sources]
        return [(torch.cat([x for x, _ in rows[b:b + batch_size]]), torch.cat([y for _, y in rows[b:b + batch_size]]))
                for b in range(0, len(rows), batch_size)]
    if len(tokens) < seq_len + 1:
        raise too_short("validation", len(tokens), seq_len)
    available = (len(tokens) - 1) // seq_len        # non-overlapping windows that fit
    if available >= batch_size:
        n_batches = min(n_batches, available // batch_size)
    else:
        n_batches, batch_size = 1, available
    starts = _spread(tokens, seq_len, n_batches * batch_size)
    return [_rows(tokens, starts[b * batch_size:(b + 1) * batch_size], seq_len) for b in range(n_batches)]


def _spread(tokens, seq_len: int, count: int) -> list[int]:
    """count window starts evenly from the first to the last that fits."""
    last = len(tokens) - seq_len - 1                # the largest valid start
    return [k * last // (count - 1) if count > 1 else 0 for k in range(count)]
