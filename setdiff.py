"""setdiff: set diffusion language models in one readable file.

Reference: "Set Diffusion: Interpolating Token Orderings Between Autoregression and Diffusion
for Fast and Flexible Decoding", Arriola & Kuleshov, ICML 2026 (arXiv 2607.01775).

A set diffusion LM writes a sequence as a series of *sets* of positions. Every token of a set
is predicted at once from the tokens revealed in earlier sets, so one network and one loss
cover autoregression (sets of one position, left to right), masked diffusion (uniformly
random order) and block diffusion (random order inside left-to-right blocks). Because a
prediction only ever sees revealed tokens, their keys/values never change and the sampler
extends a KV cache after every step.

The file reads top to bottom in the paper's order:
    config -> tokenizer shim -> masks -> transformer -> order policy / schedule
    -> loss and likelihood bound -> samplers (cache-free reference, KV-cached) -> checkpoints
"SPEC §n" refers to the project's restatement of the method (shared/SPEC.md), which follows
the paper's sections.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import re
import time
import unicodedata
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

ORDER_POLICIES = ("staggered", "ar", "uniform", "block")


# ----------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------

@dataclass
class Config:
    """Everything needed to rebuild a model; saved in every checkpoint (SPEC §6)."""
    vocab_size: int = 260          # V, including the special tokens
    seq_len: int = 128             # L, tokens per training row (BOS ... EOS)
    n_layer: int = 4               # transformer blocks
    n_head: int = 4                # attention heads
    d_model: int = 256             # hidden width
    dropout: float = 0.1           # dropout on embeddings, attention and residual branches
    order: str = "staggered"       # order policy pi: staggered | ar | uniform | block (SPEC §1)
    set_size: int = 4              # d, target set size of the staggered / block policy
    max_set_size: int | None = None  # s, staggered window; None -> min(2d, L) (SPEC §2)
    pad_id: int = 256              # padding: never scored, decoded last
    bos_id: int = 257              # first token of every row, pinned first in every order
    eos_id: int = 258              # end of sentence (rows are wrapped sentences)
    mask_id: int = 259             # MASK: input of the mask stream, never predicted

    def __post_init__(self):
        if self.order not in ORDER_POLICIES:
            raise ValueError(f"unknown order policy {self.order!r}; choose one of {', '.join(ORDER_POLICIES)}")
        L, d = self.seq_len, self.set_size
        if L < 2:
            raise ValueError(f"seq_len must be at least 2 (BOS plus one token), got {L}")
        if not 1 <= d <= L:
            raise ValueError(f"set_size d={d} must satisfy 1 <= d <= seq_len L={L}")
        if self.max_set_size is None:
            self.max_set_size = min(2 * d, L)
        if not d <= self.max_set_size <= L:
            raise ValueError(f"max_set_size s={self.max_set_size} must satisfy d={d} <= s <= L={L}")
        if self.d_model % self.n_head or (self.d_model // self.n_head) % 2:
            raise ValueError(f"d_model={self.d_model} must split into n_head={self.n_head} heads of even size (rotary)")
        specials = (self.pad_id, self.bos_id, self.eos_id, self.mask_id)
        if len(set(specials)) != 4 or not all(0 <= t < self.vocab_size for t in specials):
            raise ValueError(f"special ids {specials} must be distinct and below vocab_size={self.vocab_size}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown config fields {sorted(unknown)}: checkpoint from another version?")
        return cls(**d)


# ----------------------------------------------------------------------------------------
# Tokenizer shim
# ----------------------------------------------------------------------------------------

# The method does not care how text becomes ids; it needs a vocabulary with four
# named special ids: PAD (fills rows after EOS), BOS (the first position, always
# given), EOS (end of a sentence) and MASK (the input of a position that has not been
# revealed yet). Two tokenizers are provided:
#   * bytes:     UTF-8 bytes, no files needed; good for toy runs and bits per byte.
#   * wordpiece: BERT uncased WordPiece read from a vocab.txt, the tokenizer used by
#                the masked-diffusion LM1B baselines, so perplexities are comparable.
# The wordpiece path re-implements HuggingFace's BertWordPieceTokenizer(lowercase=True)
# with add_special_tokens=False in the standard library only; it gives the same ids on
# any text (checked against the reference on every code point and on fuzzed text).

# BERT's special tokens. The vocab must contain all five; their ids are their lines.
_BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")

# HuggingFace splits words longer than this many characters no further: they become [UNK].
_MAX_WORD_CHARS = 100

# Code point ranges that BERT treats as CJK ideographs: each one is its own word.
# NOTE: the fifth range starts at 0x2B920 (not 0x2B820 as in Google's original BERT
# code) because that is what the HuggingFace reference does; Extension G and later
# are not in the list either, so those characters glue to their neighbours.
_CJK_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF),
               (0x2A700, 0x2B73F), (0x2B740, 0x2B81F), (0x2B920, 0x2CEAF),
               (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))

# Whitespace as BERT sees it: the Unicode White_Space property (Rust's char::is_whitespace).
# Python's str.isspace() also accepts U+001C..U+001F, which BERT deletes as control characters.
_WHITESPACE = frozenset("\t\n\r\x0b\x0c \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000"
                        + "".join(map(chr, range(0x2000, 0x200B))))


# The reference classifies characters with older Unicode tables, while Python's
# unicodedata follows the Unicode version of the interpreter. For the few hundred code
# points where the two disagree on what BERT cares about (control, non-spacing mark,
# punctuation), we pin the category the reference effectively uses. Found by probing the
# reference on every code point, against the Unicode databases of Python 3.8-3.13 and the
# newest unicodedata2 package. NOTE: this only matters for exact agreement on rare scripts.


def _code_points(ranges: str) -> frozenset:
    """Parse "0890-0891 0A76 ..." (hex, inclusive ranges) into a set of code points."""
    out = set()
    for item in ranges.split():
        lo, _, hi = item.partition("-")
        out.update(range(int(lo, 16), int(hi or lo, 16) + 1))
    return frozenset(out)


# Marks and punctuation added to Unicode later: unknown to the reference, so plain letters.
_AS_LETTER = _code_points("""
    05C8-05C9 061D 07FD 0890-0891 0897-089F 08CA-08E2 09FD-09FE 0A76 0AFA-0AFF 0B53-0B55
    0C04 0C3C 0C77 0C84 0D00 0D3B-0D3C 0D81 0EBA 0ECE 180F 1885-1886 1ABF-1AF0 1B4E-1B4F
    1B7D-1B7F 1DF6-1DFB 2E43-2E4F 2E52-2E5D 2E60-2E63 A82C A8C5 A8FF A9BD 10D24-10D27
    10D69-10D6E 10EAB-10EAD 10ECB-10ED0 10EF0-10EFF 10F46-10F50 10F55-10F59 10F82-10F89
    11070 11073-11074 110C2 110CD 111CF 1123E 11241 1133B 113BB-113C0 113CE 113D0 113D2
    113D4-113D5 113D7-113D8 113E1-113E2 11438-1143F 11442-11444 11446 1144B-1144F
    1145A-1145B 1145D-1145E 11660-1166C 116B9 1182F-11837 11839-1183B 1193B-1193C 1193E
    11943-11946 119D4-119D7 119DA-119DB 119E0 119E2 11A01-11A0A 11A33-11A38 11A3B-11A47
    11A51-11A56 11A59-11A5B 11A8A-11A96 11A98-11A9C 11A9E-11AA2 11B00-11B09 11B60
    11B62-11B64 11B66 11BE1 11C30-11C36 11C38-11C3D 11C3F 11C41-11C45 11C70-11C71
    11C92-11CA7 11CAA-11CB0 11CB2-11CB3 11CB5-11CB6 11D31-11D36 11D3A 11D3C-11D3D
    11D3F-11D45 11D47 11D90-11D91 11D95 11D97 11DF0 11EF3-11EF4 11EF7-11EF8 11F00-11F01
    11F36-11F3A 11F40 11F42-11F4F 11F5A 11FFF 12FF1-12FF2 13430-13440 13447-13455
    1611E-16129 1612D-1612F 16D6D-16D6F 16E97-16E9A 16F4F 16FE2 16FE4 1CF00-1CF2D
    1CF30-1CF46 1D127-1D128 1D25B-1D25C 1E000-1E006 1E008-1E018 1E01B-1E021 1E023-1E024
    1E026-1E02A 1E08F 1E130-1E136 1E2AE 1E2EC-1E2EF 1E4EC-1E4EF 1E5EE-1E5EF 1E5FF 1E6E3
    1E6E6 1E6EE-1E6EF 1E6F5 1E944-1E94A 1E95E-1E95F
