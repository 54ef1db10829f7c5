"""Train kvlab's small demo model (``kvlab/demo_model/``) from scratch on CPU.

The model is a tiny Llama-style causal LM (grouped-query attention: 8 query
heads, 2 KV heads; tied embeddings) with its own byte-level BPE tokenizer,
saved in Hugging Face format (``config.json``, ``model.safetensors`` in
bfloat16, ``tokenizer.json``, ``tokenizer_config.json``,
``generation_config.json``).

Data
----
Jane Austen's six completed novels (public domain), as shipped by the Debian
package ``r-cran-janeaustenr`` (1.0.0-1, MIT licensed; "Sense and
Sensibility", "Pride and Prejudice", "Mansfield Park", "Emma", "Northanger
Abbey", "Persuasion"). The package stores the texts as an R lazy-load
database; this script reads it with a small pure-Python reader, so R itself is
not needed. Install the data with either of::

    apt-get install --no-install-recommends r-cran-janeaustenr
        # -> /usr/lib/R/site-library/janeaustenr (the default --austen-dir)

    apt-get download r-cran-janeaustenr
    dpkg -x r-cran-janeaustenr_*.deb /tmp/janeaustenr    # no R needed
        # -> --austen-dir /tmp/janeaustenr/usr/lib/R/site-library/janeaustenr

The last 5% of the paragraphs of every novel is held out (never trained on):
it gives the held-out perplexity and the filler text of the held-out recall
examples.

Training mixes plain novel text with a synthetic long-range recall task
(:func:`make_recall_example`): a few facts ("The code of the blue door is
4821.", "Mara's city is Lisbon.") are stated first, then comes a long stretch
of novel text (hundreds of tokens), then a question about one fact. kvlab uses
the same generator to measure what KV-cache eviction does to accuracy.

Training: ``transformers.LlamaForCausalLM``, plain ``torch.optim.AdamW`` with
linear warm-up and a cosine schedule, packed sequences of 512 tokens for the
first 700 of 2,400 steps, then 1,024 tokens; the recall task's filler grows from
a few words to 640 words over the first 60% of the steps (a curriculum: with
long fillers from the start the model does not find the facts in this budget),
bf16 autocast on CPU, ``torch.set_num_threads(2)``; everything is seeded.

Command (34 minutes on 2 unshared CPU cores, about 4,900 tokens/s; < 2 GB of
memory)::

    python scripts/train_demo_model.py --out kvlab/demo_model \\
        [--austen-dir /usr/lib/R/site-library/janeaustenr]

then, for the numbers of the model card::

    python scripts/eval_demo_model.py kvlab/demo_model

This file is importable (``scripts/`` is not a package: add it to
``sys.path`` or load it with importlib); importing it does not touch torch or
transformers until a training/eval function is called.
"""

from __future__ import annotations

import argparse
import bz2
import functools
import gzip
import json
import lzma
import math
import os
import random
import re
import struct
import sys
import time
import zlib
from pathlib import Path

DEFAULT_AUSTEN_DIR = "/usr/lib/R/site-library/janeaustenr"
NOVELS = {  # R object name -> title
    "sensesensibility": "Sense and Sensibility",
    "prideprejudice": "Pride and Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}
HELDOUT_FRACTION = 0.05
RECALL_EVAL_SEED = 20240601
RECALL_EVAL_N = 200
RECALL_EVAL_FILLER_WORDS = (250, 550)  # about 330-730 tokens of filler
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] | trim }}\n"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


# ---------------------------------------------------------------------------
# Reading the corpus (R lazy-load database -> Python strings)
# ---------------------------------------------------------------------------

def _r_decompress(blob: bytes) -> bytes:
    """One record of an R lazy-load DB: 4-byte big-endian length + zlib
    stream, or length + type byte ('2' bzip2, 'Z' xz, '0' none) + payload."""
    (n,) = struct.unpack(">I", blob[:4])
    kind = blob[4:5]
    if kind == b"2":
        out = bz2.decompress(blob[5:])
    elif kind == b"Z":
        out = lzma.decompress(blob[5:])
    elif kind == b"0":
        out = blob[5:]
    else:
        out = zlib.decompress(blob[4:])
    if len(out) != n:
        raise ValueError("corrupt R lazy-load record")
    return out


