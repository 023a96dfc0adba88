"""A minimal OpenAI-style streaming endpoint that answers instantly: the load generator's own ceiling.

`python -m eval.load.stream_stub --port P` serves POST /v1/completions (max_tokens chunks of one token
each, no model behind them) and GET /health on 127.0.0.1. Driving it as hard as the generator can
measures how many chunks per second the generator itself can take in, which must stay far above the
rates it measures on a real server.

With `--ms-per-user M` it stands in for a server whose first token waits M ms for every request in flight
(itself included) when it arrives: a latency that grows with concurrency in a known way, so that a search for
the objective's edge can be held to where the edge is (tests/test_edge.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json


def app(ms_per_user: float = 0.0):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    in_flight = 0

    async def completions(request: Request):
        nonlocal in_flight
        body = await request.json()
        n = int(body.get("max_tokens") or 16)
        in_flight += 1
        wait = ms_per_user * in_flight / 1000

        async def stream():
            nonlocal in_flight
            try:
                if wait:
                    await asyncio.sleep(wait)
                for i in range(n):
                    yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f' t{i}'}]})}\n\n"
                usage = {"completion_tokens": n, "prompt_tokens": 1}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def health(request: Request):
        return PlainTextResponse("ok")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/health", health)])


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ms-per-user", type=float, default=0.0, help="first-token wait per request in flight")
    args = parser.parse_args()
    uvicorn.run(app(args.ms_per_user), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