""")
_AS_PUNCTUATION = _code_points("166D 111C9")   # now a symbol and a mark, once punctuation
_AS_MARK = _code_points("1734 1171E")           # now spacing marks (Mc), once non-spacing


def _category(ch: str) -> str:
    """Unicode general category of `ch` as the reference sees it (see the table above)."""
    cp = ord(ch)
    if cp in _AS_LETTER:
        return "Lo"
    if cp in _AS_PUNCTUATION:
        return "Po"
    if cp in _AS_MARK:
        return "Mn"
    return unicodedata.category(ch)


def _clean_char(ch: str) -> str:
    """BERT's first normalisation step for one character (clean text + CJK padding).

    Control, format and private-use characters (categories Cc, Cf, Co), NUL and the
    replacement character U+FFFD are deleted; tab/newline/CR survive as whitespace.
    NOTE: unassigned code points (Cn) are kept, as in the reference. Lone surrogates (Cs)
    cannot reach the reference at all; we delete them like the other C* characters.
    """
    if ch in "\t\n\r":
        return " "
    if ch in ("\x00", "\ufffd") or _category(ch) in ("Cc", "Cf", "Co", "Cs"):
        return ""
    if ch in _WHITESPACE:
        return " "
    cp = ord(ch)
    if any(lo <= cp <= hi for lo, hi in _CJK_RANGES):
        return f" {ch} "          # a CJK ideograph is a word on its own
    return ch


def _is_punctuation(ch: str) -> bool:
    """BERT's punctuation: all non-alphanumeric printable ASCII (so $, +, <, ^, `, ~
    count although Unicode calls them symbols) plus every Unicode P* character."""
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return _category(ch).startswith("P")


def _finish_char(ch: str) -> str:
    """BERT's remaining per-character steps, applied after NFD decomposition.

    Accents are stripped by dropping non-spacing marks (Mn), then (in this order, as in
    the reference) the character is lower-cased on its own and punctuation is padded
    with spaces so that the final whitespace split isolates it.
    NOTE: lower-casing is per character, so a word-final capital sigma becomes σ, not
    the ς that Python's str.lower() would produce; the reference does the same.
    """
    if _category(ch) == "Mn":
        return ""
    return "".join(f" {c} " if _is_punctuation(c) else c for c in ch.lower())


class _CharMap(dict):
    """A str.translate table that fills itself in on first use of each character.

    str.translate runs in C and looks every code point up in the table, so caching the
    per-character rules above makes normalisation about as fast as a plain translate.
    """

    def __init__(self, rule):
        super().__init__()
        self.rule = rule

    def __missing__(self, cp: int) -> str:
        self[cp] = out = self.rule(chr(cp))
        return out


class Tokenizer:
    """Text <-> ids with named special ids (PAD, BOS, EOS, MASK).

    Build one with Tokenizer.bytes() or Tokenizer.from_vocab(path); rebuild a saved one
    with Tokenizer.from_spec(spec). encode() adds no special tokens; decode() drops
    PAD/MASK/BOS and turns EOS into a line break.
    """

    def __init__(self, kind: str, vocab: "list | None" = None, source: str = "vocab"):
        """Prefer the constructors below; `source` names the vocab in error messages."""
        self.kind = kind
        if kind == "bytes":
            # ids 0..255 are the byte values themselves; the specials come after them.
            self.vocab_size = 260
            self.pad_id, self.bos_id, self.eos_id, self.mask_id = 256, 257, 258, 259
            self.unk_id = None                      # every byte sequence is representable
            self._pieces = None
        elif kind == "wordpiece":
            self._pieces = _check_bert_vocab(vocab, source)   # id -> token string
            self._ids = {piece: i for i, piece in enumerate(self._pieces)}
            self.vocab_size = len(self._pieces)
            # BERT's [CLS] starts and [SEP] ends a sentence, so they serve as BOS and EOS.
            self.pad_id, self.bos_id = self._ids["[PAD]"], self._ids["[CLS]"]
            self.eos_id, self.mask_id = self._ids["[SEP]"], self._ids["[MASK]"]
            self.unk_id = self._ids["[UNK]"]
            # Special-token strings written in the raw text are matched first, exactly and
            # case-sensitively ("[cls]" is ordinary text); the capture group keeps them.
            self._special_re = re.compile(
                "(" + "|".join(re.escape(s) for s in _BERT_SPECIALS) + ")")
            self._clean = _CharMap(_clean_char)
            self._finish = _CharMap(_finish_char)
            # For ASCII text NFD is the identity, so both steps fold into one table.
            self._ascii = {cp: _clean_char(chr(cp)).translate(self._finish) for cp in range(128)}
            self._longest = max(map(len, self._pieces))
            # word -> tuple of ids. Natural text repeats a small set of words, so after a
            # warm-up nearly every word is one dict lookup (memory: one entry per distinct word).
            self._memo = {}
        else:
            raise ValueError(f"unknown tokenizer kind {kind!r}; use 'bytes' or 'wordpiece'")
        # Ids that decode() leaves out: padding, not-yet-revealed positions, the start token.
        self._silent = frozenset((self.pad_id, self.mask_id, self.bos_id))

    # -- constructors ------------------------------------------------------------

    @classmethod
    def bytes(cls) -> "Tokenizer":
        """UTF-8 byte tokenizer: ids 0..255 are bytes, PAD=256, BOS=257, EOS=258, MASK=259."""
        return cls("bytes")

    @classmethod
    def from_vocab(cls, path) -> "Tokenizer":
        """BERT uncased WordPiece from a vocab.txt (one token per line, id = line number,
        30,522 lines for bert-base-uncased). Raises ValueError if it is not such a file."""
        path = os.fspath(path)
        if not os.path.isfile(path):
            problem = "is not a file" if os.path.exists(path) else "does not exist"
            raise ValueError(f"vocab file {path!r} {problem}; pass the vocab.txt of a BERT "
                             f"uncased model (bert-base-uncased's has 30,522 lines)")
        with open(path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"vocab file {path!r} is not UTF-8 text (bad byte at offset "
                             f"{e.start}); pass a BERT vocab.txt, one token per line") from None
        # NOTE: split on "\n" only; str.splitlines() would also break at characters such
        # as U+2028 or U+0085 that may be (part of) tokens. A final newline is optional.
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        vocab = [line[:-1] if line.endswith("\r") else line for line in lines]
        return cls("wordpiece", vocab, source=f"vocab file {path!r}")

    @classmethod
    def from_spec(cls, spec) -> "Tokenizer":
        """Rebuild a tokenizer from the dict returned by spec() (as stored in checkpoints)."""
        if not isinstance(spec, dict) or spec.get("kind") not in ("bytes", "wordpiece"):
            raise ValueError(f"not a tokenizer spec: {str(spec)[:80]!r}; expected a dict with "
                             f"kind 'bytes' or 'wordpiece' as written by Tokenizer.spec()")
        if spec["kind"] == "bytes":
            return cls("bytes")
        return cls("wordpiece", spec.get("vocab"), source="tokenizer spec")

    def spec(self) -> dict:
        """A JSON-serialisable description that from_spec() turns back into this tokenizer.
        The wordpiece spec carries the whole vocab, so a checkpoint needs no vocab file."""
        if self.kind == "bytes":
            return {"kind": "bytes"}
        return {"kind": "wordpiece", "vocab": list(self._pieces)}

    # -- text -> ids -------------------------------------------------------------

    def encode(self, text: str) -> list:
        """Ids of `text`, with no BOS/EOS added."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, not {type(text).__name__}")
        if self.kind == "bytes":
            return list(text.encode("utf-8"))
        ids = []
        # Odd-numbered pieces of the split are special-token strings found in the text.
        for k, chunk in enumerate(self._special_re.split(text) if "[" in text else (text,)):
            if k % 2:
                ids.append(self._ids[chunk])
            else:
                for word in self._words(chunk):
                    piece_ids = self._memo.get(word)
                    if piece_ids is None:
                        piece_ids = self._memo[word] = self._wordpiece(word)
                    ids += piece_ids
        return ids

    def _words(self, text: str) -> list:
        """BERT normalisation and pre-tokenisation: the words WordPiece will split.

        Order as in the reference: clean text and pad CJK ideographs, strip accents
        (NFD, drop Mn), lower-case, then split at whitespace and isolate punctuation.
        """
        if text.isascii():
            return text.translate(self._ascii).split()
        text = unicodedata.normalize("NFD", text.translate(self._clean))
        return text.translate(self._finish).split()

    def _wordpiece(self, word: str) -> tuple:
        """Greedy longest-match-first WordPiece (BERT): take the longest vocab entry that
        prefixes the rest of the word; pieces after the first carry the "##" mark. If any
        position has no match, the whole word is a single [UNK]."""
        if len(word) > _MAX_WORD_CHARS:
            return (self.unk_id,)
        ids, start = [], 0
        while start < len(word):
            # No vocab entry is longer than self._longest characters, so start there.
            for end in range(min(len(word), start + self._longest), start, -1):
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self._ids:
                    ids.append(self._ids[piece])
                    start = end
                    break
            else:
                return (self.unk_id,)
        return tuple(ids)

    # -- ids -> text -------------------------------------------------------------

    def decode(self, ids) -> str:
        """Text of `ids` (a list, or a tensor/array with .tolist()). PAD, MASK and BOS are
        dropped, EOS becomes a line break. WordPiece pieces are joined by spaces, except
        that a "##" piece continues the previous one."""
        ids = list(ids.tolist() if hasattr(ids, "tolist") else ids)   # may be a generator
        for i in ids:
            self._check_id(i)
        if self.kind == "bytes":
            data = bytes(10 if i == self.eos_id else i for i in ids if i not in self._silent)
            return data.decode("utf-8", errors="replace")
        parts, line_start = [], True
        for i in ids:
            if i in self._silent:
                continue
            if i == self.eos_id:
                parts.append("\n")
                line_start = True
                continue
            piece = self._pieces[i]
            if piece.startswith("##"):
                parts.append(piece[2:])             # glue to the previous piece
            else:
                parts.append(piece if line_start else " " + piece)
            line_start = False
        return "".join(parts)

    def token_str(self, i: int) -> str:
        """Printable text of one id, for pictures of the generation order."""
        self._check_id(i)
        if self.kind == "wordpiece":
            return self._pieces[i]
        names = {self.pad_id: "[PAD]", self.bos_id: "[BOS]", self.eos_id: "[EOS]",
                 self.mask_id: "[MASK]"}
        if i in names:
            return names[i]
        return chr(i) if 32 <= i < 127 else f"<0x{i:02X}>"

    def byte_length(self, ids) -> int:
        """UTF-8 bytes of the text the ids stand for: the denominator of bits per byte."""
        return len(self.decode(ids).encode("utf-8"))

    def _check_id(self, i) -> None:
        # Negative ids would silently index from the end of the vocab: refuse them.
        if not (isinstance(i, numbers.Integral) and 0 <= i < self.vocab_size):
            raise ValueError(f"token id {i!r} is outside this tokenizer's vocab "
                             f"(0..{self.vocab_size - 1})")

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size})"