class _RUnserializer:
    """Just enough of R's XDR serialization format for data objects
    (vectors, lists, pairlists, strings, attributes)."""

    def __init__(self, data: bytes):
        self.d, self.p, self.refs = data, 0, []

    def _int(self) -> int:
        (v,) = struct.unpack_from(">i", self.d, self.p)
        self.p += 4
        return v

    def _len(self) -> int:
        n = self._int()
        if n == -1:
            hi, lo = self._int(), self._int()
            n = (hi << 32) + lo
        return n

    def run(self):
        if self.d[:2] != b"X\n":
            raise ValueError("not an R XDR serialization")
        self.p = 2
        version = self._int()
        self._int(), self._int()
        if version == 3:
            n = self._int()  # length of the native encoding name
            self.p += n
        return self._item()

    def _item(self):
        flags = self._int()
        t = flags & 0xFF
        has_attr, has_tag = flags & (1 << 9), flags & (1 << 10)
        if t in (254, 253, 251, 252, 242, 241, 247):  # NULL and special envs
            return None
        if t == 255:  # back-reference
            idx = flags >> 8 or self._int()
            return self.refs[idx - 1]
        if t == 1:  # SYMSXP
            sym = ("sym", self._item())
            self.refs.append(sym)
            return sym
        if t in (2, 6, 17, 239, 240):  # pairlist-like: [(tag, value), ...]
            if has_attr:
                self._item()
            tag = self._item() if has_tag else None
            car, cdr = self._item(), self._item()
            return [(tag[1] if tag else None, car)] + (cdr if isinstance(cdr, list) else [])
        if t == 9:  # CHARSXP
            n = self._int()
            if n == -1:
                return None
            s = self.d[self.p:self.p + n].decode("utf-8", "replace")
            self.p += n
            return s
        if t in (10, 13):  # logical, integer
            n = self._len()
            val = list(struct.unpack_from(">%di" % n, self.d, self.p))
            self.p += 4 * n
        elif t == 14:  # double
            n = self._len()
            val = list(struct.unpack_from(">%dd" % n, self.d, self.p))
            self.p += 8 * n
        elif t in (16, 19, 20):  # character vector, list, expression
            val = [self._item() for _ in range(self._len())]
        elif t == 238:  # ALTREP: class info, state, attributes
            self._item()
            state = self._item()
            self._item()
            return state
        else:
            raise ValueError(f"unsupported R object type {t}")
        attrs = dict(self._item()) if has_attr else {}
        if t == 19 and "names" in attrs:
            return dict(zip(attrs["names"], val))
        return val


def read_r_lazyload_db(prefix: str | os.PathLike) -> dict:
    """Read an R lazy-load database (``prefix.rdx`` + ``prefix.rdb``)."""
    prefix = str(prefix)
    raw = Path(prefix + ".rdx").read_bytes()
    raw = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else _r_decompress(raw)
    index = _RUnserializer(raw).run()
    db = Path(prefix + ".rdb").read_bytes()
    out = {}
    for name, (off, length) in index["variables"].items():
        out[name] = _RUnserializer(_r_decompress(db[int(off):int(off) + int(length)])).run()
    return out


def _clean_paragraphs(lines: list[str]) -> list[str]:
    paras, cur = [], []
    for line in lines + [""]:
        line = (line or "").strip()
        if line:
            cur.append(line)
        elif cur:
            paras.append(" ".join(cur))
            cur = []
    out = []
    for p in paras:
        p = p.replace("_", "")  # Gutenberg italics markers
        p = re.sub(r"\s+", " ", p).strip()
        if p:
            out.append(p)
    return out


