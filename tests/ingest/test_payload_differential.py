"""Ingest acknowledges a payload only if the CDC writers parse it: ingest against the writer.

The writer's verdict is ``JsonCheck.checkMany`` (jvm/src/eventplane/inbox/JsonCheck.java:
Jackson and Spark's VariantBuilder with the session's parse_json settings), asked on
the shared SparkSession, one call per batch of documents. Ingest's is the HTTP answer
of a real IngestServer and WAL on loopback, one event per NDJSON request, with the
document as ``new``.

1. ``EDGE_CORPUS``: valid documents at the edges (every Unicode plane, escapes, ``-0.0``,
   numbers of up to 1000 digits, keys of 50,000 bytes, thousands of keys, nesting at
   ``ingest.max_json_depth``, repeated keys) must be accepted by both.
2. ``documents()``: a hypothesis generator biased toward the edges (invalid and overlong
   UTF-8, surrogates escaped and encoded, NUL and control characters, BOMs, extreme
   exponents, numbers around 1000 digits, nesting around both depth limits, keys around
   50,000 bytes, syntax slips). Each document is either refused with a 4xx, naming the
   line, event, field and byte when the document is otherwise JSON, and then nothing is
   stored; or accepted by both, and stored byte for byte. Ingest refuses more than the
   writer only for invalid UTF-8 (Jackson takes overlong forms) and for nesting deeper
   than ``ingest.max_json_depth``.

The server runs on its own event loop in a thread so that hypothesis, which is
synchronous, can drive it; its WAL does not fsync (durability is not the question).
500 batches of 20 documents run in CI, 10,000 batches under ``--soak``.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import pytest
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon.config import Config, DaemonConfig, IngestConfig, Listen
from daemon.events import decode
from daemon.ingest.payload import MAX_KEY_BYTES, first_too_deep
from daemon.ingest.server import IngestServer
from daemon.service.metrics import Metrics
from wal import Wal

pytestmark = pytest.mark.spark

MAX_DEPTH = IngestConfig().max_json_depth
PREFIX = b'{"collection":"c","op":"insert","key":"k","new":'
RAW = msgspec.json.Decoder(msgspec.Raw).decode
BATCH = 20  # documents per hypothesis example (one checkMany call)
WRITER_THREAD = ThreadPoolExecutor(1, thread_name_prefix="writer-check")
CI_BATCHES = 500
SOAK_BATCHES = 10_000


# -- the two sides ------------------------------------------------------------------


class Writer:
    """The CDC writers' parse, through py4j: None (taken) or the writer's error per document."""

    def __init__(self, spark: Any) -> None:
        jvm = spark._jvm
        conf = spark._jsparkSession.sessionState().conf()
        sql_conf = jvm.org.apache.spark.sql.internal.SQLConf
        # As InboxReader.VariantOptions reads them.
        self.duplicates = bool(conf.getConf(sql_conf.VARIANT_ALLOW_DUPLICATE_KEYS()))
        self.unicode = bool(conf.getConf(sql_conf.VARIANT_VALIDATE_UNICODE_IN_JSON_PARSING()))
        self._check_many = jvm.eventplane.inbox.JsonCheck.checkMany

    def verdicts(self, docs: list[bytes]) -> list[str | None]:
        if not docs:
            return []
        lengths = ",".join(str(len(d)) for d in docs)
        data = bytearray(b"".join(docs))
        return list(self._check_many(data, lengths, self.duplicates, self.unicode))


class ThreadedIngest:
    """A real IngestServer + WAL on loopback, on a uvloop of its own in a thread."""

    def __init__(self, directory: Path) -> None:
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.wal: Wal = self.run(asyncio.to_thread(Wal.open, directory / "wal", fsync="never"))
        cfg = Config(
            daemon=DaemonConfig(data_dir=directory, cores=2),
            ingest=IngestConfig(listen=Listen("127.0.0.1", 0)),
        )
        self.server = IngestServer(cfg, self.wal, Metrics(), lambda: 0)
        self.run(self.server.start())
        self._conn: http.client.HTTPConnection | None = None

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def post(self, body: bytes) -> tuple[int, Any]:
        """POST one NDJSON body; (status, decoded JSON answer)."""
        for attempt in (1, 2):
            if self._conn is None:
                self._conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=30)
            try:
                self._conn.request(
                    "POST", "/v1/events", body, {"Content-Type": "application/x-ndjson"}
                )
                resp = self._conn.getresponse()
                answer = resp.read()
            except (ConnectionError, http.client.HTTPException):
                self._conn.close()
                self._conn = None
                if attempt == 2:
                    raise
                continue
            if resp.will_close:
                self._conn.close()
                self._conn = None
            return resp.status, msgspec.json.decode(answer)
        raise AssertionError("unreachable")

    def stored_new(self, from_lsn: int) -> list[bytes | None]:
        """``new`` of every stored event from ``from_lsn`` on."""

        async def read() -> list[bytes | None]:
            return [decode(r.payload).new for r in self.wal.read(from_lsn)]

        result: list[bytes | None] = self.run(read())
        return result

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self.run(self.server.stop(2.0))
        self.run(self.wal.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def writer(spark: Any) -> Writer:
    w = Writer(spark)
    # The daemon's session setting (daemon/spark/session.py), which config keeps true.
    assert w.duplicates is True
    return w


@pytest.fixture(scope="module")
def ingest(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedIngest]:
    server = ThreadedIngest(tmp_path_factory.mktemp("differential"))
    yield server
    server.close()


def json_text(doc: bytes) -> bool:
    """Whether msgspec takes ``doc`` as one JSON value (None of its UTF-8 is checked
    here); a document too deep for it to tell counts as not."""
    try:
        RAW(doc)
    except (msgspec.DecodeError, RecursionError):
        return False
    return True


def valid_utf8(doc: bytes) -> bool:
    try:
        doc.decode()
    except UnicodeDecodeError:
        return False
    return True


def stricter_than_the_writer(doc: bytes) -> bool:
    """The classes that ingest refuses and the writer may take."""
    return not valid_utf8(doc) or first_too_deep(doc, MAX_DEPTH) is not None


# What ingest refused, by status and reason (printed after the generated runs).
REFUSALS: Counter[str] = Counter()


def refusal_class(status: int, answer: dict[str, Any]) -> str:
    reason = answer["errors"][0]["reason"] if status == 422 else answer["message"]
    reason = reason.split("): ", 1)[-1] if status == 400 else reason
    return f"{status} {reason.split(';')[0].split(' (')[0][:60]}"


def check_batch(ingest: ThreadedIngest, writer: Writer, docs: list[bytes]) -> dict[str, int]:
    """Post each document alone, ask the writer about all (meanwhile, in a thread: py4j
    waits on its socket), and hold every outcome to the rules above; returns the count
    of each outcome."""
    # The writer's verdict matters for what ingest may take: JSON by msgspec, on one line.
    asked = [doc for doc in docs if json_text(doc) and b"\n" not in doc]
    asking = WRITER_THREAD.submit(writer.verdicts, asked)
    first_lsn = ingest.wal.head_lsn() + 1
    answers = [ingest.post(PREFIX + doc + b"}\n") for doc in docs]
    told = dict(zip(asked, asking.result(), strict=True))
    verdicts = [told.get(doc, "(not asked)") for doc in docs]
    expected: list[bytes] = []
    counts = {"both_take": 0, "ingest_refuses": 0, "only_ingest_refuses": 0}
    for doc, verdict, (status, answer) in zip(docs, verdicts, answers, strict=True):
        assert status < 500, (status, answer, doc[:300])
        if status == 200:
            assert verdict is None, f"ingest took what the writer refuses: {verdict}: {doc[:300]!r}"
            assert answer["first_lsn"] == first_lsn + len(expected), answer
            expected.append(doc)
            counts["both_take"] += 1
            continue
        assert 400 <= status < 500, (status, answer)
        counts["ingest_refuses"] += 1
        REFUSALS[refusal_class(status, answer)] += 1
        if b"\n" in doc or not json_text(doc):
            # A syntax slip, or a raw newline that ends the NDJSON line: malformed,
            # wherever msgspec says. (Jackson reads one value and ignores what follows.)
            continue
        if verdict is None:
            counts["only_ingest_refuses"] += 1
            assert stricter_than_the_writer(doc), (status, answer, doc[:300])
        # JSON otherwise: the answer names the line, the event, the field and the byte.
        where = answer["errors"][0] if status == 422 else answer
        assert (where["index"], where["field"]) == (0, "new"), answer
        assert where.get("line", 1) == 1, answer
        assert len(PREFIX) <= where["position"] < len(PREFIX) + len(doc), answer
    # The WAL holds exactly the accepted documents, in order: nothing of a refusal.
    assert ingest.stored_new(first_lsn) == expected
    return counts


# -- 1. the edge corpus ----------------------------------------------------------------

PLANES = "".join(
    chr(c)
    for c in (
        0x41, 0x7F, 0xE9, 0x7FF, 0x800, 0xFEFF, 0xFFFD, 0xFFFE, 0xFFFF, 0xE000,  # plane 0
        0x10000, 0x1F600, 0x20000, 0x2A6D6, 0x30000, 0xE0001, 0xF0000, 0x10FFFD, 0x10FFFF,
    )
)  # fmt: skip
DEPTH_OBJECTS = b'{"a":' * (MAX_DEPTH - 1) + b"{}" + b"}" * (MAX_DEPTH - 1)
DEPTH_ARRAYS = b'{"a":' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"}"

EDGE_CORPUS: dict[str, bytes] = {
    "empty": b"{}",
    "empty key": b'{"":""}',
    "every plane raw": json.dumps({PLANES: PLANES}, ensure_ascii=False).encode(),
    "every plane escaped": json.dumps({PLANES: PLANES}, ensure_ascii=True).encode(),
    "escapes": rb'{"e":"\" \\ \/ \b \f \n \r \t \u0000 \u001f \u007f \uD83D\uDE00 \uffff"}',
    "BOM inside a string": '{"b":"\ufeff"}'.encode(),
    "numbers": b'{"n":[-0.0,-0,0,0e0,1E+2,1e-400,1e400,-1e400,5e-324,1.7976931348623157e308]}',
    "1000 digits": b'{"n":' + b"9" * 1000 + b"}",
    "-1000 digits": b'{"n":-' + b"9" * 1000 + b"}",
    "999 fraction digits": b'{"n":0.' + b"1" * 999 + b"}",
    "1000 digits with exponent": b'{"n":1.' + b"2" * 996 + b"e-101}",
    "hundreds of digits": b'{"n":[' + b",".join(b"7" * n for n in (100, 300, 500, 999)) + b"]}",
    "key of 50000 bytes": b'{"' + b"k" * MAX_KEY_BYTES + b'":1}',
    "key of 12500 emoji": b'{"' + "\U0001f600".encode() * (MAX_KEY_BYTES // 4) + b'":1}',
    "key of 25000 escaped": b'{"' + b"\\u00e9" * (MAX_KEY_BYTES // 2) + b'":1}',
    "string of 500000 bytes": b'{"s":"' + "ü".encode() * 250_000 + b'"}',
    "5000 keys": json.dumps({f"k{i}": i for i in range(5000)}).encode(),
    "depth at the limit, objects": DEPTH_OBJECTS,
    "depth at the limit, arrays": DEPTH_ARRAYS,
    "repeated keys": b'{"a":1,"a":{"b":2},"a":[3],"b":null,"b":true}',
    "whitespace": b'{ \t"a" \r: \t[ 1 ,\t2 ] ,"b":{ } }',
}


def test_the_edge_corpus_is_taken_by_ingest_and_the_writer(
    ingest: ThreadedIngest, writer: Writer
) -> None:
    docs = list(EDGE_CORPUS.values())
    verdicts = writer.verdicts(docs)
    refused = {name: v for name, v in zip(EDGE_CORPUS, verdicts, strict=True) if v is not None}
    assert refused == {}
    counts = check_batch(ingest, writer, docs)
    assert counts["both_take"] == len(docs)


def test_the_writer_refuses_one_step_past_each_limit_and_ingest_too(
    ingest: ThreadedIngest, writer: Writer
) -> None:
    """The other side of the corpus: the writer's own limits, one step past each."""
    past = [
        b'{"n":' + b"9" * 1001 + b"}",
        b'{"n":0.' + b"1" * 1000 + b"}",
        b'{"n":1.' + b"2" * 996 + b"e-1011}",
        b'{"' + b"k" * (MAX_KEY_BYTES + 1) + b'":1}',
        b'{"' + "\U0001f600".encode() * (MAX_KEY_BYTES // 4 + 1) + b'":1}',
        b'{"a":' * 1000 + b"{}" + b"}" * 1000,
        b'{"s":"\xff"}',
        b'{"s":"\xed\xa0\x80"}',
        b'{"s":"\\ud800"}',
        b'{"s":"\x01"}',
    ]
    assert all(v is not None for v in writer.verdicts(past))
    counts = check_batch(ingest, writer, past)
    assert counts["ingest_refuses"] == len(past)


# -- 2. generated documents ------------------------------------------------------------

# Byte sequences that are not UTF-8 (overlong forms, surrogates, past U+10FFFF, cut).
BAD_UTF8 = [
    b"\xff", b"\xfe", b"\x80", b"\xbf", b"\xc3", b"\xe2\x82", b"\xf0\x9f\x98",
    b"\xc0\xaf", b"\xc1\xbf", b"\xe0\x80\xaf", b"\xe0\x9f\xbf", b"\xf0\x80\x80\xaf",
    b"\xf8\x88\x80\x80\x80", b"\xfc\x84\x80\x80\x80\x80", b"\xf4\x90\x80\x80", b"\xf7\xbf\xbf\xbf",
    b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xed\xa0\xbd\xed\xb8\x80",
]  # fmt: skip
GOOD_PIECES = [
    c.encode() for c in PLANES
] + [
    b'\\"', b"\\\\", b"\\/", b"\\b", b"\\f", b"\\n", b"\\r", b"\\t", b"\\u0000", b"\\u001F",
    b"\\u00e9", b"\\ud83d\\ude00", b"\\uDBFF\\uDFFF", b"\\ufeff", b"\\uffff", b"\xef\xbb\xbf",
    b"[", b"]", b"{", b"}", b":", b",", b"1e5", b"-0",
]  # fmt: skip
BAD_PIECES = [
    b"\\ud800", b"\\udc00", b"\\ud800\\u0041", b"\\udbff\\ud800", b"\\ud83d", b"\\x41",
    b"\\u12", b"\\U00e9", b"\\", b'"', b"\x00", b"\x01", b"\x1f", b"\t", b"\n",
]  # fmt: skip
NUMBERS = [
    b"0", b"-0", b"-0.0", b"0e0", b"0E-0", b"1E+2", b"1e400", b"-1e400", b"1e-400", b"5e-324",
    b"1E+999999999", b"123456789012345678901234567890", b"9223372036854775808",
    b"-9223372036854775809", b"18446744073709551616", b"3.141592653589793238462643383279",
]  # fmt: skip
BAD_NUMBERS = [b"01", b"-01", b"+1", b".5", b"1.", b"1e", b"1e+", b"-", b"NaN", b"Infinity",
               b"-Infinity", b"0x10", b"1.e5", b"1_000", b"TRUE", b"nul"]  # fmt: skip
KEY_UNITS = [b"k", "é".encode(), "中".encode(), "\U0001f600".encode(), b"\\n", b"\\u00e9"]
KEY_UNIT_BYTES = [1, 2, 3, 4, 1, 2]  # unescaped UTF-8 bytes of each unit
SPACES = [b"", b"", b"", b" ", b"\t", b"\r", b"  \t"]
BAD_SPACES = [b"\x0c", b"\x0b", b"\xc2\xa0", b"\n", b"\x00"]
PLAIN = [
    b"", b"a", b"id", b"amount", b"status", b"paid", b"x y", b"0", b"true", b"caf\xc3\xa9",
    "\u00fc\u00df".encode(), "\u4e2d\u6587".encode(), "\U0001f600".encode(), b"<a href=x>",
]  # fmt: skip

# Hypothesis spends ~30 us per draw, so a document is drawn in few of them: its edges
# (the part that finds bugs, and that shrinks) are hypothesis's; the plain JSON around
# them comes from a Random that hypothesis seeds. Hypothesis also draws the ends of a
# range more often than its middle, so a rare choice sits in the middle of its range.


def pick(*percents: int) -> st.SearchStrategy[int]:
    """The index of the window that a draw falls in (each window ``percents[i]`` wide),
    or ``len(percents)`` (the rest)."""

    def window(r: int) -> int:
        at = 37
        for i, width in enumerate(percents):
            if at <= r < at + width:
                return i
            at += width
        return len(percents)

    return st.integers(0, 99).map(window)


def weighted(
    rest: st.SearchStrategy[bytes], *choices: tuple[int, st.SearchStrategy[bytes]]
) -> st.SearchStrategy[bytes]:
    """Each of ``choices`` about ``percent`` times in 100, ``rest`` otherwise."""
    options = [s for _, s in choices] + [rest]
    which = pick(*(percent for percent, _ in choices))

    @st.composite
    def one(draw: st.DrawFn) -> bytes:
        return draw(options[draw(which)])

    return one()


@st.composite
def _long_number(draw: st.DrawFn) -> bytes:
    """A number of 995 to 1005 digits, split among integer part, fraction and exponent."""
    total = draw(st.integers(995, 1005))
    fraction = draw(st.sampled_from([0, 0, 1, 500, total - 2]))
    exponent = draw(st.sampled_from([0, 0, 1, 3]))
    integer = max(1, total - fraction - exponent)
    text = draw(st.sampled_from([b"-", b""])) + b"1" + b"0" * (integer - 1)
    if fraction:
        text += b"." + b"5" * fraction
    if exponent:
        text += draw(st.sampled_from([b"e", b"E+", b"e-"])) + b"1" * exponent
    return text


@st.composite
def _long_key(draw: st.DrawFn) -> bytes:
    """A key within a few bytes of 50,000 (unescaped UTF-8 bytes), in one kind of character."""
    i = draw(st.integers(0, len(KEY_UNITS) - 1))
    n = MAX_KEY_BYTES // KEY_UNIT_BYTES[i] + draw(st.integers(-2, 2))
    return b'"' + KEY_UNITS[i] * n + b'"'


@st.composite
def _nested(draw: st.DrawFn) -> bytes:
    """A value that brings a document to a chosen depth: around ingest.max_json_depth,
    the writer's 1000, or deep enough that msgspec raises RecursionError."""
    target = draw(
        st.one_of(
            st.integers(MAX_DEPTH - 2, MAX_DEPTH + 2),
            st.integers(998, 1002),
            st.integers(1100, 1300),
        )
    )
    every = draw(st.sampled_from([0, 0, 1, 2, 7]))  # an object every n levels, else arrays
    opens: list[bytes] = []
    closes: list[bytes] = []
    for i in range(target - 1):  # the document's object is level 1
        is_object = every and i % every == 0
        opens.append(b'{"d":' if is_object else b"[")
        closes.append(b"}" if is_object else b"]")
    return b"".join(opens) + b"0" + b"".join(reversed(closes))


# An edge: (what, bytes). "string" goes inside a string, "number" and "value" are
# values, "key" a member's name; "slip" breaks the document's bytes somewhere.
_TEXT_ESCAPED = st.text(max_size=4).map(lambda t: json.dumps(t)[1:-1].encode())
_TEXT_RAW = st.text(max_size=4).map(lambda t: json.dumps(t, ensure_ascii=False)[1:-1].encode())
_FLOAT = st.floats(allow_nan=False, allow_infinity=False).map(lambda f: repr(f).encode())
_INTEGER = st.integers(-(10**40), 10**40).map(lambda i: str(i).encode())
EDGES = st.one_of(
    st.tuples(st.just("string"), st.sampled_from(GOOD_PIECES)),
    st.tuples(st.just("string"), _TEXT_ESCAPED),
    st.tuples(st.just("string"), _TEXT_RAW),
    st.tuples(st.just("number"), st.sampled_from(NUMBERS)),
    st.tuples(st.just("number"), _FLOAT),
    st.tuples(st.just("number"), _INTEGER),
    st.tuples(st.just("number"), _long_number()),
    st.tuples(st.just("repeat"), st.just(b"")),
)
DEEP_EDGES = st.tuples(st.just("value"), _nested())
RARE_EDGES = st.one_of(
    st.tuples(st.just("string"), st.sampled_from(BAD_UTF8)),
    st.tuples(st.just("string"), st.sampled_from(BAD_PIECES)),
    st.tuples(st.just("number"), st.sampled_from(BAD_NUMBERS)),
    st.tuples(st.just("key"), _long_key()),
    st.tuples(st.just("slip"), st.sampled_from([*BAD_UTF8, *BAD_SPACES, b"\xef\xbb\xbf"])),
    st.tuples(st.just("slip"), st.sampled_from([b"BOM", b"cut", b"comment", b"comma"])),
)
EDGE_LISTS = st.lists(
    pick(8, 4).flatmap(lambda i: (RARE_EDGES, DEEP_EDGES, EDGES)[i]), min_size=1, max_size=3
)


def _plain_value(rnd: random.Random, levels: int = 2) -> bytes:
    """Plain JSON that every side takes: strings, numbers, literals, small containers."""
    kind = rnd.randrange(7 if levels else 5)
    if kind == 0:
        return b'"' + rnd.choice(PLAIN) + b'"'
    if kind == 1:
        return str(rnd.randint(-(10**12), 10**12)).encode()
    if kind == 2:
        return repr(rnd.uniform(-1e6, 1e6)).encode()
    if kind in (3, 4):
        return rnd.choice([b"true", b"false", b"null", b'""', b"0"])
    space = rnd.choice(SPACES)
    items = [_plain_value(rnd, levels - 1) for _ in range(rnd.randrange(4))]
    if kind == 5:
        return b"[" + space + (b"," + space).join(items) + b"]"
    members = [b'"' + rnd.choice(PLAIN) + b'":' + space + v for v in items]
    return b"{" + space + (b"," + space).join(members) + b"}"


@st.composite
def documents(draw: st.DrawFn) -> bytes:
    """One ``new`` document: an object with its edges among plain members."""
    rnd = draw(st.randoms(use_true_random=True))
    space = rnd.choice(SPACES)
    names = [b'"' + rnd.choice(PLAIN) + b'"' for _ in range(rnd.randrange(4))]
    values = [_plain_value(rnd) for _ in names]
    slips: list[bytes] = []
    for what, edge in draw(EDGE_LISTS):
        if what == "slip":
            slips.append(edge)
        elif what == "repeat" and names:
            names.append(names[0])
            values.append(_plain_value(rnd))
        elif what == "string":
            text = b'"' + rnd.choice(PLAIN) + edge + rnd.choice(PLAIN) + b'"'
            if rnd.randrange(3):
                names.append(b'"v"')
                values.append(text)
            else:
                names.append(text)
                values.append(_plain_value(rnd))
        elif what == "key":
            names.append(edge)
            values.append(b"1")
        else:  # a number or a value, maybe inside an array
            names.append(b'"n"')
            values.append(b"[" + edge + b"]" if rnd.randrange(4) == 0 else edge)
    order = list(range(len(names)))
    rnd.shuffle(order)
    members = [names[i] + space + b":" + space + values[i] for i in order]
    doc = b"{" + space + (b"," + space).join(members) + space + b"}"
    for slip in slips:  # the slips break the document's bytes
        at = rnd.randrange(len(doc) + 1)
        if slip == b"BOM":
            doc = b"\xef\xbb\xbf" + doc
        elif slip == b"cut":
            doc = doc[: max(1, at - 1)]
        elif slip == b"comment":
            doc = doc[:-1] + b"/* c */}"
        elif slip == b"comma":
            doc = doc[:-1] + b",}"
        else:
            doc = doc[:at] + slip + doc[at:]
    return doc


def run_generated(ingest: ThreadedIngest, writer: Writer, batches: int) -> Callable[[], None]:
    counts = {"both_take": 0, "ingest_refuses": 0, "only_ingest_refuses": 0}

    @settings(
        max_examples=batches,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(st.lists(documents(), min_size=BATCH, max_size=BATCH))
    def each_batch(docs: list[bytes]) -> None:
        for name, n in check_batch(ingest, writer, docs).items():
            counts[name] += n

    def run() -> None:
        each_batch()
        total = counts["both_take"] + counts["ingest_refuses"]
        print(f"\n{total} generated documents: {counts}; refusals:")
        for refusal, n in REFUSALS.most_common():
            print(f"  {n:6d}  {refusal}")
        assert total >= batches * BATCH
        # The generator reaches both outcomes in earnest.
        assert counts["both_take"] > total // 4 and counts["ingest_refuses"] > total // 10

    return run


def test_generated_documents_are_refused_by_ingest_or_taken_by_both(
    ingest: ThreadedIngest, writer: Writer
) -> None:
    run_generated(ingest, writer, CI_BATCHES)()


@pytest.mark.soak
@pytest.mark.timeout(1800)
def test_many_more_generated_documents_are_refused_by_ingest_or_taken_by_both(
    ingest: ThreadedIngest, writer: Writer
) -> None:
    run_generated(ingest, writer, SOAK_BATCHES)()