def _check_bert_vocab(vocab, source: str) -> list:
    """Return `vocab` as a list of token strings if it is a usable BERT vocab, else raise
    one ValueError naming the problem and what to do about it."""
    hint = "pass the vocab.txt of a BERT uncased model (e.g. bert-base-uncased)"
    if not isinstance(vocab, (list, tuple)) or not all(isinstance(t, str) for t in vocab):
        raise ValueError(f"{source} has no vocab list of strings; {hint}")
    if not vocab:
        raise ValueError(f"{source} is empty; {hint}")
    first_line = {}
    for line, token in enumerate(vocab):
        if token == "" or token.isspace():
            raise ValueError(f"{source} has a blank token on line {line + 1}; a BERT vocab "
                             f"has exactly one token on every line, remove blank lines")
        if token in first_line:
            raise ValueError(f"{source} lists {token!r} twice (lines {first_line[token] + 1} "
                             f"and {line + 1}); a token's line number is its id, so every "
                             f"token must appear exactly once")
        first_line[token] = line
    missing = [s for s in _BERT_SPECIALS if s not in first_line]
    if missing:
        raise ValueError(f"{source} lacks the special token(s) {', '.join(missing)}, so it is "
                         f"not a BERT vocab; {hint}")
    return list(vocab)


# ----------------------------------------------------------------------------------------
# Masks (SPEC §3 training mask, §5 inference masks): one predicate, many layouts
# ----------------------------------------------------------------------------------------
# Every token in a network call carries three things:
#   rank     - its place in the decode order (the set-causal "time"),
#   is_mask  - True for a query of the mask stream, False for a clean (revealed) token,
#   slot     - a unique id, so a mask query can find its own key.
# The SPEC §3 table is then three named terms OR-ed together. The training layout
# (clean stream | mask stream) and the sampler's layouts (cache | new tokens | queries)
# are just different rank / is_mask / slot vectors fed to the same predicate.

def set_causal_predicate(q_rank, q_is_mask, q_slot, k_rank, k_is_mask, k_slot):
    """True where a query may attend a key (SPEC §3 table). Arguments broadcast."""
    clean_sees_earlier_or_same_clean = ~q_is_mask & ~k_is_mask & (k_rank <= q_rank)
    mask_sees_strictly_earlier_clean = q_is_mask & ~k_is_mask & (k_rank < q_rank)
    mask_sees_only_itself = q_is_mask & k_is_mask & (k_slot == q_slot)
    return clean_sees_earlier_or_same_clean | mask_sees_strictly_earlier_clean | mask_sees_only_itself


def set_causal_mask(L: int, device=None) -> torch.Tensor:
    """The (2L, 2L) training mask, slots in decode order: clean stream, then mask stream."""
    slot = torch.arange(2 * L, device=device)
    rank = slot % L                    # clean slot i and mask slot i both sit at order step i
    is_mask = slot >= L
    return set_causal_predicate(rank[:, None], is_mask[:, None], slot[:, None],
                                rank[None, :], is_mask[None, :], slot[None, :])


def no_empty_rows(mask: torch.Tensor) -> torch.Tensor:
    """Let a query row that may attend nothing attend everything instead.

    A fully masked row (a padding query, an unused batch slot) gives softmax over nothing:
    NaN on some attention backends and torch versions (torch 2.13's CPU kernels return 0).
    Such rows' outputs are never used, so any finite value will do."""
    return mask | ~mask.any(dim=-1, keepdim=True)


def show_mask(mask: torch.Tensor) -> str:
    """Print a (2L, 2L) training mask like SPEC §3's worked example."""
    L = mask.shape[0] // 2
    names = [f"c{i}" for i in range(L)] + [f"m{i}" for i in range(L)]
    width = max(len(n) for n in names)
    head = " " * (width + 2) + " ".join(n.rjust(width) for n in names[:L]) + " | " + \
        " ".join(n.rjust(width) for n in names[L:])
    lines = [head]
    for r, name in enumerate(names):
        cells = [str(int(v)).rjust(width) for v in mask[r].tolist()]
        lines.append(f"{name.rjust(width)} [" + " ".join(cells[:L]) + " | " + " ".join(cells[L:]) + " ]")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# Transformer (SPEC §6): pre-LN, rotary by position id, GELU MLP, no timestep input
# ----------------------------------------------------------------------------------------