def load_austen(austen_dir: str | os.PathLike = DEFAULT_AUSTEN_DIR) -> dict[str, list[str]]:
    """{title: [paragraph, ...]} for the six novels of janeaustenr."""
    prefix = Path(austen_dir) / "data" / "Rdata"
    if not Path(str(prefix) + ".rdb").exists():
        raise SystemExit(
            f"janeaustenr data not found under {austen_dir!r}: install the Debian package "
            "r-cran-janeaustenr (see this script's docstring) or pass --austen-dir")
    objs = read_r_lazyload_db(prefix)
    return {title: _clean_paragraphs(objs[key]) for key, title in NOVELS.items()}


def split_corpus(novels: dict[str, list[str]], heldout_fraction: float = HELDOUT_FRACTION):
    """(train, heldout): the last ``heldout_fraction`` of each novel's paragraphs
    is held out. Each value is one string per novel, paragraphs joined by a
    blank line."""
    train, held = {}, {}
    for title, paras in novels.items():
        cut = int(len(paras) * (1 - heldout_fraction))
        train[title] = "\n\n".join(paras[:cut])
        held[title] = "\n\n".join(paras[cut:])
    return train, held


def load_splits(austen_dir=DEFAULT_AUSTEN_DIR):
    return split_corpus(load_austen(austen_dir))


# ---------------------------------------------------------------------------
# Synthetic long-range recall task
# ---------------------------------------------------------------------------

NAMES = ["Mara", "Tomas", "Elin", "Jonah", "Priya", "Oskar", "Lena", "Felix", "Nadia", "Hugo",
         "Iris", "Milo", "Sofia", "Rafael", "Greta", "Kenji", "Amara", "Luca", "Zara", "Bruno",
         "Ines", "Omar", "Talia", "Viktor", "Yara", "Soren", "Delia", "Anton", "Noor", "Pablo"]
CITIES = ["Lisbon", "Oslo", "Cairo", "Lima", "Dublin", "Prague", "Vienna", "Madrid", "Kyoto",
          "Quito", "Nairobi", "Havana", "Athens", "Warsaw", "Bergen", "Porto", "Tunis", "Zurich",
          "Seoul", "Perth", "Manila", "Bogota", "Riga", "Tallinn", "Naples", "Geneva"]
COLOURS = ["blue", "red", "green", "yellow", "white", "black", "silver", "golden", "purple",
           "orange", "grey", "brown"]
OBJECTS = ["door", "box", "gate", "chest", "safe", "locker", "cabinet", "drawer", "trunk", "vault"]
ANIMALS = ["dog", "cat", "horse", "parrot", "goat", "owl", "fox", "rabbit", "pony", "tortoise"]
PLACES = ["library", "garden", "tower", "cellar", "harbour", "mill", "chapel", "stable", "bridge",
          "orchard"]
PASSWORDS = ["lantern", "harvest", "falcon", "willow", "copper", "meadow", "thunder", "velvet",
             "anchor", "marble", "ember", "juniper", "saffron", "glacier", "pepper", "quartz"]


def _fact_code(rng, names):
    c, o, v = rng.choice(COLOURS), rng.choice(OBJECTS), str(rng.randint(1000, 9999))
    return (f"The code of the {c} {o} is {v}.", f"What is the code of the {c} {o}?",
            f"The code of the {c} {o} is", v)


def _fact_city(rng, names):
    n, v = names.pop(), rng.choice(CITIES)
    return f"{n}'s city is {v}.", f"What is {n}'s city?", f"{n}'s city is", v


def _fact_pet(rng, names):
    c, a, v = rng.choice(COLOURS), rng.choice(ANIMALS), names.pop()
    return (f"The {c} {a} is called {v}.", f"What is the {c} {a} called?",
            f"The {c} {a} is called", v)


def _fact_year(rng, names):
    n, v = names.pop(), str(rng.randint(1700, 1999))
    return f"{n} was born in {v}.", f"In which year was {n} born?", f"{n} was born in", v


def _fact_room(rng, names):
    n, v = names.pop(), str(rng.randint(100, 999))
    return f"{n} lives in room {v}.", f"In which room does {n} live?", f"{n} lives in room", v


