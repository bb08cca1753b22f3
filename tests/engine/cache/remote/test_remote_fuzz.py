"""Fuzzing what the remote tier parses: every malformed record or layout is a miss, never an exception.

`unseal` (the one parser of record values) gets raw bytes and, behind a
valid MAC, arbitrary JSON bodies and mutations of real records (packed chain
records with fields out of range, exact records' JSON); `parse_layout` (what
a chain record's layout bytes become before anything is sized from them)
gets arbitrary JSON and mutations of a real layout, as bytes and as values. The values are nasty
on purpose: deep nesting, huge and negative numbers, floats, NaN and
infinities, wrong types, unhashable keys, overflowing shapes, missing and
extra fields, cut and corrupted text.

Hypothesis drives it. Its structure-aware strategies cost milliseconds a
case, so most cases come from `nasty()`, a generator seeded by hypothesis
(one integer per case: cheap to draw, replayable, shrinkable); a few
thousand use hypothesis' own recursive JSON strategy. EXAMPLES counts the
cases: 100,000 in all.
"""

from __future__ import annotations

import json
import random
import time

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from mlxcache_kernel.engine.cache.remote import REMOTE_FORMAT, TeamKeys
from mlxcache_kernel.engine.cache.remote.records import (CHAIN, CHAIN_HEAD, EXACT, LAYOUT, LAYOUT_MAGIC, MAGIC,
                                                         MAX_RECORD_BYTES, MAX_VALUE_BYTES, SIGNED, ExactSet,
                                                         RemoteRecord, _ad, open_layout, seal_layout, unseal)
from mlxcache_kernel.engine.cache.remote.rebuild import SpanLayout, parse_layout

EXAMPLES = {"raw": 10_000, "json_bodies": 2_000, "seeded_bodies": 30_000, "mutated_records": 24_000,
            "json_layouts": 2_000, "mutated_layouts": 28_000, "layout_values": 4_000}
