"""LEAF's Sent140 (tweets labelled by sentiment, Go et al. 2009) as a task: one client per Twitter user.

Files: LEAF's JSON layout (common/data/leaf.py) under `data.path` (default `data.data_dir/sent140`), in
`train/` and `test/` (or LEAF's `data/train`, `data/test`), with

    user_data[u] = {"x": [[tweet_id, date, query, user, text], ...], "y": [0 | 1, ...]}

(LEAF's own layout; an entry of "x" may also be the text alone).  Loading, the natural partition
and lazy reading are those of FEMNIST and Shakespeare (common/tasks/leaf.py).

The input is a hashed bag of words (Weinberger et al. 2009, "Feature hashing"): the text is
lower-cased and split into tokens [a-z0-9']+; token t sets feature crc32(t) mod `features` to 1, and
the row is divided by the square root of its number of distinct features (unit L2 norm; an empty
tweet is all zeros).  Why hashing and not a vocabulary or LEAF's GloVe LSTM: GloVe is a download; a
vocabulary built from the training split needs every process to read every user's tweets before it
can encode its own, which undoes the lazy loading (a process reads only its own users); hashing needs
nothing but the tweet, gives every process the same features, and costs `features` x 4 bytes per
tweet.  Collisions merge some words; with 1,024 features (the default) and Sent140's few thousand
frequent words they are common but rarely between sentiment words.  `model.kind = "logreg"` on these
features is the bag-of-words logistic model; "mlp" works too.
"""
from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedhop.common.data import leaf
from fedhop.common.tasks.classification import ClassificationTask
from fedhop.common.tasks.leaf import LeafKind, LeafParams
from fedhop.common.tasks.leaf import build as build_leaf

TOKEN = re.compile(r"[a-z0-9']+")
TEXT_AT = 4            # LEAF's x entries: [tweet_id, date, query, user, text]


@dataclass
class Sent140Params(LeafParams):
    """[data] keys of dataset = "sent140" (LEAF JSON files).

    `path`: the folder holding train/ and test/ (relative: under data.data_dir, then the cwd);
        "" = data.data_dir/sent140
    `fraction`: the share of users kept (a seeded sample; 1 = every user)
    `features`: hashed bag-of-words features per tweet (the model's input size)
    """

    features: int = field(default=1024, metadata={"min": 2})


def tweet_text(entry: Any, user: str) -> str:
    """The text of one "x" entry: LEAF's 5-field list, or a string."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, list) and len(entry) > TEXT_AT and isinstance(entry[TEXT_AT], str):
        return entry[TEXT_AT]
    raise leaf.LeafError(f"sent140: user {user!r}: an input must be [tweet_id, date, query, user, text] or a "
                         f"string, got {str(entry)[:80]}")


def hash_features(texts: list[str], features: int) -> np.ndarray:
    """Hashed bag of words of each text, rows of unit L2 norm (module docstring)."""
    out = np.zeros((len(texts), features), dtype=np.float32)
    for i, text in enumerate(texts):
        cols = {zlib.crc32(t.encode()) % features for t in TOKEN.findall(text.lower())}
        if cols:
            out[i, sorted(cols)] = 1.0 / np.sqrt(len(cols))
    return out


def labels(y: list, user: str) -> np.ndarray:
    """0/1 labels (ints, or the strings "0"/"1"); anything else is an error naming the value."""
    out = np.empty(len(y), dtype=np.int64)
    for i, v in enumerate(y):
        if v in (0, 1, "0", "1") and not isinstance(v, bool):
            out[i] = int(v)
        else:
            raise leaf.LeafError(f"sent140: user {user!r}: label {v!r} is not 0 or 1 (LEAF's Sent140 labels)")
    return out


def kind(features: int) -> LeafKind:
    def decode(x: list, y: list, user: str) -> tuple[np.ndarray, np.ndarray]:
        return hash_features([tweet_text(e, user) for e in x], features), labels(y, user)
    return LeafKind((features,), 2, decode)


def build(cfg: Any, p: Sent140Params) -> ClassificationTask:
    return build_leaf(cfg, p, kind(p.features))


REGISTER = {"sent140": (build, Sent140Params)}   # data.dataset -> (builder, its [data] keys)