def _fact_password(rng, names):
    p, v = rng.choice(PLACES), rng.choice(PASSWORDS)
    return (f"The password of the {p} is {v}.", f"What is the password of the {p}?",
            f"The password of the {p} is", v)


FACT_KINDS = [_fact_code, _fact_city, _fact_pet, _fact_year, _fact_room, _fact_password]


@functools.lru_cache(maxsize=8)
def _filler_words(text: str) -> tuple[str, ...]:
    return tuple(text.split(" "))


def _filler_span(rng: random.Random, filler_text: str, n_words: int) -> str:
    words = _filler_words(filler_text)
    n_words = max(1, min(n_words, len(words) - 100))
    start = rng.randrange(0, len(words) - n_words - 60)
    for k in range(start, start + 50):  # start on a sentence boundary
        if words[k].endswith((".", "!", "?", '."', '!"', '?"')) or "\n" in words[k]:
            start = k + 1
            break
    end = start + n_words
    for k in range(end - 1, min(end + 40, len(words))):  # end on one too
        if words[k].endswith((".", "!", "?", '."', '!"', '?"')):
            end = k + 1
            break
    return " ".join(words[start:end]).strip()


def make_recall_example(rng: random.Random, filler_text: str, n_facts: int = 4,
                        filler_words: tuple[int, int] = (150, 600),
                        include_facts: bool = True) -> tuple[str, str]:
    """One long-range recall example -> ``(prompt, answer)``.

    Layout of ``prompt + " " + answer``::

        <n_facts fact sentences, one per fact kind>

        <filler: a random span of filler_text, filler_words words>

        Question: <question about one of the facts>
        Answer: <the fact sentence restated up to its value> <answer>

    e.g. the prompt ends with ``"...\\nAnswer: The code of the blue door is"``
    and the answer is ``"4821"``. Answers are single words (a number, a
    name, a city or a password word); a model that generates ``" " + answer``
    (followed by ``"."``) after the prompt is correct.

    ``include_facts=False`` drops the fact sentences (the no-information
    baseline). The random draws do not depend on it, so the same ``rng``
    seed gives the same question with and without the facts.
    """
    facts, target, filler = _recall_parts(rng, filler_text, n_facts, filler_words)
    _, question, prefix, answer = facts[target]
    head = " ".join(f[0] for f in facts) + "\n\n" if include_facts else ""
    prompt = f"{head}{filler}\n\nQuestion: {question}\nAnswer: {prefix}"
    return prompt, answer


def _recall_parts(rng, filler_text, n_facts, filler_words):
    kinds = rng.sample(FACT_KINDS, k=min(n_facts, len(FACT_KINDS)))
    names = rng.sample(NAMES, k=len(kinds) + 1)
    facts = [kind(rng, names) for kind in kinds]
    target = rng.randrange(len(facts))
    n_words = rng.randint(*filler_words)
    return facts, target, _filler_span(rng, filler_text, n_words)


def make_recall_training_doc(rng: random.Random, filler_text: str, n_facts: int = 4,
                             filler_words: tuple[int, int] = (150, 600)):
    """A training variant of :func:`make_recall_example` that asks about
    every fact (target first, then the others in random order): more answer
    tokens per document. Returns ``[(text, is_answer), ...]`` pieces whose
    concatenation is the document."""
    facts, target, filler = _recall_parts(rng, filler_text, n_facts, filler_words)
    order = [target] + rng.sample([i for i in range(len(facts)) if i != target], len(facts) - 1)
    pieces = [(" ".join(f[0] for f in facts) + "\n\n" + filler, False)]
    for i in order:
        _, question, prefix, answer = facts[i]
        pieces += [(f"\n\nQuestion: {question}\nAnswer: {prefix}", False),
                   (f" {answer}", True), (".", False)]
    return pieces


