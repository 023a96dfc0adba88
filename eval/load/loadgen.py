"""An async streaming load generator for OpenAI-compatible servers, in the manner of `vllm bench serve`.

Closed loop: at concurrency c, c workers each send their next request as soon as the previous one
ended, until the level's requests are done. Every request streams; the arrival of each chunk that
carries tokens is stamped on one monotonic clock (eval/load/serving.py turns the stamps into metrics).
Failed and timed-out requests are recorded with their error, never dropped.

The client is aiohttp, as `vllm bench serve`'s is. On a machine where the client shares the cores with
the server, the client's own CPU time is taken from the server: with httpx this generator used 2-3x the
CPU of aiohttp for the same requests, and the server it measured had TTFT p95 up to 10x and throughput
0.75-0.9x of what the same server gave aiohttp or vLLM's own client in alternating runs (docs/measurement.md, "The load
generator against vLLM's own client").
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import random
import time
from collections.abc import Sequence
from typing import Literal
from urllib.parse import unquote, urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field

from eval.load.edge import EdgeSearch
from eval.load.serving import RequestRecord


class LoadSettings(BaseModel):
    """How a sweep loads a server: everything but where the server is."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    api: Literal["completions", "chat"] = Field(description="the endpoint driven")
    concurrency: list[int] = Field(min_length=1)
    requests_per_user: int = Field(gt=0, description="measured requests per level = concurrency x this")
    warmup: int = Field(ge=0, description="untimed warm-up rounds at the highest concurrency (0: none)")
    input_len: int = Field(gt=0, description="prompt tokens")
    output_len: int = Field(gt=0, description="output tokens asked for, exactly where the server allows it")
    exact_length: Literal["ignore_eos", "generation_config", "none"] = Field(
        "none",
        description="how to force exactly output_len tokens: vLLM's ignore_eos + min_tokens, transformers "
        "serve's generation_config (min_new_tokens), or nothing (counts come from the stream)",
    )
    timeout_s: float = Field(gt=0, description="per request")
    warmup_timeout_s: float = Field(300, gt=0, description="per warm-up request (the first may load the model)")
    edge: EdgeSearch | None = Field(None, description="levels and requests added past the grid (eval/load/edge.py)")


class LoadConfig(LoadSettings):
    """A sweep of one server."""

    url: str = Field(description="server base URL, e.g. http://127.0.0.1:8000")
    model: str = Field(description="model name the server expects in requests")


def synthetic_prompts(tokenizer, n: int, length: int, seed: int = 0) -> list[str]:
    """`n` texts that the model's tokenizer encodes to exactly `length` tokens (fixed seed).

    Built from "word" tokens (a space and letters) that encode back to themselves alone: the
    pre-tokenizer splits at spaces, so a sequence of them keeps its length. Random ids in general do
    not (they decode to broken bytes that encode differently).
    """
    rng = random.Random(seed)
    words = []
    for i in range(len(tokenizer)):
        text = tokenizer.decode([i])
        if text.startswith(" ") and text[1:].isalpha() and tokenizer.encode(text, add_special_tokens=False) == [i]:
            words.append(text)
    if len(words) < 100:
        raise ValueError(f"the tokenizer has too few word tokens ({len(words)}) to build prompts")
    prompts = []
    for _ in range(n):
        text = "".join(rng.choice(words) for _ in range(length))
        got = len(tokenizer.encode(text, add_special_tokens=False))
        if got != length:
            raise ValueError(f"a synthetic prompt encodes to {got} tokens, not {length}")
        prompts.append(text)
    return prompts


def token_prompts(vocab_size: int, n: int, length: int, seed: int = 0, avoid: Sequence[int] = ()) -> list[list[int]]:
    """`n` prompts of exactly `length` random token ids (fixed seed), none of them in `avoid` (special
    tokens), for a server started without a tokenizer (vLLM's `--skip-tokenizer-init`): the length is
    exact by construction, and every prompt differs, so no request reuses another's cached prefix."""
    rng = random.Random(seed)
    banned = set(avoid)
    allowed = [i for i in range(vocab_size) if i not in banned]
    return [[rng.choice(allowed) for _ in range(length)] for _ in range(n)]


Prompt = str | list[int]  # text, or token ids for a server without a tokenizer


def request_body(cfg: LoadConfig, prompt: Prompt) -> dict:
    body: dict = {"model": cfg.model, "max_tokens": cfg.output_len, "stream": True, "temperature": 0.0}
    if isinstance(prompt, list):  # token ids: the completions API takes them as the prompt, and streams ids
        if cfg.api == "chat":
            raise ValueError("token-id prompts need the completions API, not chat")
        body |= {"prompt": prompt, "return_token_ids": True}
    elif cfg.api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if cfg.exact_length == "ignore_eos":
        body |= {"ignore_eos": True, "min_tokens": cfg.output_len, "stream_options": {"include_usage": True}}
    elif cfg.exact_length == "generation_config":
        n = cfg.output_len
        body["generation_config"] = json.dumps({"max_new_tokens": n, "min_new_tokens": n, "do_sample": False})
    return body


