"""The benchmark's clients: processes with an asyncio loop each, started together, streaming
their share of a request plan through the SDK (``AsyncClient.generate_stream``) or the HTTP
API (``servinglib.httpclient``); every token's time is recorded, relative to a common start."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import secrets
import time
import traceback

from servinglib.streams import run_plan, start


def client_main(
    address: str, plan: list, t0_value, go, results, warm: bool, deadline_s: float, api: str = "grpc", salt: str = ""
) -> None:
    """Run ``plan`` [(index, offset_s, prompt_ids, max_tokens)] through ``api`` (``grpc``: the
    SDK at ``address`` HOST:PORT; ``http``: /v1/completions at ``address`` http://HOST:PORT;
    ``turns``: conversations through the SDK, ``servinglib.prefix``); every time is relative to
    t0 (``time.monotonic()``, one clock for every process of the host), set by the parent.
    ``salt``: every request's ``cache_salt``, so that a run finds no block another run cached."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    if api == "http":
        from servinglib.httpclient import client_http as run
    elif api == "turns":
        from servinglib.prefix import client_turns as run
    else:
        run = client_grpc
    asyncio.run(run(address, plan, t0_value, go, results, warm, deadline_s, salt))


async def client_grpc(address, plan, t0_value, go, results, warm, deadline_s, salt="") -> None:
    """The SDK's streaming call, every request of ``plan`` at its offset from the common start;
    a record's ``cached``: the prompt tokens the server read from its prefix cache, ``ids``: the
    generated ids."""
    from moeserve.client import AsyncClient

    client = AsyncClient(address, timeout=deadline_s)
    if warm:  # connect, and one token through every layer
        async for _ in client.generate_stream(prompt_token_ids=[5, 6, 7], max_tokens=1, ignore_eos=True):
            pass
    results.put(("ready", None))
    t0 = await start(go, t0_value)

    async def request(rec, prompt, n):
        rec["ids"] = []
        async for chunk in client.generate_stream(
            prompt_token_ids=prompt, max_tokens=n, ignore_eos=True, cache_salt=salt
        ):
            now = time.monotonic() - t0
            rec["tokens"].extend([now] * len(chunk.token_ids))
            rec["ids"].extend(chunk.token_ids)
            if chunk.finish_reason:
                rec["finish"] = chunk.finish_reason
            if chunk.usage is not None:
                rec["cached"] = chunk.usage.cached_tokens

    recs, cpu = await run_plan(plan, t0, deadline_s, request, {"cached": 0})
    await client.close()
    results.put(("done", {"recs": recs, "cpu_s": cpu}))


def drive(
    address: str,
    plan: list,
    procs: int,
    deadline_s: float,
    api: str = "grpc",
    stats: dict | None = None,
    on_start=None,
    salt: str | None = None,
) -> list[dict]:
    """Split ``plan`` round-robin over ``procs`` client processes of ``api``, start them
    together, and return every request's record (times relative to the common start);
    ``stats`` (when given) gets the clients' CPU seconds during the run (``client_cpu_s``) and,
    for HTTP, whether the server sent each chunk's token ids (``http_token_ids``). ``salt``:
    every request's ``cache_salt``; by default one of this run's own, so that no run reads the
    KV blocks another run (a warm-up, an earlier round, another API) left in the prefix cache."""
    salt = salt if salt is not None else f"run-{secrets.token_hex(8)}"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    t0 = ctx.Value("d", 0.0)
    go = ctx.Event()
    shares = [plan[k::procs] for k in range(procs)]
    shares = [s for s in shares if s]
    ps = [
        ctx.Process(target=_client_entry, args=(address, s, t0, go, results, True, deadline_s, api, salt), daemon=True)
        for s in shares
    ]
    for p in ps:
        p.start()

    def fail(what: str):
        for p in ps:
            p.kill()
        raise RuntimeError(what)

    ready = 0
    limit = time.monotonic() + 120
    while ready < len(ps):
        try:
            kind, payload = results.get(timeout=1.0)
            if kind == "error":
                fail(f"a {api} client process failed: {payload}")
            ready += kind == "ready"
        except RuntimeError:
            raise
        except Exception:  # queue.Empty
            if any(not p.is_alive() for p in ps) or time.monotonic() > limit:
                fail(f"a {api} client process did not start")
    t0.value = time.monotonic() + 0.2
    go.set()
    if on_start is not None:  # the common start (time.monotonic())
        on_start(t0.value)
    recs, cpu, token_ids = [], 0.0, []
    done = 0
    limit = time.monotonic() + deadline_s + 60
    while done < len(ps):
        try:
            kind, payload = results.get(timeout=1.0)
        except Exception:  # queue.Empty
            if time.monotonic() > limit or all(not p.is_alive() for p in ps):
                fail(f"a {api} client process did not finish")
            continue
        if kind == "error":
            fail(f"a {api} client process failed: {payload}")
        if kind == "done":
            recs.extend(payload["recs"])
            cpu += payload["cpu_s"]
            if "token_ids" in payload:
                token_ids.append(payload["token_ids"])
            done += 1
    for p in ps:
        p.join(10)
    if stats is not None:
        stats["client_cpu_s"] = cpu
        if token_ids:
            stats["http_token_ids"] = all(token_ids)
    return sorted(recs, key=lambda r: r["i"])


def _client_entry(*args) -> None:
    results = args[4]
    try:
        client_main(*args)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        results.put(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))
        raise


def warm_up(address: str, plan: list, procs: int, api: str = "grpc") -> None:
    """The plan's prompts through prefill and a few decode steps (at most 16 tokens each), under
    a salt of their own (``drive``): the measured runs find none of their blocks cached."""
    drive(address, [(i, 0.0, p, min(16, n)) for i, _, p, n in plan], procs, 300, api=api)
