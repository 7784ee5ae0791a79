"""Action calls: one call delivers one chunk of matched rows.

A call returns on success and raises otherwise; the error's class says what
happens next (``retriable`` → retry queue, otherwise → DLQ):

==========  =====================================  ==============================
action      retriable                              straight to the DLQ
==========  =====================================  ==============================
webhook     timeout, connection error, 408, 429,   any other non-2xx answer
            5xx (Retry-After honoured)
python      any exception                          ``triggers.PermanentError``
emit        any exception from the daemon's
            append (e.g. WAL unavailable)
sql         any Spark error (the table may come
            back; attempts are bounded)
==========  =====================================  ==============================
"""

from __future__ import annotations

import asyncio
import email.utils
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import msgspec

from triggers import evaluate
from triggers.errors import PermanentError, RetriableActionError, TriggerError
from triggers.rows import Chunk
from triggers.spec import EmitAction, PythonAction, SqlAction, Trigger, WebhookAction

EmitFn = Callable[[list[dict[str, Any]]], Awaitable[None]]
# An unreasonable Retry-After (a date next year) must not park an entry forever.
MAX_RETRY_AFTER_S = 3600.0
_BODY_SNIPPET = 200
_USER_AGENT = "eventplane-triggers/1"


def parse_retry_after(value: str | None, now: float) -> float | None:
    """Seconds from ``now`` per RFC 9110 §10.2.3: delta-seconds or an HTTP-date."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        seconds = float(value)
    else:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - now
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


def webhook_body(trigger: str, chunk: Chunk) -> bytes:
    return (
        b'{"trigger":' + msgspec.json.encode(trigger) + b',"rows":[' + b",".join(chunk.docs) + b"]}"
    )


async def call_webhook(
    http: aiohttp.ClientSession, action: WebhookAction, chunk: Chunk, now: float
) -> None:
    headers = {
        "User-Agent": _USER_AGENT,
        **action.headers,
        "Content-Type": "application/json",
        "Idempotency-Key": chunk.idempotency_key,
    }
    timeout = aiohttp.ClientTimeout(total=action.timeout_s)
    try:
        async with http.post(
            action.url, data=webhook_body(chunk.trigger, chunk), headers=headers, timeout=timeout
        ) as resp:
            if 200 <= resp.status < 300:
                await resp.read()  # drain, so the connection goes back to the pool
                return
            text = (await resp.text(errors="replace"))[:_BODY_SNIPPET].strip()
            message = f"HTTP {resp.status} from {action.url}" + (f": {text}" if text else "")
            if resp.status in (408, 429) or resp.status >= 500:
                after = parse_retry_after(resp.headers.get("Retry-After"), now)
                raise RetriableActionError(message, after)
            raise PermanentError(message)
    except TimeoutError as exc:
        raise RetriableActionError(
            f"no answer from {action.url} within {action.timeout_s:g} s"
        ) from exc
    except aiohttp.ClientError as exc:
        raise RetriableActionError(f"cannot reach {action.url}: {exc!r}") from exc


async def call_python(action: PythonAction, chunk: Chunk) -> None:
    rows = chunk.dicts()
    if action.is_async:
        await action.func(rows)
    else:
        # A sync function may block (requests, a DB driver): keep the loop free.
        await asyncio.to_thread(action.func, rows)


def derived_events(trigger: Trigger, action: EmitAction, docs: list[bytes]) -> list[dict[str, Any]]:
    """The events an emit action appends: depth + 1, source = trigger name."""
    events = []
    for doc in evaluate_docs(docs):
        emit = doc.get("emit") or {}
        events.append(
            {
                "collection": action.collection,
                "op": action.op or doc["op"],
                "key": emit["key"] if action.key is not None else doc["key"],
                "new": emit["new"] if action.new is not None else doc["new"],
                "old": None if action.new is not None else doc["old"],
                "depth": int(doc["depth"]) + 1,
                "source": trigger.name,
            }
        )
    return events


def evaluate_docs(docs: list[bytes]) -> list[dict[str, Any]]:
    return [msgspec.json.decode(d) for d in docs]


async def call_emit(
    emit: EmitFn | None, trigger: Trigger, action: EmitAction, chunk: Chunk
) -> None:
    if emit is None:
        raise RetriableActionError("no emitter is wired to the trigger engine")
    await emit(derived_events(trigger, action, chunk.docs))


async def call_sql(spark: Any, lock: threading.Lock, trigger: Trigger, action: SqlAction,
                   chunk: Chunk) -> None:  # fmt: skip
    """A sql action's retry: rebuild the rows as a DataFrame and run the statement."""
    if spark is None:
        raise RetriableActionError("no Spark session yet")

    def run() -> evaluate.SqlOutcome:
        frame = evaluate.frame_from_docs(spark, chunk.docs)
        return evaluate.run_sql(spark, frame, trigger, action, lock)

    outcome = await asyncio.to_thread(run)
    if outcome.error is not None:
        raise RetriableActionError(outcome.error)


def classify(exc: BaseException) -> tuple[bool, float | None]:
    """(retriable, retry_after_s) of an action failure."""
    if isinstance(exc, RetriableActionError):
        return True, exc.retry_after_s
    if isinstance(exc, TriggerError):
        return exc.retriable, None
    return True, None


def describe(exc: BaseException) -> str:
    if isinstance(exc, TriggerError):
        return str(exc)
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