def recall_eval_examples(heldout_text: str, n: int = RECALL_EVAL_N, seed: int = RECALL_EVAL_SEED,
                         include_facts: bool = True,
                         filler_words: tuple[int, int] = RECALL_EVAL_FILLER_WORDS):
    """The fixed held-out recall set: ``n`` (prompt, answer) pairs whose filler
    comes from held-out text. Deterministic for a given seed."""
    rng = random.Random(seed)
    return [make_recall_example(rng, heldout_text, filler_words=filler_words,
                                include_facts=include_facts) for _ in range(n)]


def recall_answer_correct(generated: str, answer: str) -> bool:
    """``generated`` is the text produced after the prompt."""
    m = re.match(r"\s*([A-Za-z0-9']+)", generated)
    return bool(m) and m.group(1) == answer


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------

def train_tokenizer(texts, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok


def tokenizer_config(max_len: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": None,
        "add_bos_token": True, "add_eos_token": False,
        "model_max_length": max_len, "padding_side": "left",
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------

def _encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


class RowSampler:
    """Packs rows of seq_len+1 tokens from (a) random windows of novel text,
    (b) recall documents (BOS ... EOS, see :func:`make_recall_training_doc`)
    and (c) now and then a passage of novel text that is repeated verbatim a
    little later (a dense copying signal that makes the model learn to look
    back, which the recall task needs). Half of the novel windows start at a
    paragraph with BOS: a user's prompt starts with BOS too, and if only
    recall documents did, the model would answer any prompt with facts.
    Returns (ids, answer_mask)."""

    def __init__(self, tok, train_text: str, seq_len: int, rng: random.Random,
                 recall_counts=(1, 2, 3, 4), recall_weights=(0.2, 0.3, 0.3, 0.2),
                 filler_words=(20, 640), repeat_prob=0.3):
        self.tok, self.text, self.T, self.rng = tok, train_text, seq_len, rng
        self.bos, self.eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
        self.stream = _encode(tok, train_text)
        self.para_starts = [0] + [m.end() for m in re.finditer(r"\n\n", train_text)]
        self.recall_counts, self.recall_weights = recall_counts, recall_weights
        self.filler_words = filler_words
        self.repeat_prob = repeat_prob

    def _recall(self, max_tokens: int):
        lo, hi = self.filler_words
        hi = min(hi, int((max_tokens - 110) / 1.45))
        if hi < lo:
            return None
        pieces = make_recall_training_doc(self.rng, self.text, filler_words=(lo, hi))
        ids, mask = [self.bos], [0]
        for text, is_answer in pieces:
            piece = _encode(self.tok, text)
            ids += piece
            mask += [int(is_answer)] * len(piece)
        ids.append(self.eos)
        mask.append(0)
        if len(ids) > max_tokens:
            return None
        return ids, mask

    def _repeat(self, max_tokens: int):
        n = self.rng.randint(30, 200)
        gap = self.rng.randint(0, 300)
        if 2 * n + gap > max_tokens:
            return None
        a, _ = self._corpus(n)
        g, _ = self._corpus(gap)
        ids = a + g + a
        return ids, [0] * len(ids)

    def _corpus(self, n: int):
        if n == 0:
            return [], []
        if n > 1 and self.rng.random() < 0.5:  # a document: BOS + text from a paragraph start
            start = self.rng.choice(self.para_starts)
            ids = [self.bos] + _encode(self.tok, self.text[start:start + 8 * n])[:n - 1]
            if len(ids) == n:
                return ids, [0] * n
        start = self.rng.randrange(0, len(self.stream) - n)
        return self.stream[start:start + n], [0] * n

    def row(self, seq_len: int | None = None):
        need = (seq_len or self.T) + 1
        segs, used = [], 0
        k = self.rng.choices(self.recall_counts, weights=self.recall_weights)[0]
        for _ in range(k):
            seg = self._recall(need - used)
            if seg is not None:
                segs.append(seg)
                used += len(seg[0])
        if self.rng.random() < self.repeat_prob:
            seg = self._repeat(need - used)
            if seg is not None:
                segs.append(seg)
                used += len(seg[0])
        rest = need - used
        if rest > 0:
            a = self.rng.randint(0, rest) if segs else rest
            if a:
                segs.append(self._corpus(a))
            if rest - a:
                segs.append(self._corpus(rest - a))
        self.rng.shuffle(segs)
        ids = [t for s in segs for t in s[0]]
        mask = [m for s in segs for m in s[1]]
        assert len(ids) == need
        return ids, mask

    def batch(self, batch_size: int, seq_len: int | None = None):
        import torch
        rows = [self.row(seq_len) for _ in range(batch_size)]
        return (torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows], dtype=torch.float32))