class Rotary(nn.Module):
    """Rotary position embedding looked up by arbitrary position ids.

    Both streams carry ORIGINAL positions in decode order, so ids are not monotonic: the
    angles are a table indexed by id rather than a function of the slot index."""

    def __init__(self, head_dim: int, max_len: int, base: float = 10000.0):
        super().__init__()
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angle = torch.arange(max_len, dtype=torch.float64)[:, None] * inv_freq[None, :]  # (L, hd/2)
        self.register_buffer("cos", angle.cos().float(), persistent=False)
        self.register_buffer("sin", angle.sin().float(), persistent=False)

    def angles(self, positions: torch.Tensor):
        """cos, sin for position ids (B, T), each (B, 1, T, hd/2); looked up once per
        network call and shared by every layer."""
        return self.cos[positions][:, None], self.sin[positions][:, None]

    @staticmethod
    def forward(x: torch.Tensor, angles) -> torch.Tensor:
        """Rotate x (..., B, H, T, hd) by the angles of its positions."""
        cos, sin = angles
        # NOTE: rotate in (at least) float32 even under bf16 autocast: angles of late
        # positions lose their low bits in bf16.
        x1, x2 = x.to(torch.promote_types(x.dtype, torch.float32)).chunk(2, dim=-1)  # (..., hd/2)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class KVCache:
    """Clean-stream keys/values of revealed tokens, stored at their ORIGINAL positions.

    Each position is revealed once, so "slot = position" gives every row a fixed-size
    buffer (no ragged appends across a batch) and the attention mask over the cache is
    simply `filled`. Keys are cached after rotary, since a position never moves. Slot
    `length` is a trash slot for padding writes. The buffer also reserves room after the
    cache for the current call's keys, so a step attends over one preallocated view
    instead of allocating a concatenation per layer (SPEC §5; allocation-heavy steps were
    measured to halve batched CPU throughput)."""

    def __init__(self, cfg: Config, batch_size: int, length: int, max_call: int, device):
        self.cfg, self.length, self.max_call = cfg, length, max_call
        self.shape = (cfg.n_layer, batch_size, cfg.n_head, length + 1 + max_call, cfg.d_model // cfg.n_head)
        self.k = self.v = None                                 # allocated on first use, in the compute dtype
        self.filled = torch.zeros(batch_size, length + 1, dtype=torch.bool, device=device)
        self.write_pos = None                                  # (B, T) where this call's tokens go, `length` = nowhere

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Place this call's keys after the cache; return (cache + call) keys and values."""
        if self.k is None:
            self.k = torch.zeros(self.shape, dtype=k.dtype, device=k.device)
            self.v = torch.zeros(self.shape, dtype=v.dtype, device=v.device)
        s, T = self.length + 1, k.shape[2]
        self.k[layer, :, :, s:s + T] = k
        self.v[layer, :, :, s:s + T] = v
        return self.k[layer, :, :, :s + T], self.v[layer, :, :, :s + T]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """After attention: copy the clean tokens' keys/values to their positions."""
        idx = self.write_pos[:, None, :, None].expand_as(k)   # (B, H, T, hd)
        self.k[layer].scatter_(2, idx, k)
        self.v[layer].scatter_(2, idx, v)

    def commit(self):
        """Mark this call's written positions as cached (after all layers ran)."""
        self.filled.scatter_(1, self.write_pos, True)
        self.filled[:, self.length] = False


class Attention(nn.Module):
    """Multi-head attention whose only structure is the explicit boolean mask it is given:
    set-causality lives entirely in the mask (SPEC §3, §5), not in the layer."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, h, angles, attn_mask, cache=None, layer=0):
        B, T, D = h.shape
        qkv = self.qkv(h).view(B, T, 3, self.n_head, D // self.n_head).permute(2, 0, 3, 1, 4)  # (3, B, H, T, hd)
        q, k = Rotary.forward(qkv[:2], angles).unbind(0)       # original positions, any order
        v = qkv[2]
        # With a cache, the keys are [cached revealed tokens | this call's tokens] and the
        # mask's first columns say which cache slots are filled (SPEC §5).
        k_all, v_all = (k, v) if cache is None else cache.attend(layer, k, v)
        # One mask for all heads: (B or 1, 1, T, T_keys), True = may attend.
        y = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=attn_mask[:, None],
                                           dropout_p=self.dropout if self.training else 0.0)
        if cache is not None:
            # Only now may the clean tokens' keys/values join the cache: this layer's
            # attention above had to see them as call tokens, not yet as cache entries.
            cache.write(layer, k, v)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))  # (B, T, D)


class Block(nn.Module):
    """Pre-LN transformer block (SPEC §6): x + Attn(LN(x)), then x + MLP(LN(x)), GELU x4."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(),
                                 nn.Linear(4 * cfg.d_model, cfg.d_model))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, h, angles, attn_mask, cache=None, layer=0):
        h = h + self.drop(self.attn(self.ln1(h), angles, attn_mask, cache, layer))
        return h + self.drop(self.mlp(self.ln2(h)))