def _tokens(chunk: dict, api: str) -> int:
    """Tokens a streamed chunk carries: its token ids where the server returns them (a server without a
    tokenizer streams empty text), else one for a chunk with text."""
    choices = chunk.get("choices") or []
    if not choices:
        return 0
    c = choices[0]
    if c.get("token_ids"):
        return len(c["token_ids"])
    text = (c.get("delta") or {}).get("content") if api == "chat" else c.get("text")
    return 1 if text else 0


def _chunk(data: bytes) -> dict:
    """One server-sent event's JSON, checked for the shape the generator reads; a ValueError names what is
    wrong (an error the server streamed, or a malformed chunk)."""
    chunk = json.loads(data)
    if not isinstance(chunk, dict):
        raise ValueError(f"malformed chunk: {data[:100]!r}")
    if "error" in chunk:
        raise ValueError(f"the server streamed an error: {str(chunk['error'])[:200]}")
    choices, usage = chunk.get("choices") or [], chunk.get("usage") or {}
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices) or not isinstance(usage, dict):
        raise ValueError(f"malformed chunk: {data[:100]!r}")
    return chunk


def _finished(chunk: dict) -> bool:
    """The chunk says its stream is complete: a choice with its finish reason (transformers serve ends so;
    vLLM sends one too, before its `[DONE]`)."""
    return any(c.get("finish_reason") for c in chunk.get("choices") or [])


async def one_request(session, cfg: LoadConfig, prompt: Prompt, concurrency: int, index: int, timeout: float):
    """Send one streaming request and stamp its chunks; a failure is a record with `ok=False`."""
    import aiohttp

    path = "/v1/chat/completions" if cfg.api == "chat" else "/v1/completions"
    start = time.perf_counter()
    times: list[float] = []
    counted = 0
    usage: dict = {}
    ended = False  # the stream said it was complete: `[DONE]`, or a chunk with its finish reason
    try:
        async with asyncio.timeout(timeout):
            async with session.post(cfg.url.rstrip("/") + path, json=request_body(cfg, prompt)) as resp:
                if resp.status != 200:
                    body = (await resp.read()).decode(errors="replace")[:300]
                    raise RuntimeError(f"HTTP {resp.status}: {body}")
                async for raw in resp.content:  # one server-sent-events line at a time
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        ended = True
                        break
                    chunk = _chunk(data)
                    if n := _tokens(chunk, cfg.api):
                        times.append(time.perf_counter())
                        counted += n
                    usage = chunk.get("usage") or usage
                    ended = ended or _finished(chunk)
        tokens = int(usage.get("completion_tokens") or counted)
        if tokens < counted:  # each chunk counted carried a token at least: the server's account is not the stream
            raise ValueError(f"the server's usage counts {tokens} tokens where its stream carried {counted}")
    except (TimeoutError, aiohttp.ClientError, RuntimeError, ValueError, TypeError) as e:
        why = "timeout" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
        return RequestRecord(concurrency, index, start, time.perf_counter(), False, error=why[:300])
    end = time.perf_counter()
    short = _short(cfg, ended, tokens, counted)
    if short or not times:
        return RequestRecord(
            concurrency, index, start, end, False, output_tokens=tokens, error=short or "no tokens streamed"
        )
    return RequestRecord(
        concurrency,
        index,
        start,
        end,
        True,
        first_token=times[0],
        output_tokens=tokens,
        prompt_tokens=usage.get("prompt_tokens"),
        token_times=tuple(times),
    )


def _short(cfg: LoadConfig, ended: bool, tokens: int, counted: int) -> str:
    """Why a stream that closed without an error was not served whole ("" if it was): it never said it was
    complete (the connection was closed early), or where the server was held to the asked length, it
    sent fewer tokens (as its usage counts them, else as the stream's chunks do)."""
    if not ended:
        return f"the stream closed before it was complete, after {counted} tokens"
    if cfg.exact_length != "none" and tokens < cfg.output_len:
        return f"{tokens} of the {cfg.output_len} tokens asked for"
    return ""


def prompts_needed(load: LoadSettings) -> int:
    """Requests a sweep sends, warm-up included: with this many prompts no request repeats another's, so
    none is served from the prefix cache a previous one filled."""
    top = max(load.concurrency)
    per_user = max(load.requests_per_user, load.edge.max_requests_per_user if load.edge else 0)
    added = load.edge.levels * max(top, load.edge.max_users) * per_user if load.edge else 0  # none past that
    return (1 + top * load.warmup if load.warmup else 0) + sum(c * per_user for c in load.concurrency) + added


async def run_level(
    session, cfg: LoadConfig, prompts: Sequence[Prompt], concurrency: int, n: int, first: int = 0, numbered: int = 0
) -> list[RequestRecord]:
    """`n` requests with `concurrency` closed-loop workers, taking prompts from index `first` on, the
    requests numbered from `numbered` (a level's later rounds continue its numbering)."""
    queue = iter(range(n))
    records: list[RequestRecord] = []

    async def worker() -> None:
        for i in queue:  # shared iterator: each index is taken once
            prompt = prompts[(first + i) % len(prompts)]
            records.append(await one_request(session, cfg, prompt, concurrency, numbered + i, cfg.timeout_s))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(records, key=lambda r: r.index)