def heldout_windows(tok, heldout: dict[str, str], seq_len: int):
    """Non-overlapping windows of held-out text, each ``[BOS] + seq_len-1 tokens``
    (a shorter last window per novel is kept)."""
    bos = tok.token_to_id(BOS)
    out = []
    for text in heldout.values():
        ids = _encode(tok, text)
        for i in range(0, len(ids), seq_len - 1):
            chunk = ids[i:i + seq_len - 1]
            if len(chunk) >= 16:
                out.append([bos] + chunk)
    return out


def heldout_loss(model, windows) -> tuple[float, int]:
    """Mean next-token NLL (nats) over all predicted tokens of ``windows``."""
    import torch
    import torch.nn.functional as F
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for w in windows:
            x = torch.tensor([w])
            logits = model(input_ids=x[:, :-1]).logits.float()
            nll = F.cross_entropy(logits[0], x[0, 1:], reduction="sum")
            total += nll.item()
            count += x.shape[1] - 1
    return total / count, count


def build_config(vocab_size: int, args):
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        max_position_embeddings=args.seq_len, rms_norm_eps=1e-5, rope_theta=10000.0,
        hidden_act="silu", initializer_range=0.02, tie_word_embeddings=True,
        attention_bias=False, mlp_bias=False, bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )


def save_checkpoint(model, tok, out: Path, seq_len: int):
    import torch
    from transformers import GenerationConfig
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=0, eos_token_id=1, pad_token_id=2, do_sample=False, max_new_tokens=64)
    model.save_pretrained(out, safe_serialization=True)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    # Plain top-level keys too, for readers that predate rope_parameters.
    cfg.setdefault("rope_theta", 10000.0)
    cfg.setdefault("torch_dtype", "bfloat16")
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(seq_len), indent=2) + "\n")