class SetDiffusionLM(nn.Module):
    """The network knows nothing about diffusion: (tokens, positions, mask, cache) -> logits.

    `forward(x, order)` is the two-stream training forward of SPEC §3; the samplers call
    `run` and `logits` directly with their own layouts."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.rotary = Rotary(cfg.d_model // cfg.n_head, cfg.seq_len)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)  # untied from tok_emb
        self.apply(self._init)
        nn.init.zeros_(self.head.weight)   # SPEC §6: zero-initialised head, uniform predictions at step 0

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def run(self, tokens, positions, attn_mask, cache: KVCache | None = None):
        """tokens, positions (B, T); attn_mask (B or 1, T, T_keys) bool -> hidden (B, T, D)."""
        h = self.drop(self.tok_emb(tokens))                    # (B, T, D)
        angles = self.rotary.angles(positions)                 # rotary cos/sin, shared by all layers
        for layer, block in enumerate(self.blocks):
            h = block(h, angles, attn_mask, cache, layer)
        return self.ln_f(h)

    def logits(self, h):
        """LM head with MASK suppressed: MASK never appears in data (SPEC §7.4)."""
        z = self.head(h)                                       # (B, T, V)
        return z.index_fill(-1, torch.tensor([self.cfg.mask_id], device=z.device), float("-inf"))

    def mask_stream_logits(self, x, order):
        """Two-stream forward (SPEC §3). Returns logits (B, L, V) in DECODE order and the
        matching targets x[sigma_i] (B, L): slot i predicts x[sigma_i] from x[sigma_<i]."""
        B, L = x.shape
        clean = x.gather(1, order)                             # (B, L) x[sigma_0..sigma_{L-1}]
        tokens = torch.cat([clean, torch.full_like(clean, self.cfg.mask_id)], 1)  # (B, 2L) clean | mask
        positions = torch.cat([order, order], 1)               # (B, 2L) original positions, both halves
        attn = set_causal_mask(L, x.device)[None]              # (1, 2L, 2L)
        pad = clean == self.cfg.pad_id                         # (B, L) padding, sorted last by the order
        if pad.any():
            valid = torch.cat([~pad, ~pad], 1)                 # (B, 2L)
            attn = no_empty_rows(attn & valid[:, :, None] & valid[:, None, :])
        h = self.run(tokens, positions, attn)                  # (B, 2L, D)
        return self.logits(h[:, L:]), clean                    # head only on the mask stream

    def forward(self, x, order):
        """logits[b, i] predicts x[b, i] from the tokens before position i in order[b]."""
        z, _ = self.mask_stream_logits(x, order)               # (B, L, V) decode order
        inverse = torch.argsort(order, dim=1)                  # slot of each position
        return z.gather(1, inverse[..., None].expand_as(z))    # (B, L, V) position order

    def loss(self, x, order=None, generator=None):
        """Set-factorized bound (SPEC §3): per-sequence mean NLL over non-pad tokens, batch mean."""
        return set_factorized_loss(self, x, order, generator)


# ----------------------------------------------------------------------------------------
# Order policy and the staggered schedule (SPEC §2)
# ----------------------------------------------------------------------------------------

class StaggeredSchedule:
    """Per-position masking curves m_i(t) whose first hitting times give decode orders.

    Position i's curve rises over [loc_i, loc_i + b); loc decreases with i, so early
    positions are masked last in the forward process and revealed first in generation.
    d = 1 gives the identity (AR) order, d = s = L i.i.d. times (uniform order)."""

    def __init__(self, length: int, set_size: int, max_set_size: int | None = None):
        L, d = length, set_size
        s = min(2 * d, L) if max_set_size is None else max_set_size
        if not 1 <= d <= s <= L:
            raise ValueError(f"need 1 <= set_size d={d} <= max_set_size s={s} <= length L={L}")
        self.L, self.d, self.s = L, d, s
        self.A = d / (2 * L)                                   # masked area per position
        if d == 1 or d == s:
            self.k, self.b = 1.0, 2 * self.A
        else:
            self.b = s / (L + s - 1)
            self.k = self.A / (self.b - self.A)
        if not self.b <= 1 + 1e-12 or not math.isclose(self.k * self.b / (self.k + 1), self.A, rel_tol=1e-9):
            raise ValueError(f"inconsistent schedule: b={self.b}, k={self.k}, A={self.A}")
        i = torch.arange(L, dtype=torch.float64)
        self.loc = (1 - self.b) * (L - 1 - i) / max(L - 1, 1)  # (L,) position 0 has the largest offset
        # Reach r: position i can precede j < i only if i - j < r (neighbouring loc are
        # (1-b)/(L-1) apart and each T_i lives in [loc_i, loc_i + b)).
        self.reach = math.inf if self.b >= 1 else self.b * (L - 1) / (1 - self.b)
        self.window = L if math.isinf(self.reach) else min(L, math.ceil(self.reach - 1e-9))

    def mask_prob(self, t: torch.Tensor) -> torch.Tensor:
        """m_i(t) for t (B,) in [0, 1] -> (B, L) float64."""
        u = (t.to(torch.float64)[:, None] - self.loc[None, :]) / self.b   # (B, L)
        inside = (u > 0) & (u < 1)
        # 1 - (1-u)^k through log1p / expm1: exact near u = 0 even when k < 1
        rising = -torch.expm1(self.k * torch.log1p(-u.clamp(0.0, 1.0 - 1e-16)))
        m = torch.where(u >= 1, torch.ones_like(u), torch.where(inside, rising, torch.zeros_like(u)))
        if self.d == 1:                                         # AR: a hard step
            m = (m > 0).to(torch.float64)
        return m

    def first_hitting_times(self, batch_size: int, generator=None) -> torch.Tensor:
        """T_i = loc_i + b (1 - exp(-E_i / k)), E_i ~ Exp(1), so P(T_i <= t) = m_i(t). (B, L) float64."""
        E = torch.empty(batch_size, self.L, dtype=torch.float64).exponential_(generator=generator)
        return self.loc[None, :] + self.b * -torch.expm1(-E / self.k)


def order_schedule(cfg: Config) -> StaggeredSchedule | None:
    """AR and uniform orders are settings of the staggered schedule; block is not."""
    L = cfg.seq_len
    return {"ar": lambda: StaggeredSchedule(L, 1),
            "uniform": lambda: StaggeredSchedule(L, L, L),
            "staggered": lambda: StaggeredSchedule(L, cfg.set_size, cfg.max_set_size),
            "block": lambda: None}[cfg.order]()


def decode_times(cfg: Config, batch_size: int, generator=None) -> torch.Tensor:
    """A 'reveal time' per position, (B, L) float64; decode order = time DESCENDING."""
    schedule = order_schedule(cfg)
    if schedule is not None:
        return schedule.first_hitting_times(batch_size, generator)
    # block: blocks of d positions left to right, uniform order inside each block
    block = torch.arange(cfg.seq_len, dtype=torch.float64) // cfg.set_size
    U = torch.rand(batch_size, cfg.seq_len, dtype=torch.float64, generator=generator)
    return (block.max() - block)[None, :] + U


def sample_order(cfg: Config, batch_size: int, generator=None, device=None,
                 prefix_len=0, pad_mask=None) -> torch.Tensor:
    """Sample decode orders sigma (B, L): permutations of positions (SPEC §2, pinned positions).

    Tiers, each kept by a stable sort: BOS (position 0) and the first `prefix_len` positions
    first, in position order; then free positions by reveal time descending; padding last.
    Randomness comes from `generator` on the CPU, so orders do not depend on the device."""
    L = cfg.seq_len
    T = decode_times(cfg, batch_size, generator)              # (B, L) float64
    pos = torch.arange(L)
    prefix = torch.as_tensor(prefix_len).cpu().reshape(-1, 1).clamp(min=1)  # BOS is always pinned
    pinned = pos[None, :] < prefix                            # (B or 1, L)
    pad = torch.zeros(batch_size, L, dtype=torch.bool) if pad_mask is None else pad_mask.cpu()
    tier = torch.where(pinned, 0, torch.where(pad, 2, 1))     # (B, L)
    key = torch.where(tier == 1, -T, pos.double())            # within a tier, ascending
    order = torch.argsort(key, dim=1, stable=True)
    order = order.gather(1, torch.argsort(tier.gather(1, order), dim=1, stable=True))
    return order.to(device)


def max_window(cfg: Config) -> int:
    """Largest sampler window the policy has seen in training (SPEC §2)."""
    if cfg.order == "ar":
        return 1
    if cfg.order == "block":
        return cfg.set_size
    return order_schedule(cfg).window                         # uniform: L; staggered: ceil(reach)


# ----------------------------------------------------------------------------------------
# Loss and likelihood bound (SPEC §3, §4)
# ----------------------------------------------------------------------------------------

def set_factorized_loss(model: SetDiffusionLM, x, order=None, generator=None):
    """Training objective: mean over scored tokens of -log p(x[sigma_i] | x[sigma_<i]),
    per sequence, then mean over the batch. One sampled order is an unbiased one-sample
    estimate of the negative ELBO: no time weights, no time input (SPEC §3)."""
    cfg = model.cfg
    pad = x == cfg.pad_id                                     # (B, L)
    if order is None:
        order = sample_order(cfg, x.shape[0], generator, x.device, pad_mask=pad)
    z, target = model.mask_stream_logits(x, order)           # (B, L, V), (B, L) decode order
    nll = F.cross_entropy(z.flatten(0, 1).float(), target.flatten(), reduction="none").view_as(target)
    scored = (target != cfg.pad_id).float()                  # BOS slot scored in training
    return ((nll * scored).sum(1) / scored.sum(1).clamp(min=1)).mean()


@dataclass
class Elbo:
    """Result of `elbo`: summed NLL (nats) and what is needed to report it honestly."""
    nll: float            # sum over sequences of each sequence's NLL, averaged over its orders
    tokens: int           # tokens scored (not BOS, not padding)
    num_orders: int       # K orders per sequence
    num_seqs: int
    se: float             # standard error of the per-token NLL across sequences

    @property
    def nll_per_token(self) -> float:
        return self.nll / max(self.tokens, 1)

    @property
    def ppl(self) -> float:
        """Perplexity upper bound exp(sum NLL / sum tokens) (SPEC §4)."""
        return math.exp(self.nll_per_token)

    def bits_per_byte(self, num_bytes: int) -> float:
        return self.nll / math.log(2) / max(num_bytes, 1)

    def metrics(self, num_bytes: int) -> dict:
        """Everything a reported bound comes with, as a JSON-ready dict; `num_bytes` are the
        bytes of source text the scored rows stand for (for bits per byte)."""
        return {"ppl_bound": self.ppl, "nll_per_token": self.nll_per_token, "se": self.se,
                "bits_per_byte": self.bits_per_byte(num_bytes), "num_orders": self.num_orders,
                "tokens_scored": self.tokens, "rows": self.num_seqs, "bytes": num_bytes}

    def line(self, num_bytes: int) -> str:
        """The bound in one line, as training validation and `sample.py --eval` print it."""
        return (f"ppl <= {self.ppl:.3f}  ({self.nll_per_token:.4f} +- {self.se:.4f} nats/token, "
                f"{self.bits_per_byte(num_bytes):.4f} bits/byte; {self.num_seqs} rows, "
                f"{self.tokens:,} tokens, {self.num_orders} order{'s' if self.num_orders > 1 else ''})")


@torch.no_grad()
def elbo(model: SetDiffusionLM, x: torch.Tensor, num_orders: int = 1, batch_size: int = 32,
         generator=None) -> Elbo:
    """Likelihood bound over rows x (N, L): K sampled orders per row, dropout off, BOS slot
    and padding not scored (SPEC §4). Model mode is restored afterwards."""
    cfg, device = model.cfg, next(model.parameters()).device
    was_training = model.training
    model.eval()
    seq_nll, seq_tokens = [], []
    try:
        for start in range(0, x.shape[0], batch_size):
            xb = x[start:start + batch_size].to(device).long()          # (B, L)
            B, L = xb.shape
            pad = xb == cfg.pad_id
            scored = ~pad
            scored[:, 0] &= xb[:, 0] != cfg.bos_id                       # the BOS slot is given, not scored
            total = torch.zeros(B, dtype=torch.float64)                  # on CPU: MPS has no float64
            for _ in range(num_orders):
                order = sample_order(cfg, B, generator, device, pad_mask=pad)
                logp = F.log_softmax(model(xb, order).float(), -1)       # (B, L, V) position order
                nll = -logp.gather(-1, xb[..., None])[..., 0]            # (B, L)
                total += (nll * scored).sum(1).cpu().double()
            seq_nll.append((total / num_orders).cpu())
            seq_tokens.append(scored.sum(1).cpu())
    finally:
        model.train(was_training)
    nll, tokens = torch.cat(seq_nll), torch.cat(seq_tokens).double()   # (N,) each
    N = len(nll)
    # Standard error of the ratio sum(nll) / sum(tokens) (delta method, sequences as units):
    # with equal-length rows (wrapped data) it is std(per-sequence rate) / sqrt(N).
    rate = nll.sum() / tokens.sum()
    resid = (nll - rate * tokens) / tokens.mean()
    se = float(resid.std() / math.sqrt(N)) if N > 1 else float("nan")
    return Elbo(float(nll.sum()), int(tokens.sum()), num_orders, N, se)


# ----------------------------------------------------------------------------------------
# Sampling (SPEC §5): shared pieces
# ----------------------------------------------------------------------------------------

@dataclass
class Generation:
    tokens: torch.Tensor        # (B, T) final ids; PAD after a stopping EOS
    reveal_step: torch.Tensor   # (B, T) step that revealed each position; -1 given, -2 padding
    nfe: int                    # network calls (= steps: the prompt is written during step 0)
    steps: torch.Tensor         # (B,) steps each row needed
    new_tokens: torch.Tensor    # (B,) tokens each row revealed (including any PAD-ed after EOS)
    seconds: float              # wall time

    @property
    def tokens_per_step(self) -> float:
        """Tokens revealed per network call, averaged over rows."""
        return float((self.new_tokens.double() / self.steps.clamp(min=1)).mean())


def gather_sets(select: torch.Tensor, trash: int):
    """Ragged per-row sets -> padded index lists, in position order.

    select (B, T) bool -> idx (B, n), valid (B, n); padded entries point at column `trash`."""
    count = select.sum(1, keepdim=True)                       # (B, 1)
    n = int(count.max()) if select.numel() else 0
    idx = torch.argsort((~select).to(torch.uint8), dim=1, stable=True)[:, :n]  # selected first
    valid = torch.arange(n, device=select.device)[None, :] < count
    return torch.where(valid, idx, trash), valid


def window_queries(masked: torch.Tensor, window: int, block_size: int | None):
    """Active masked positions: [f, f + w) from the leftmost masked f (SPEC §5 'Window');
    for the block policy also inside f's block (windows are block-aligned)."""
    T = masked.shape[1]
    pos = torch.arange(T, device=masked.device)[None, :]
    f = torch.argmax(masked.to(torch.uint8), dim=1, keepdim=True)   # (B, 1) leftmost masked
    active = masked & (pos >= f) & (pos < f + window)
    if block_size is not None:
        active &= pos < (f // block_size + 1) * block_size
    return active


def draw_candidates(logits, temperature: float, top_p: float, generator=None):
    """A candidate token and its confidence per query (SPEC §5 'Which tokens to reveal').

    Confidence = probability of the drawn token under the distribution it was drawn from
    (temperature-scaled, top-p truncated and renormalised; greedy uses the plain softmax).
    Sampling inverts the CDF with uniforms from a CPU generator, so results do not depend
    on the device's RNG. logits (B, n, V) -> (cand, conf) each (B, n)."""
    device = logits.device
    if device.type == "mps":
        logits = logits.cpu()                                 # MPS has no float64
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()                               # float64 stays float64 (exactness tests)
    if temperature == 0:
        probs = F.softmax(logits, -1)
        cand = probs.argmax(-1)
        return cand.to(device), probs.gather(-1, cand[..., None])[..., 0].to(device)
    # subtract the max BEFORE dividing: a tiny temperature then gives a one-hot, not inf - inf
    scaled = (logits - logits.max(-1, keepdim=True).values) / temperature
    probs = F.softmax(scaled, -1)                             # (B, n, V)
    p_sorted, vocab_idx = probs.sort(-1, descending=True)
    if top_p < 1:
        keep = (p_sorted.cumsum(-1) - p_sorted) < top_p       # the smallest set with mass >= top_p
        p_sorted = p_sorted * keep
        p_sorted = p_sorted / p_sorted.sum(-1, keepdim=True)
    # NOTE: the CDF is inverted in float64: in float32, u just below the total mass can round
    # up to it, and the search would then land on a zero-probability token such as MASK.
    cdf = p_sorted.double().cumsum(-1)                        # (B, n, V)
    u = torch.rand(cdf.shape[:-1], generator=generator, dtype=torch.float64).to(cdf.device)
    u = u * cdf[..., -1]                                      # strictly below the total mass
    j = torch.searchsorted(cdf, u[..., None], right=True)     # first entry with cdf > u: mass > 0
    return vocab_idx.gather(-1, j)[..., 0].to(device), p_sorted.gather(-1, j)[..., 0].to(device)


def commit_rule(conf, valid, threshold: float):
    """Reveal the most confident candidate plus every candidate with confidence >= tau
    (keeping the confident tokens is the same as re-masking the others). Never zero
    tokens per row that still has queries (SPEC §5, §7.5)."""
    conf = conf.masked_fill(~valid, -1.0)
    best = F.one_hot(conf.argmax(1), conf.shape[1]).bool()  # (B, n)
    return valid & ((conf >= threshold) | best)


# ----------------------------------------------------------------------------------------
# Cache-free reference step: feed every revealed token (SPEC §5, the oracle)
# ----------------------------------------------------------------------------------------

def predict_cache_free(model, xs, reveal_step, active, T):
    """Logits for the active queries from ALL revealed tokens in reveal order.

    Decode order = (reveal step, position); given tokens have step -1. Each revealed token
    attends to those before it and itself; each query to every revealed token and itself."""
    revealed = reveal_step[:, :T] != -3                                  # (B, T) includes given
    key = torch.where(revealed, reveal_step[:, :T] * (T + 1) + torch.arange(T, device=xs.device), 2**62)
    n = int(revealed.sum(1).max())
    clean_idx = torch.argsort(key, dim=1, stable=True)[:, :n]            # (B, n) decode order
    clean_valid = torch.arange(n, device=xs.device)[None, :] < revealed.sum(1, keepdim=True)
    q_idx, q_valid = gather_sets(active, trash=T)                       # (B, m)
    m = q_idx.shape[1]
    tokens = torch.cat([xs.gather(1, clean_idx), torch.full_like(q_idx, model.cfg.mask_id)], 1)
    positions = torch.cat([clean_idx, torch.where(q_valid, q_idx, 0)], 1)  # (B, n + m)
    rank = torch.cat([torch.arange(n), torch.full((m,), n)]).to(xs.device)  # queries after all clean
    is_mask = torch.arange(n + m, device=xs.device) >= n
    slot = torch.arange(n + m, device=xs.device)
    valid = torch.cat([clean_valid, q_valid], 1)                         # (B, n + m)
    attn = set_causal_predicate(rank[:, None], is_mask[:, None], slot[:, None],
                                rank[None, :], is_mask[None, :], slot[None, :])[None]
    attn = no_empty_rows(attn & valid[:, :, None] & valid[:, None, :])  # (B, n + m, n + m)
    h = model.run(tokens, positions, attn)
    return model.logits(h[:, n:]), q_idx, q_valid


# ----------------------------------------------------------------------------------------
# KV-cached step: one call writes last step's tokens and predicts the window (SPEC §5)
# ----------------------------------------------------------------------------------------

def predict_cached(model, xs, pending, active, cache: KVCache, T):
    """Input = [tokens revealed last step, in position order] + [window mask queries].

    New tokens see the cache, earlier new tokens and themselves, and their keys/values are
    written to the cache; queries see the cache, all new tokens and themselves only. This is
    the training mask restricted to the rows that matter: the same predicate, with the cache
    at rank 0, new tokens at ranks 1..n and queries after them."""
    new_idx, new_valid = gather_sets(pending, trash=T)                  # (B, n)
    q_idx, q_valid = gather_sets(active, trash=T)                       # (B, m)
    n, m, dev = new_idx.shape[1], q_idx.shape[1], xs.device
    tokens = torch.cat([xs.gather(1, new_idx), torch.full_like(q_idx, model.cfg.mask_id)], 1)
    positions = torch.cat([torch.where(new_valid, new_idx, 0), torch.where(q_valid, q_idx, 0)], 1)
    C = T + 1                                                           # cache slots incl. trash
    call_rank = torch.cat([torch.arange(1, n + 1), torch.full((m,), n + 1)]).to(dev)
    call_is_mask = torch.arange(n + m, device=dev) >= n
    k_rank = torch.cat([torch.zeros(C, dtype=torch.long, device=dev), call_rank])
    k_is_mask = torch.cat([torch.zeros(C, dtype=torch.bool, device=dev), call_is_mask])
    k_slot = torch.arange(C + n + m, device=dev)
    attn = set_causal_predicate(call_rank[:, None], call_is_mask[:, None], k_slot[C:, None],
                                k_rank[None, :], k_is_mask[None, :], k_slot[None, :])[None]
    q_ok = torch.cat([new_valid, q_valid], 1)                            # (B, n + m)
    k_ok = torch.cat([cache.filled, q_ok], 1)                            # (B, C + n + m)
    attn = no_empty_rows(attn & q_ok[:, :, None] & k_ok[:, None, :])
    cache.write_pos = torch.cat([new_idx, torch.full_like(q_idx, T)], 1)  # queries are never cached
    h = model.run(tokens, positions, attn, cache)
    cache.commit()
    return model.logits(h[:, n:]), q_idx, q_valid


# ----------------------------------------------------------------------------------------
# The sampler loop
# ----------------------------------------------------------------------------------------

def _prepare_canvas(cfg, prompt, infill, batch_size, max_new_tokens, device):
    """Validate the inputs and build the starting sequence (B, T) with MASK to fill."""
    L, bos, mask = cfg.seq_len, cfg.bos_id, cfg.mask_id
    if prompt is not None and infill is not None:
        raise ValueError("give either a prompt or an infill sequence, not both")
    src = infill if infill is not None else prompt
    if src is None:
        src = torch.full((batch_size, 1), bos, dtype=torch.long)
    src = torch.as_tensor(src, dtype=torch.long).to(device)
    src = src[None] if src.dim() == 1 else src
    if src.dim() != 2 or src.shape[0] == 0:
        raise ValueError(f"prompt/infill must have shape (T,) or (B, T), got {tuple(src.shape)}")
    if src.shape[0] == 1 and batch_size > 1:
        src = src.expand(batch_size, -1)
    elif batch_size not in (1, src.shape[0]):
        raise ValueError(f"the prompt/infill has {src.shape[0]} rows but batch_size={batch_size}: "
                         "give one row (repeated) or batch_size equal to the rows")
    if src.numel() and (src.min() < 0 or src.max() >= cfg.vocab_size):
        raise ValueError(f"token ids must lie in [0, {cfg.vocab_size}); is the input from another tokenizer?")
    if src.shape[1] == 0 or (src[:, 0] != bos).all():
        src = torch.cat([torch.full((src.shape[0], 1), bos, device=device), src], 1)  # SPEC §5
    elif (src[:, 0] != bos).any():
        raise ValueError("some rows start with BOS and some do not: make them agree")
    if infill is not None:
        if not (src == mask).any(1).all():
            raise ValueError("every infill row needs at least one MASK token to fill")
        if max_new_tokens is not None:
            raise ValueError("max_new_tokens does not apply to infilling: the MASK tokens set the length")
        if src.shape[1] > L:
            raise ValueError(f"infill sequence of {src.shape[1]} tokens (with BOS) exceeds the context L={L}")
        return src.clone()
    if (src == mask).any():
        raise ValueError("the prompt contains MASK tokens: use infill= to fill positions")
    P = src.shape[1]
    if P >= L:
        raise ValueError(f"prompt of {P} tokens (with BOS) leaves no room in the context L={L}: shorten it")
    new = L - P if max_new_tokens is None else int(max_new_tokens)
    if new < 1 or P + new > L:
        raise ValueError(f"prompt ({P} tokens with BOS) + max_new_tokens ({new}) must be in [P+1, L={L}]")
    return torch.cat([src, torch.full((src.shape[0], new), mask, device=device)], 1)


@torch.inference_mode()        # like no_grad, minus autograd's per-op bookkeeping
def generate(model: SetDiffusionLM, prompt=None, infill=None, batch_size: int = 1,
             max_new_tokens: int | None = None, window: int | None = None,
             threshold: float = float("inf"), temperature: float = 1.0, top_p: float = 1.0,
             generator: torch.Generator | None = None, use_cache: bool = True,
             stop_at_eos: bool = False) -> Generation:
    """Set sampler (SPEC §5), batched: every row has its own window and progress.

    Each step: pick the window's masked positions, make ONE network call (which also writes
    last step's revealed tokens into the cache), draw a candidate per query, reveal the
    confident ones. `use_cache=False` runs the cache-free reference path instead."""
    cfg = model.cfg
    device = next(model.parameters()).device
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if math.isnan(threshold):
        raise ValueError("threshold must be a number (> 1 reveals one token per step)")
    w_max = max_window(cfg)
    w = (cfg.set_size if cfg.order == "staggered" else w_max) if window is None else int(window)
    if not 1 <= w <= w_max:
        raise ValueError(f"window must be in [1, {w_max}] for the {cfg.order} policy "
                         f"(larger windows pose queries the model never saw in training), got {w}")
    x = _prepare_canvas(cfg, prompt, infill, batch_size, max_new_tokens, device)
    B, T = x.shape
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    # xs / step carry a trash column T so padded scatters never touch real positions.
    xs = torch.cat([x, torch.full((B, 1), cfg.pad_id, device=device)], 1)   # (B, T+1)
    given = x != cfg.mask_id
    step_of = torch.where(given, -1, -3)                                    # -3 = not revealed yet
    step_of = torch.cat([step_of, torch.full((B, 1), -3, device=device)], 1)
    pending = given.clone()                  # revealed but not yet cached: the prompt at step 0
    done = ~(x == cfg.mask_id).any(1)
    steps = torch.zeros(B, dtype=torch.long, device=device)
    new_tokens = torch.zeros(B, dtype=torch.long, device=device)       # revealed, PAD-ed later or not
    cache = KVCache(cfg, B, T, max_call=T + w, device=device) if use_cache else None
    block = cfg.set_size if cfg.order == "block" else None
    nfe = 0
    try:
        while not done.all():
            # 1. the window: masked positions in [f, f + w) per row (finished rows: none)
            masked = (xs[:, :T] == cfg.mask_id) & ~done[:, None]            # (B, T)
            active = window_queries(masked, w, block)
            # 2. one network call: logits for every query (and, cached, write last step's tokens)
            if use_cache:
                logits, q_idx, q_valid = predict_cached(model, xs, pending, active, cache, T)
            else:
                logits, q_idx, q_valid = predict_cache_free(model, xs, step_of, active, T)
            # 3. a candidate and its confidence per query; 4. keep the confident ones
            cand, conf = draw_candidates(logits, temperature, top_p, generator)   # (B, m)
            reveal = commit_rule(conf, q_valid, threshold)                       # (B, m)
            # 5. write the revealed tokens; they form this step's set (reveal step = nfe)
            masks_before = (xs[:, :T] == cfg.mask_id).sum(1)
            xs.scatter_(1, q_idx, torch.where(reveal, cand, xs.gather(1, q_idx)))
            if torch.any(((xs[:, :T] == cfg.mask_id).sum(1) >= masks_before) & q_valid.any(1)):
                # Cannot happen with a correct commit rule (SPEC §7.5); better than an endless loop.
                raise RuntimeError("a step revealed no token in a row that had queries")
            step_of.scatter_(1, q_idx, torch.where(reveal, nfe, step_of.gather(1, q_idx)))
            # the next call writes exactly these tokens into the cache
            pending = torch.zeros_like(xs, dtype=torch.bool).scatter_(1, q_idx, reveal)[:, :T]
            steps += ~done
            new_tokens += reveal.sum(1)
            nfe += 1
            done |= ~(xs[:, :T] == cfg.mask_id).any(1)
            if stop_at_eos:
                done |= _stop_at_eos(cfg, xs, step_of, T)
    finally:
        model.train(was_training)
    synchronize(device)
    with torch.inference_mode(False):  # plain tensors out: they may feed a training forward
        return Generation(xs[:, :T].clone(), step_of[:, :T].clamp(min=-2), nfe, steps.cpu().clone(),
                          new_tokens.cpu().clone(), time.perf_counter() - start)


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so that wall-clock times measure the work itself."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _stop_at_eos(cfg, xs, step_of, T):
    """Rows whose first generated EOS has everything before it revealed are done; the
    generated or still masked positions after that EOS become PAD with step -2 (SPEC §5
    'Stopping'). Given tokens (infill context) are never changed. Updates in place."""
    pos = torch.arange(T, device=xs.device)[None, :]
    eos = (xs[:, :T] == cfg.eos_id) & (step_of[:, :T] >= 0)            # generated, not given
    first = torch.where(eos, pos, T).min(1, keepdim=True).values       # (B, 1)
    unrevealed_before = ((xs[:, :T] == cfg.mask_id) & (pos < first)).any(1)
    stop = (first[:, 0] < T) & ~unrevealed_before
    after = stop[:, None] & (pos > first) & (step_of[:, :T] != -1)     # never a given token
    xs[:, :T] = torch.where(after, cfg.pad_id, xs[:, :T])
    step_of[:, :T] = torch.where(after, -2, step_of[:, :T])
    return stop


# ----------------------------------------------------------------------------------------
# Checkpoints: one dict, written atomically
# ----------------------------------------------------------------------------------------

CHECKPOINT_FORMAT = "setdiff-checkpoint-1"


def atomic_save(obj, path: str):
    """torch.save to a temporary file in the same directory, then rename over `path`:
    a crash or a full disk leaves the previous file intact."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        try:
            torch.save(obj, tmp)
        except RuntimeError as e:              # torch reports a full disk as a RuntimeError
            raise OSError(f"could not write {tmp}: {e}") from e
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def save_checkpoint(path, model: SetDiffusionLM, tokenizer: Tokenizer, **extra):
    """Save config, tokenizer spec and weights (+ extras: optimizer, ema, step, ...)."""
    model = getattr(model, "_orig_mod", model)              # unwrap torch.compile
    ckpt = {"format": CHECKPOINT_FORMAT, "config": model.cfg.to_dict(),
            "tokenizer": tokenizer.spec(), "model": model.state_dict(), **extra}
    atomic_save(ckpt, path)


def load_checkpoint(path, device="cpu"):
    """-> (model, tokenizer, ckpt dict). Strict: a wrong or damaged file raises ValueError."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint {path} not found: train one with train_small.py or check the path")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:
        raise ValueError(f"{path} is not a readable checkpoint (truncated or corrupt?): {type(e).__name__}") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a setdiff checkpoint (format {CHECKPOINT_FORMAT} expected)")
    cfg = Config.from_dict(ckpt["config"])
    tok = Tokenizer.from_spec(ckpt["tokenizer"])
    ids = (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id, tok.mask_id)
    if ids != (cfg.vocab_size, cfg.pad_id, cfg.bos_id, cfg.eos_id, cfg.mask_id):
        raise ValueError(f"{path}: tokenizer and model config disagree on vocabulary / special ids")
    model = SetDiffusionLM(cfg)
    try:
        model.load_state_dict(ckpt["model"], strict=True)
    except RuntimeError as e:
        raise ValueError(f"{path}: weights do not match the saved config: {str(e).splitlines()[0]}") from None
    return model.to(device), tok, ckpt


