"""The engine-agnostic serving layer: what any HTTP inference server that the trainer launches (or
reaches at a URL) and sends token-in/token-out requests to needs, apart from what is one server
kind's own. A server kind plugs in as a `Dialect` (dialect.py), registered in `DIALECTS`:

    dialect.py      Dialect: what a server kind supplies (LAUNCH, REQUESTS, CONTROL, RECEIVERS, SCORE); Parsed, one
                    answer; Control, one control call; DIALECTS, the registry ("vllm": rollout/vllm/dialect.py,
                    registered in rollout/registered.py)
    handle.py       ServerHandle: what the layer needs of one server (url, key, alive, start / stop)
    http.py         stdlib JSON over HTTP: one deadline per request, a capped answer, failures sorted
                    (TransportError, HttpStatusError, BadResponse, AnswerTooLarge)
    ahttp.py        the same contract over async HTTP (aiohttp): requests as coroutines
    loop.py         LoopThread: an event loop in a thread of its own, where those coroutines run
    affinity.py     PrefixTable: the server that last held the longest prefix of a request's tokens
    errors.py       ServingError and its kinds: every failure the trainer sees from a served engine

What a dialect supplies (one object, held by the engine and passed down explicitly):
    launch          the server's command line (module, model, host, port, flags from the config), its health path
    requests        the generate path, the request body of (prompt ids, SamplingParams, seed, log-probs per
                    token), the answer's size cap, and the strict parse of an answer into `Parsed`
    control         pause, resume and abort: each a few `Control` calls (method, path, body) and the
                    check of their answers; what a server that refuses them needs
    receivers       the weight syncs its servers take, and for each its receiver: launch flags and a
                    per-server receiver (memory), a folder loader (reload, restart), the version label
    score           the parity probe's request scoring fixed tokens, its answer cap and parse

What is engine-agnostic and uses a dialect (today still under rollout/vllm/, which a later step
moves here; none of it reads a vLLM field name or flag once given the dialect):
    launcher.py     LocalServer (child process, key, port, health at dialect.health_path, reaping) / RemoteServer
    pool.py         placement by least work in flight and prefix affinity, each server's state
    fleet.py        starting, warming up (one dialect request), taking out and restarting servers
    generation.py   requests as coroutines: dialect body -> POST generate_path -> dialect parse; retries,
                    failover, requeue, the restart budget; pause / resume / abort: the dialect's control
                    calls, sent to every server at once on the requests' event loop

What stays vLLM-only in this slice (rollout/vllm/): the receivers' own code (transfer.py, weight_sync.py:
the dialect picks them, and a new kind reuses them or brings its own), the log-prob mode rules
(protocol.check_served), the routed-experts format and its start-up check, and the server plugin.

Cost: a dialect is pure; per request it builds one body and parses one answer, O(answer)
(the answer is read no further than dialect.answer_cap); per pool, the layer holds O(servers)
state (a replica each: its state, counters and affinity index) and one command line per launch.
"""
from megatron_rl.rollout.serving.dialect import DIALECTS, Control, Dialect, Parsed
from megatron_rl.rollout.serving.errors import (
    BadResponseError,
    ParityError,
    ProbeError,
    RequestError,
    ServerDiedError,
    ServerStartError,
    ServingError,
    UnsupportedError,
)

__all__ = ["DIALECTS", "BadResponseError", "Control", "Dialect", "ParityError", "Parsed", "ProbeError", "RequestError",
           "ServerDiedError", "ServerStartError", "ServingError", "UnsupportedError"]