assert sum(EXAMPLES.values()) == 100_000
KEYS = TeamKeys(b"fuzzing team secret, 16+ bytes")
PREFIX = bytes(range(32))
NOW = time.time()
BT = 32
FUZZ = dict(deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
seeds = st.integers(0, 2**64 - 1)

FIELDS = ["v", "t", "kid", "iat", "ns", "i", "start", "end", "block", "layout", "states", "tail", "manifest", "size",
          "bytes", "tensors", "layers", "kind", "arrays", "meta", "offset", "parts", "max_size", ""]
WORDS = ["KVCache", "QuantizedKVCache", "RotatingKVCache", "ArraysCache", "CacheList", "float32", "bfloat16", "bool",
         "layers.0.0", "layers.1.1", "layers.99999.0", "c", "x", "ns", "a" * 64, "0" * 64, "", "\ud800", "\x00"]


SCALARS = [None, True, False, 0, 1, -1, 2, 32, 2**31, 2**31 - 1, 2**63, -2**63, 2**64 + 1, 10**300, -(2**40),
           float("inf"), float("-inf"), float("nan"), 1.5, 1e308, int(NOW), KEYS.key_id, *WORDS, *FIELDS]


def nasty(rng: random.Random, depth: int = 0):
    """A random JSON-like value, biased towards what breaks parsers."""
    r = rng.random()
    if depth > 4 or r < 0.5:
        return rng.choice(SCALARS) if r < 0.4 else rng.randrange(-2**40, 2**40) if r < 0.45 else rng.choice(
            WORDS)[:rng.randrange(8)] + chr(rng.randrange(0x3000))
    if r < 0.52:  # deep nesting, far past what the tier writes
        return json.loads(DEEP)  # a fresh one: mutated() edits what it is given
    if r < 0.76:
        return [nasty(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {rng.choice(FIELDS) if rng.random() < 0.8 else rng.choice(WORDS): nasty(rng, depth + 1)
            for _ in range(rng.randrange(5))}


DEEP = "[" * 400 + "]" * 400


def damaged(rng: random.Random, text: bytes) -> bytes:
    """`text` cut, spliced or with a few bytes flipped."""
    r = rng.random()
    if r < 0.3 or not text:
        return text
    i = rng.randrange(len(text))
    if r < 0.5:
        return text[:i]
    if r < 0.7:
        return text[:i] + rng.choice([b"[" * 5000, b"1e999", b"9" * 5000, b"\xff", b"NaN", b'"', b"}"]) + text[i:]
    b = bytearray(text)
    for _ in range(rng.randint(1, 4)):
        b[rng.randrange(len(b))] = rng.randrange(256)
    return bytes(b)


def sealed(kind: str, body: bytes) -> bytes:
    """A value that decrypts and authenticates to `body` (unsigned): the parser behind the AEAD is what is fuzzed."""
    return MAGIC + KEYS.encrypt(_ad(kind, PREFIX), bytes(SIGNED) + body)


def check_unseal(kind: str, value) -> None:
    rec, why = unseal(kind, PREFIX, value, KEYS, now=NOW)
    assert (rec is None) != (why is None)
    if rec is not None:
        assert isinstance(rec, RemoteRecord if kind == CHAIN else ExactSet) and rec.key_id == KEYS.key_id


def real_exact() -> dict:
    return {"v": REMOTE_FORMAT, "t": EXACT, "kid": KEYS.key_id, "iat": int(NOW), "ns": "ns", "i": 3,
            "states": [{"tail": [1, 2], "manifest": "cd" * 32, "size": 10, "bytes": 20, "iat": int(NOW)}]}


def chain_body(rng: random.Random | None = None) -> bytes:
    """A chain record's packed body: the real one, or (with rng) one with fields out of range,
    a namespace of any bytes and bytes after it (a layout inline, as records held one before)."""
    layout_id = KEYS.layout_id(json.dumps(real_layout()).encode())
    fields = [REMOTE_FORMAT, 3, KEYS.key_id_bytes, int(NOW), 3, 96, 128, 0, bytes(range(32)), layout_id, 2]
    widest = [255, 255, None, 2**64 - 1, 2**32 - 1, 2**32 - 1, 2**32 - 1, 2**32 - 1, None, None, 2**16 - 1]
    ns, layout = b"ns", b""
    if rng is not None:
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(fields))
            if widest[i] is None:  # key id, block digest, layout id
                fields[i] = rng.randbytes(len(fields[i]))
            else:
                fields[i] = min(widest[i], rng.choice([0, 1, 2, 3, 4, 255, 2**16 - 1, 2**24 + 1, 2**32 - 1, 2**64 - 1,
                                                       rng.randrange(2**16), int(NOW) + 10**6]))
        ns = rng.choice([ns, rng.randbytes(rng.randrange(8)), "é".encode() * 3, b"\xff\xfe"])
        layout = rng.choice([layout, layout, json.dumps(mutated(rng, real_layout())).encode(),
                             json.dumps(nasty(rng)).encode()])
    return CHAIN_HEAD.pack(*fields) + ns + layout


def real_layout() -> dict:
    return {"tensors": [[f"layers.{i}.{j}", "float32", [1, 2, BT, 16]] for i in range(2) for j in range(2)],
            "layers": [{"kind": "KVCache", "arrays": 2, "meta": {"offset": 64}} for _ in range(2)]}


def mutated(rng: random.Random, doc):
    """`doc` with a few of its nodes replaced, dropped or given extra fields."""
    for _ in range(rng.randint(1, 3)):
        node, path = doc, []
        while isinstance(node, (dict, list)) and node and rng.random() < 0.7:
            key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
            path.append((node, key))
            node = node[key]
        if not path:
            return nasty(rng)
        parent, key = path[-1]
        r = rng.random()
        if r < 0.2 and isinstance(parent, dict):
            del parent[key]
        elif r < 0.3 and isinstance(parent, dict):
            parent[rng.choice(FIELDS)] = nasty(rng)
        else:
            parent[key] = nasty(rng)
    return doc


def check_layout(layout) -> None:
    got = parse_layout(layout, BT)
    if got is None:
        return
    assert isinstance(got, SpanLayout) and 0 < got.data_bytes <= MAX_VALUE_BYTES
    assert got.block_bytes(5) > got.data_bytes
    cut = got.layers_at(64)
    assert cut is None or len(cut) == len(got.layers)


# --- named hostile cases ---

NASTY_BODIES = [
    b"[" * 100_000, b"{\"a\":" * 50_000, b"1e999", b"-1e999", b"9" * 5000, b"NaN", b"Infinity", b"\xff\xfe",
    b'{"v":2,"t":"c","kid":"%s","iat":1e999}' % KEYS.key_id.encode(),
    b'{"v":2,"t":"c","kid":"%s","iat":%d,"i":0,"ns":"n","start":0,"end":%s}' % (KEYS.key_id.encode(), NOW, b"9" * 4000),
    b'{"v":2,"t":"x","kid":"%s","iat":%d,"i":0,"ns":"n","states":[{"tail":[1e999]}]}' % (KEYS.key_id.encode(), NOW),
    b'{"v":true,"t":"c"}', b"null", b"[]", b'""', b"{}" + b" " * (MAX_RECORD_BYTES - 40),
]


@pytest.mark.parametrize("body", NASTY_BODIES, ids=range(len(NASTY_BODIES)))
@pytest.mark.parametrize("kind", [CHAIN, EXACT])
def test_named_hostile_bodies_are_misses(kind, body):
    check_unseal(kind, sealed(kind, body))
    check_unseal(kind, body)


@pytest.mark.parametrize("shape", [[2**32, 2**32, BT, 2**32], [2**62, 4, BT, 2**62], [1, -1, BT, 16], [1, 0, BT, 16],
                                   [1, 2, BT + 1, 16], [True, 2, BT, 16], [1.5, 2, BT, 16], [1] * 40 + [BT, 16],
                                   [2**24, 2**24, BT, 2**24]])
def test_overflowing_shapes_are_misses(shape):
    layout = real_layout()
    layout["tensors"][0][2] = shape
    assert parse_layout(layout, BT) is None
    assert parse_layout(real_layout(), BT) is not None  # the real one parses
    assert parse_layout(json.dumps(layout).encode(), BT) is None


def test_the_real_records_parse():
    for kind, body in ((CHAIN, chain_body()), (EXACT, json.dumps(real_exact()).encode())):
        rec, why = unseal(kind, PREFIX, sealed(kind, body), KEYS, now=NOW)
        assert why is None and rec.index == 3
    rec = unseal(CHAIN, PREFIX, sealed(CHAIN, chain_body()), KEYS, now=NOW)[0]
    layout_id, value = seal_layout(json.dumps(real_layout()), KEYS)
    assert rec.layout_id == layout_id and parse_layout(open_layout(layout_id, value, KEYS), BT) is not None


# --- hypothesis ---

@settings(max_examples=EXAMPLES["raw"], **FUZZ)
@given(kind=st.sampled_from([CHAIN, EXACT]), value=st.one_of(st.binary(max_size=200), st.just(None), st.integers(),
                                                             st.binary(max_size=60).map(lambda b: MAGIC + b)))
def test_unseal_raw_values(kind, value):
    check_unseal(kind, value)


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=10), st.sampled_from(WORDS)),
    lambda kids: st.one_of(st.lists(kids, max_size=5), st.dictionaries(st.sampled_from(FIELDS), kids, max_size=5)),
    max_leaves=12)


