"""The engine-agnostic serving layer: what any HTTP inference server that the trainer launches (or
reaches at a URL) and sends token-in/token-out requests to needs, apart from what is one server
kind's own: launch, health, keys, the pool, failover and restarts, the parity probe, generation
and the order of pause, weight update and resume. A server kind plugs in as a `Dialect`
(dialect.py), registered in `DIALECTS`, and its engine assembles the layer (vLLM's: rollout/vllm/
client.py VllmEngine):

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
    config.py       ServingConfig: the settings the layer reads, built by the engine from its own section
    receivers.py    Receiver (one server's in-memory receiver), DiskReceiver, Push (+ Watch, Pushed): the
                    weight receivers as the layer drives them; WeightDirs, the folders an engine keeps
    launcher.py     LocalServer (child process, key, port, health at dialect.health_path, reaping) / RemoteServer
    servers.py      the servers as configured: one per URL, or the launched ones (made by the kind's engine);
                    a pool's split of GPUs and cores
    pool.py         placement by least work in flight and prefix affinity, each server's state
    fleet.py        starting, warming up (one dialect request), taking out and restarting servers
    generation.py   requests as coroutines: dialect body -> POST generate_path -> dialect parse; retries,
                    failover, requeue, the restart budget; pause / resume / abort: the dialect's control
                    calls, sent to every server at once on the requests' event loop
    updates.py      weight syncs through the kind's receivers and the parity probe after each: the one
                    owner of the order of pause, weight update and resume
    probe.py        the parity probe: the dialect's scoring request against an in-process reference

What a dialect supplies (one object, held by the engine and passed down explicitly):
    launch          the server's command line (module, model, host, port, flags from the config), its health path
    requests        the generate path, the request body of (prompt ids, SamplingParams, seed, log-probs per
                    token), the answer's size cap, and the strict parse of an answer into `Parsed`
    control         pause, resume and abort: each a few `Control` calls (method, path, body) and the
                    check of their answers; what a server that refuses them needs
    receivers       the weight syncs its servers take, and for each its receiver: launch flags and a
                    per-server receiver (memory), a folder loader (reload, restart), the version label
    score           the parity probe's request scoring fixed tokens, its answer cap and parse

None of it imports rollout/vllm/ or reads a vLLM field name or flag (tests/unit/test_import_graph.py):
what is a kind's own comes in from its engine: the dialect, a ServingConfig, the launched servers'
interpreter, environment, server-side code and key variables (vLLM's: rollout/vllm/env.py), the
in-memory Push (vLLM's transfer.push_all), the sampling check and the routed-experts decoding
(vLLM's protocol.check_served, decode_routed_experts). What stays vLLM's (rollout/vllm/): its
dialect and protocol, its config, its receivers (transfer.py, weight_sync.py: the dialect picks
them, and a new kind reuses them or brings its own), its environment, its server plugin, the judge.
Metric names stay `vllm/...` whatever the kind.

Cost: a dialect is pure; per request it builds one body and parses one answer, O(answer)
(the answer is read no further than dialect.answer_cap); per pool, the layer holds O(servers)
state (a replica each: its state, counters and affinity index) and one command line per launch;
per request in flight one coroutine and one socket; per sync each server loads the whole model
once and answers one probe (updates.py).
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