TICK_S = 0.01
"""How often the sweep's ticker wakes to see whether its own event loop is held up."""
STALL_S = 0.02
"""A wake-up later than this is a stall of the load generator (busy, or not given a core), recorded."""


async def _ticker(stalls: list[tuple[float, float]]) -> None:
    """Wake every TICK_S until cancelled; a wake-up later than STALL_S past its time is (from, to) of a stall:
    while the loop was held, no chunk that arrived was read, so its tokens would look late and bunched."""
    while True:
        due = time.perf_counter() + TICK_S
        await asyncio.sleep(TICK_S)
        now = time.perf_counter()
        if now - due > STALL_S:
            stalls.append((due, now))


def with_stalls(records: list[RequestRecord], stalls: list[tuple[float, float]]) -> list[RequestRecord]:
    """Each record with the longest stall of the generator that began in its flight (to its end), in ms. A stall
    that began before a request started did not hold it: the loop, which stamps the start, was not running (a
    hook's between levels; the ticker only notices it once the level's requests are under way)."""

    def worst(r: RequestRecord) -> float:
        return max((min(to, r.end) - fro for fro, to in stalls if r.start <= fro < r.end), default=0.0)

    return [dataclasses.replace(r, client_stall_ms=1000 * worst(r)) for r in records]


def _quiet_on_interrupt(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """The loop's exception handler: an interrupt (Ctrl-C, or SIGTERM, which qeval turns into one) that lands in
    one of the sweep's tasks (aiohttp's writer, say) ends the sweep through asyncio.run, and qeval says so in
    one line; that task keeps the interrupt as its exception, which nothing retrieves, and asyncio would print
    its traceback after that line when the task is collected. Anything else is reported as asyncio does."""
    if isinstance(context.get("exception"), KeyboardInterrupt):
        return
    loop.default_exception_handler(context)


async def _sweep(cfg: LoadConfig, prompts: Sequence[Prompt], progress, starting, more, then) -> list[RequestRecord]:
    asyncio.get_running_loop().set_exception_handler(_quiet_on_interrupt)
    stalls: list[tuple[float, float]] = []
    ticker = asyncio.create_task(_ticker(stalls))
    try:
        return await _levels(cfg, prompts, progress, starting, more, then, stalls)
    finally:
        ticker.cancel()


def _basic(user: str, password: str) -> str:
    """HTTP basic authentication's header value (RFC 7617)."""
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


async def _levels(cfg, prompts, progress, starting, more, then, stalls) -> list[RequestRecord]:
    import aiohttp

    used = 0  # prompts taken so far: each request takes the next one
    # no pool limit: the workers bound the requests in flight, levels past the grid (eval/load/edge.py) included; a
    # limit under a level's users would queue its requests for a connection, a wait the server never caused
    connector = aiohttp.TCPConnector(limit=0)
    # credentials in the address go to the session, the address without them to each request: aiohttp names the
    # URL in its errors, which the records keep
    parts = urlsplit(cfg.url)
    headers = (
        {"Authorization": _basic(unquote(parts.username), unquote(parts.password or ""))} if parts.username else {}
    )
    cfg = cfg.model_copy(update={"url": urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))})
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        if cfg.warmup:  # one request first (it may load the model), then a round at the highest concurrency
            first = await one_request(session, cfg, prompts[0], 0, 0, cfg.warmup_timeout_s)
            if not first.ok:
                raise RuntimeError(f"warm-up request failed: {first.error}")
            top = max(cfg.concurrency)
            for r in await run_level(session, cfg, prompts, top, top * cfg.warmup, first=1):
                if not r.ok:
                    raise RuntimeError(f"warm-up request failed: {r.error}")
            used = 1 + top * cfg.warmup
        records: list[RequestRecord] = []

        async def level(c: int) -> None:
            nonlocal used
            starting(c)
            got: list[RequestRecord] = []
            while not got or more(c, got):  # a round of requests_per_user per user, then more while asked
                n = c * cfg.requests_per_user
                got += await run_level(session, cfg, prompts, c, n, first=used, numbered=len(got))
                got = with_stalls(got, stalls)
                used += n
            progress(c, got)
            records.extend(got)

        for c in cfg.concurrency:
            await level(c)
        while (c := then()) is not None:
            await level(c)
        return records


def sweep(
    cfg: LoadConfig,
    prompts: Sequence[Prompt],
    progress=lambda c, level: None,
    starting=lambda c: None,
    more=lambda c, level: False,
    then=lambda: None,
) -> list[RequestRecord]:
    """Warm up, then every concurrency level in order, then each level `then()` names until it says None;
    the records of every measured request (give prompts_needed() prompts, so that none repeats). At each
    level: `starting(c)` first, a round of requests_per_user per user, another while `more(c, records so far)`
    says so, then `progress(c, records)`."""
    return asyncio.run(_sweep(cfg, prompts, progress, starting, more, then))