@settings(max_examples=EXAMPLES["json_bodies"], **FUZZ)
@given(kind=st.sampled_from([CHAIN, EXACT]), doc=json_values)
def test_unseal_any_json_body_behind_a_valid_mac(kind, doc):
    check_unseal(kind, sealed(kind, json.dumps(doc).encode()))


@pytest.mark.slow  # the bulk of the 100,000 cases: make test runs them, make test-fast does not
@settings(max_examples=EXAMPLES["seeded_bodies"], **FUZZ)
@given(kind=st.sampled_from([CHAIN, EXACT]), seed=seeds)
def test_unseal_seeded_nasty_bodies(kind, seed):
    rng = random.Random(seed)
    check_unseal(kind, sealed(kind, damaged(rng, json.dumps(nasty(rng)).encode())))


@pytest.mark.slow  # the bulk of the 100,000 cases: make test runs them, make test-fast does not
@settings(max_examples=EXAMPLES["mutated_records"], **FUZZ)
@given(kind=st.sampled_from([CHAIN, EXACT]), seed=seeds)
def test_unseal_mutated_real_records(kind, seed):
    rng = random.Random(seed)
    body = chain_body(rng) if kind == CHAIN else json.dumps(mutated(rng, real_exact())).encode()
    check_unseal(kind, sealed(kind, damaged(rng, body)))


@settings(max_examples=EXAMPLES["json_layouts"], **FUZZ)
@given(layout=json_values)
def test_parse_any_json_layout(layout):
    check_layout(layout)


@pytest.mark.slow  # the bulk of the 100,000 cases: make test runs them, make test-fast does not
@settings(max_examples=EXAMPLES["mutated_layouts"], **FUZZ)
@given(seed=seeds)
def test_parse_mutated_real_layouts(seed):
    """As a record carries it (JSON bytes, maybe damaged) and as a parsed value."""
    rng = random.Random(seed)
    layout = mutated(rng, real_layout()) if rng.random() < 0.9 else nasty(rng)
    check_layout(damaged(rng, json.dumps(layout).encode()) if rng.random() < 0.5 else layout)


@settings(max_examples=EXAMPLES["layout_values"], **FUZZ)
@given(seed=seeds)
def test_open_mutated_layout_values(seed):
    """A layout value opens only as the layout of its id: damaged, sealed for another id, by another
    team, or of another layout under this id, it is None, never an exception."""
    rng = random.Random(seed)
    text = json.dumps(mutated(rng, real_layout()) if rng.random() < 0.5 else real_layout())
    layout_id, value = seal_layout(text, KEYS)
    r = rng.random()
    if r < 0.2:  # another layout sealed for this id (a member who lies about what it signed)
        value = LAYOUT_MAGIC + KEYS.encrypt(_ad(LAYOUT, layout_id), (json.dumps(real_layout()) + " ").encode())
    elif r < 0.3:
        value = seal_layout(text, TeamKeys(b"another team, 16+ bytes of it"))[1]
    elif r < 0.4:
        layout_id = rng.randbytes(32)
    got = open_layout(layout_id, damaged(rng, value), KEYS)
    assert got is None or (KEYS.layout_id(got) == layout_id and got == text.encode())
