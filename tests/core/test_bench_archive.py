"""bench_archive's arithmetic: the PUT quantiles it reads from the daemon's
histogram, the aims it checks, and where its delay proxy sees a request
begin (the benchmark itself: `make bench`)."""

from __future__ import annotations

import math

from bench.bench_archive import RequestFraming, quantile, verdicts


def _buckets(**counts: float) -> dict[str, float]:
    """Cumulative buckets as the daemon exposes them, ``le`` in seconds."""
    out = {le.replace("_", "."): n for le, n in counts.items()}
    out["+Inf"] = max(counts.values())
    return out


def test_the_put_quantile_interpolates_within_the_bucket_that_holds_it() -> None:
    before = _buckets(**{"0_01": 0, "0_025": 0, "0_05": 0})
    after = _buckets(**{"0_01": 0, "0_025": 50, "0_05": 100})

    # Half of the PUTs took 10-25 ms, the rest 25-50 ms.
    assert quantile(0.5, before, after) == 25.0
    assert math.isclose(quantile(0.99, before, after), 25 + 25 * 0.98)
    assert math.isclose(quantile(0.25, before, after), 17.5)


def test_only_the_puts_between_the_two_readings_count() -> None:
    before = _buckets(**{"0_01": 100, "0_025": 100, "0_05": 100})
    after = _buckets(**{"0_01": 100, "0_025": 100, "0_05": 200})

    assert math.isclose(quantile(0.5, before, after), 37.5)


def test_no_put_between_the_readings_has_no_quantile() -> None:
    same = _buckets(**{"0_01": 3, "0_025": 3})

    assert math.isnan(quantile(0.99, same, same))


def test_the_aims_say_missed_for_a_slow_archived_mode_and_met_otherwise() -> None:
    row = {"events_per_s": 100_000.0, "p99_ms": 50.0, "put_p99_ms": 20.0}
    runs = {
        ("loopback", "none", 32): [row],
        ("loopback", "local", 32): [{**row, "events_per_s": 96_000.0}],
        ("loopback", "archived", 32): [{**row, "events_per_s": 70_000.0, "p99_ms": 150.0}],
    }

    lines = verdicts(runs, flush_ms=100)

    assert lines == [
        "loopback, 32 clients: local with an archive 0.96x of no archive (aim >= 0.95x): met",
        "loopback, 32 clients: archived 0.73x of local (aim >= 0.8x): MISSED",
        "loopback, 32 clients: archived ack p99 150.0 ms"
        " (aim <= flush_ms + 2 x PUT p99 = 140.0 ms): MISSED",
    ]


def test_a_ratio_pairs_each_rounds_two_configurations_not_their_medians() -> None:
    # The machine ran at 1x, 0.6x and 2x speed in the three rounds; archived
    # kept 0.9x of local in two of them. The medians' ratio would be 0.6x.
    def rounds(*eps: float) -> list[dict[str, float]]:
        return [{"events_per_s": e, "p99_ms": 50.0, "put_p99_ms": 20.0} for e in eps]

    runs = {
        ("+20 ms", "local", 32): rounds(100_000, 60_000, 200_000),
        ("+20 ms", "archived", 32): rounds(60_000, 54_000, 180_000),
    }

    [ratio, _p99] = verdicts(runs, flush_ms=100)

    assert ratio == (
        "+20 ms, 32 clients: archived 0.90x (rounds 0.60-0.90) of local (aim >= 0.8x): met"
    )


def test_the_proxy_delays_a_put_once_not_again_for_its_body_after_100_continue() -> None:
    framing = RequestFraming()
    head = b"PUT /lake/wal/1 HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 10\r\n\r\n"

    assert framing.feed(head) is True
    assert framing.feed(b"01234") is False  # the body, sent after 100 Continue
    assert framing.feed(b"56789") is False
    assert framing.feed(b"DELETE /lake/wal/0 HTTP/1.1\r\n\r\n") is True
    assert framing.feed(b"GET /lake/manifest.json HTTP/1.1\r\n") is True


def test_the_proxy_finds_a_request_whose_head_and_body_are_split_anywhere() -> None:
    framing = RequestFraming()
    one = b"PUT /k HTTP/1.1\r\ncontent-length: 4\r\n\r\nabcd"
    two = b"PUT /k2 HTTP/1.1\r\nContent-Length: 2\r\n\r\nxy"

    starts = [framing.feed(one[:7]), framing.feed(one[7:30]), framing.feed(one[30:] + two[:3])]
    starts += [framing.feed(two[3:]), framing.feed(b"HEAD /k HTTP/1.1\r\n\r\n")]

    # The second PUT begins inside a chunk (no request is pipelined by the
    # archive's client); the request after it is still found.
    assert starts == [True, False, False, False, True]