def train(args):
    import torch
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    t_start = time.time()

    train_texts, heldout = load_splits(args.austen_dir)
    train_text = "\n\n".join(train_texts.values())
    heldout_text = "\n\n".join(heldout.values())
    print(f"corpus: {len(train_text):,} train chars, {len(heldout_text):,} held-out chars", flush=True)

    # Tokenizer: novel paragraphs plus recall-task sentences (so the task's
    # names and cities get tokens of their own).
    trng = random.Random(args.seed + 1)
    tok_texts = [p for t in train_texts.values() for p in t.split("\n\n")]
    tok_texts += [make_recall_example(trng, train_text, filler_words=(1, 2))[0] for _ in range(3000)]
    tok = train_tokenizer(tok_texts, args.vocab_size)
    vocab = tok.get_vocab_size()
    print(f"tokenizer: {vocab} tokens ({time.time() - t_start:.0f}s)", flush=True)

    sampler = RowSampler(tok, train_text, args.seq_len, random.Random(args.seed + 2))
    print(f"train stream: {len(sampler.stream):,} tokens", flush=True)
    val_windows = heldout_windows(tok, heldout, args.seq_len)[: args.val_windows]
    vrng = random.Random(args.seed + 3)
    val_recall = [make_recall_example(vrng, heldout_text, filler_words=RECALL_EVAL_FILLER_WORDS)
                  for _ in range(args.val_recall)]
    val_recall_short = [make_recall_example(vrng, heldout_text, filler_words=(5, 40))
                        for _ in range(args.val_recall)]

    config = build_config(vocab, args)
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * frac))

    def quick_recall(examples):
        # Teacher-forced: all answer tokens are the argmax.
        model.eval()
        ok = 0
        with torch.no_grad():
            for prompt, answer in examples:
                p_ids = [0] + _encode(tok, prompt)
                full = [0] + _encode(tok, f"{prompt} {answer}.")
                x = torch.tensor([full[:-1]])
                pred = model(input_ids=x).logits[0].argmax(-1).tolist()
                ok += pred[len(p_ids) - 1:len(full) - 2] == full[len(p_ids):len(full) - 1]
        model.train()
        return ok / len(examples)

    model.train()
    t_train = time.time()
    tokens_seen, ema = 0, None
    log = []
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        # Curriculum: the recall task's filler grows from a few words to its
        # full length over the first --filler-ramp of the steps.
        ramp = min(1.0, step / max(1, args.filler_ramp * args.steps))
        sampler.filler_words = (0, int(8 + (args.max_filler_words - 8) * ramp))
        if step < args.short_steps:  # warm-up phase: shorter rows, short-range recall
            x, mask = sampler.batch(args.batch_size * args.seq_len // args.short_seq_len,
                                    args.short_seq_len)
        else:
            x, mask = sampler.batch(args.batch_size, args.seq_len)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(input_ids=x[:, :-1]).logits
        nll = F.cross_entropy(logits.float().reshape(-1, vocab), x[:, 1:].reshape(-1),
                              reduction="none").view(x.shape[0], -1)
        lm_loss = nll.mean()
        m = mask[:, 1:]
        ans_loss = (nll * m).sum() / m.sum().clamp(min=1)
        loss = lm_loss + args.answer_weight * ans_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens_seen += x[:, :-1].numel()
        ema = lm_loss.item() if ema is None else 0.95 * ema + 0.05 * lm_loss.item()
        if step % args.log_every == 0 or step == args.steps - 1:
            el = time.time() - t_train
            print(f"step {step:5d}/{args.steps} lm_loss {lm_loss.item():.3f} (ema {ema:.3f}) "
                  f"answer_loss {ans_loss.item():.3f} lr {lr_at(step):.2e} "
                  f"tok/s {tokens_seen / el:,.0f} elapsed {el / 60:.1f}m", flush=True)
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
            vl, _ = heldout_loss(model, val_windows)
            acc, acc_short = quick_recall(val_recall), quick_recall(val_recall_short)
            model.train()
            print(f"  eval step {step + 1}: held-out loss {vl:.3f} (ppl {math.exp(vl):.1f}), "
                  f"recall (teacher-forced, {len(val_recall)} ex) {acc:.2f}, "
                  f"with 5-40 filler words {acc_short:.2f}", flush=True)
            log.append({"step": step + 1, "heldout_loss": vl, "recall_tf": acc,
                        "recall_tf_short": acc_short, "train_lm_ema": ema})

    minutes = (time.time() - t_start) / 60
    print(f"done: {tokens_seen:,} tokens, final train lm_loss (ema) {ema:.3f}, "
          f"total time {minutes:.1f} min", flush=True)
    save_checkpoint(model, tok, Path(args.out), args.seq_len)
    print(f"saved to {args.out}", flush=True)
    return log


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="kvlab/demo_model")
    p.add_argument("--austen-dir", default=DEFAULT_AUSTEN_DIR)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=704)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=4, help="rows of --seq-len tokens per step")
    p.add_argument("--steps", type=int, default=2400)
    p.add_argument("--short-steps", type=int, default=700,
                   help="first steps use rows of --short-seq-len tokens (same tokens per step)")
    p.add_argument("--short-seq-len", type=int, default=512)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-filler-words", type=int, default=640)
    p.add_argument("--filler-ramp", type=float, default=0.6,
                   help="fraction of the steps over which the recall filler grows to full length")
    p.add_argument("--answer-weight", type=float, default=3.0,
                   help="extra loss weight on the recall answers' tokens")
    p.add_argument("--no-bf16", dest="bf16", action="store_false", help="train in fp32")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=600)
    p.add_argument("--val-windows", type=int, default=12)
    p.add_argument("--val-recall", type=int, default=50)
    return p.parse_args(argv)


if __name__ == "__main__":
    train(parse_args())