# ----------------------------------------------------------------------------------------
# Running it: device and dtype with the reason, autocast, wrapped rows
# ----------------------------------------------------------------------------------------

def pick_device(name: str | None = None, local_rank: int = 0) -> tuple[torch.device, str]:
    """`name` if given (checked), else the first of cuda -> mps -> cpu; and why.
    A bare "cuda" means this process's GPU under torchrun (`local_rank`)."""
    if name and name != "auto":
        try:
            device = torch.device(name)
        except RuntimeError:
            raise ValueError(f"--device {name!r} is not a device: use cpu, cuda, cuda:N or mps") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {name}: CUDA is not available on this machine")
        if device.type == "mps" and not torch.backends.mps.is_available():
            raise ValueError(f"--device {name}: MPS is not available on this machine")
        if device.type not in ("cpu", "cuda", "mps"):
            raise ValueError(f"--device {name}: use cpu, cuda, cuda:N or mps")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", local_rank)
        return device, "requested with --device"
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank), "a CUDA GPU is available"
    if torch.backends.mps.is_available():
        return torch.device("mps"), "an Apple GPU (MPS) is available"
    return torch.device("cpu"), "no GPU found"


def pick_dtype(device: torch.device, name: str = "auto") -> tuple[torch.dtype, str]:
    """Autocast dtype and why. Weights, optimizer state and EMA always stay float32."""
    if name != "auto":
        return getattr(torch, name), "requested with --dtype"
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16, "the GPU supports bf16 (the paper trains with bf16 autocast)"
    if device.type == "cuda":
        return torch.float32, "the GPU has no bf16 (float16 would need loss scaling)"
    # NOTE: bf16 autocast on CPU depends on the chip (measured 0.64x float32 on a 2-core
    # Xeon, 1.5x on an AVX512-BF16 EPYC): measure with `train_small.py --bench` first.
    return torch.float32, f"bf16 autocast on {device.type} is not reliably faster (check with --bench)"


def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed precision for forward passes: matmuls in `dtype`, weights stay float32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def wrap_rows(stream, seq_len: int, bos: int, eos: int):
    """LM1B "wrapped" rows: a token stream of sentences, each already followed by EOS, is cut
    into chunks of L-2 tokens and every chunk becomes the row [BOS] + chunk + [EOS].
    stream (N,) int array -> (rows (n, L) uint16, leftover (< L-2,) tokens for the next call)."""
    import numpy as np
    stream = np.asarray(stream, dtype=np.uint16)
    body = seq_len - 2
    n = len(stream) // body
    rows = np.empty((n, seq_len), dtype=np.uint16)
    rows[:, 0], rows[:, -1] = bos, eos
    rows[:, 1:-1] = stream[:n * body].reshape(n, body)
    return rows, stream[n * body:].copy()
