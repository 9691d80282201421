"""The wire format: request bodies for vLLM's token-in/token-out `/inference/v1/generate` (and
`/v1/completions` for the parity probe's prompt log-probs), and strict parsing of the answers.

Token in, token out: the prompt goes as a list of token ids, the server runs with
--skip-tokenizer-init and --enable-scale-out (which mounts the endpoint), and every answer must
carry the sampled token ids (`token_ids`, with `logprobs.content[t].token_id` cross-checking
them), one finite log-prob per token and a finish reason consistent with them. Anything else
raises `BadResponse` naming what is wrong; the client counts and retries it, and never turns it
into a sample. With --enable-prompt-tokens-details the answer's `usage.prompt_tokens_details.
cached_tokens` says how many prompt tokens came from the server's prefix cache (Parsed.cached_tokens,
the rollout's prefix-cache share; None when the server does not say).

Weight versions. The answer's `weight_versions` spans say which weights made which output tokens:
[{"version": "3", "start": 0, "end": 50}, {"version": "4", "start": 50, "end": 240}] for a request
that a weight update paused after 50 tokens (vLLM's `/pause?mode=keep`; every sync labels the
server's weights with the trainer version, transfer.py / updates.py). vLLM's label before any is
set is "default": those tokens carry the version the client read at the call's start.

Log-prob semantics. vLLM has one server-wide `--logprobs-mode`:
    raw_logprobs        log_softmax(logits)                  (no temperature, no truncation)
    processed_logprobs  log_softmax(truncate(logits / T))    (after temperature and top-k/top-p)
and greedy requests (T = 0) always get the untruncated T = 1 log-probs. A request's
`SamplingParams.logprobs_mode` asks for "raw" = log_softmax(logits / T) before truncation, or
"processed" = renormalised over the kept set. `serves(mode, sampling)` says when the server's
numbers are exactly the requested ones; otherwise the client refuses the call.
"""
from __future__ import annotations

import base64
import io
import math

import torch

from megatron_rl.rollout.serving.dialect import Parsed
from megatron_rl.rollout.serving.errors import UnsupportedError
from megatron_rl.rollout.serving.http import BadResponse
from megatron_rl.rollout.types import SamplingParams

_DROPPED = -9000.0  # vLLM writes -inf log-probs as -9999.0 in JSON


def _truncates(sampling: SamplingParams, vocab_size: int) -> bool:
    return sampling.top_p < 1.0 or (sampling.top_k != -1 and sampling.top_k < vocab_size)


def serves(server_mode: str, sampling: SamplingParams, vocab_size: int) -> bool:
    """True when a server in `server_mode` reports exactly the log-probs `sampling` asks for."""
    t, trunc = sampling.temperature, _truncates(sampling, vocab_size)
    if t == 0:  # vLLM: greedy rows get untruncated log-probs at T = 1 in both modes
        return not (sampling.logprobs_mode == "processed" and trunc)
    if server_mode == "raw_logprobs":
        return t == 1.0 and not (sampling.logprobs_mode == "processed" and trunc)
    # processed_logprobs: temperature applied, truncation applied
    return sampling.logprobs_mode == "processed" or not trunc


def check_served(server_mode: str, sampling: SamplingParams, vocab_size: int) -> None:
    """Raise UnsupportedError when the server cannot report what `sampling` asks for."""
    if sampling.return_kept_ids and server_mode != "processed_logprobs":
        raise UnsupportedError(
            "return_kept_ids needs a server with --logprobs-mode processed_logprobs (the kept set is read "
            "from the truncated top log-probs); set rollout.vllm.logprobs_mode=processed_logprobs")
    if not serves(server_mode, sampling, vocab_size):
        raise UnsupportedError(
            f"the vLLM server runs --logprobs-mode {server_mode}, which does not report "
            f"logprobs_mode={sampling.logprobs_mode!r} log-probs at temperature={sampling.temperature}, "
            f"top_p={sampling.top_p}, top_k={sampling.top_k}: raw_logprobs has no temperature (exact only at "
            f"T in {{0, 1}}), processed_logprobs is renormalised after top-k/top-p. Set "
            f"rollout.vllm.logprobs_mode to the other mode or 'auto', or change the sampling settings")


def server_logprobs_mode(temperature: float, top_p: float, top_k: int, logprobs_mode: str, vocab_size: int) -> str:
    """The --logprobs-mode that serves a run's training sampling (and its greedy evaluation)."""
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, logprobs_mode=logprobs_mode)
    for mode in ("raw_logprobs", "processed_logprobs"):
        if serves(mode, sampling, vocab_size):
            return mode
    raise UnsupportedError(
        f"no vLLM --logprobs-mode reports raw (untruncated) log-probs at temperature={temperature} with "
        f"top_p={top_p}, top_k={top_k}: vLLM gives either no temperature (raw) or temperature and truncation "
        f"(processed). Use temperature 1, or no top-k/top-p, or loss.keep_sampling_mask (processed log-probs)")


GENERATE = "/inference/v1/generate"
UNLABELLED = "default"  # vLLM's weight version before anyone sets one


def generate_body(model: str, prompt: list[int], sampling: SamplingParams, seed: int, num_logprobs: int = 0) -> dict:
    """One sample of one prompt. `num_logprobs` log-probs per position: the sampled token's first,
    then the top ones (used to read the kept set); 0 gives the sampled token's alone."""
    return {
        "model": model,
        "token_ids": list(prompt),
        "output_mode": "tokens",
        "sampling_params": {
            "n": 1,
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "seed": seed,
            "stop_token_ids": sorted(set(sampling.stop_token_ids)),
            "ignore_eos": True,  # only stop_token_ids end a response, as in every engine
            "min_tokens": 0,
            "logprobs": num_logprobs,
            "detokenize": False,
        },
    }


# Bytes an answer may take, for the size cap (http.request's max_bytes). vLLM's own response
# models, serialised with the widest values (6-digit ids and ranks, 23-character floats), stay
# 2.9x (64 top log-probs) to 4x (none) below the caps: a cap never refuses a valid answer; it
# bounds what a server can make the trainer hold to what the request asked for.
_ENVELOPE_BYTES = 64 << 10  # ids, usage, metrics, weight_versions spans of a few versions
_TOKEN_BYTES = 256  # a token in token_ids / prompt_token_ids and its logprobs.content entry
_LOGPROB_BYTES = 128  # one {"token_id", "logprob", "rank"} entry (top_logprobs, prompt_logprobs)
_TEXT_BYTES = 1024  # the decoded text a prompt_logprobs entry may carry (6-byte \u escapes)


def generate_answer_cap(prompt_len: int, sampling: SamplingParams, num_logprobs: int = 0,
                        routed_values: int = 0) -> int:
    """The most bytes a valid answer to `generate_body(prompt, sampling, num_logprobs=...)` takes:
    64 KiB + (prompt_len + max_tokens) x (256 + 128 x (1 + num_logprobs) + 6 x routed_values)
    bytes, where routed_values = MoE layers x top-k (R3: routed experts, base64 of int32 at most,
    4/3 x 4 < 6 bytes each). The prompt counts because vLLM echoes its ids. About 0.6 MB for a
    1024-token sample, 13 MB with 64 top log-probs per token: what one request can make the
    trainer hold, times max_concurrency per server."""
    per_token = _TOKEN_BYTES + _LOGPROB_BYTES * (1 + num_logprobs) + 6 * routed_values
    return _ENVELOPE_BYTES + (prompt_len + sampling.max_tokens) * per_token


def prompt_logprobs_answer_cap(num_tokens: int) -> int:
    """The most bytes a valid answer to `prompt_logprobs_body(model, tokens)` takes: 64 KiB +
    len(tokens) x (256 + 2 x (128 + 1024)) (per position the token's entry and the top one, each
    possibly with its decoded text)."""
    return _ENVELOPE_BYTES + num_tokens * (_TOKEN_BYTES + 2 * (_LOGPROB_BYTES + _TEXT_BYTES))


def _int(x, where: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise BadResponse(f"{where} is {x!r:.50}, not an integer")
    return x


def _finite_logprob(x, where: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise BadResponse(f"{where}: log-prob {x!r} is not a number")
    x = float(x)
    if not math.isfinite(x) or x <= _DROPPED:
        raise BadResponse(f"{where}: log-prob {x} is not finite")
    if x > 1e-4:
        raise BadResponse(f"{where}: log-prob {x} > 0")
    return x


def _choice(resp) -> dict:
    if not isinstance(resp, dict):
        raise BadResponse(f"answer is {type(resp).__name__}, not a JSON object")
    choices = resp.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise BadResponse(f"answer needs exactly one choice, got {choices!r:.200}")
    return choices[0]


def parse_generate(resp, prompt_len: int, sampling: SamplingParams, vocab_size: int,
                   max_model_len: int | None = None, num_logprobs: int = 0) -> Parsed:
    """Validate one `/inference/v1/generate` answer. Raises BadResponse."""
    c = _choice(resp)
    ids = c.get("token_ids")
    lp = c.get("logprobs")
    if not isinstance(ids, list) or not ids:
        raise BadResponse(f"token_ids missing or empty: {ids!r:.100}")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
        raise BadResponse(f"token_ids has entries outside [0, {vocab_size}): {ids!r:.200}")
    if len(ids) > sampling.max_tokens:
        raise BadResponse(f"{len(ids)} tokens > max_tokens={sampling.max_tokens}")
    content = lp.get("content") if isinstance(lp, dict) else None
    if not isinstance(content, list) or not all(isinstance(e, dict) for e in content):
        raise BadResponse("logprobs.content missing")
    if len(content) != len(ids):
        raise BadResponse(f"lengths differ: {len(ids)} token_ids, {len(content)} log-probs")
    if [e.get("token_id") for e in content] != ids:
        raise BadResponse("logprobs.content token ids do not match token_ids")
    logprobs = [_finite_logprob(e.get("logprob"), f"position {t}") for t, e in enumerate(content)]

    stops = set(sampling.stop_token_ids)
    early = [t for t, tok in enumerate(ids[:-1]) if tok in stops]
    if early:
        raise BadResponse(f"stop token at position {early[0]} but the response goes on")
    finish = c.get("finish_reason")
    if finish == "stop":
        if ids[-1] not in stops:
            raise BadResponse(f"finish_reason 'stop' but the last token {ids[-1]} is not a stop token")
    elif finish == "length":
        at_cap = len(ids) == sampling.max_tokens or (max_model_len is not None and prompt_len + len(ids) >= max_model_len)
        if not at_cap:
            raise BadResponse(f"finish_reason 'length' after {len(ids)} of max_tokens={sampling.max_tokens}")
        if ids[-1] in stops:
            finish = "stop"
    else:
        raise BadResponse(f"finish_reason {finish!r} (expected 'stop' or 'length')")

    kept = _kept_ids(content, ids, num_logprobs, vocab_size) if sampling.return_kept_ids else None
    return Parsed(torch.tensor(ids, dtype=torch.long), torch.tensor(logprobs, dtype=torch.float32), finish, kept,
                  c.get("routed_experts"), token_versions(c.get("weight_versions"), len(ids)),
                  cached_tokens(resp.get("usage"), prompt_len))


def cached_tokens(usage, prompt_len: int) -> int | None:
    """The prompt tokens the server found in its prefix cache: `usage.prompt_tokens_details.
    cached_tokens`, which vLLM reports only with --enable-prompt-tokens-details; None when absent.
    Raises BadResponse when it is there but not an integer in [0, prompt_len]."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    if details is None:
        return None
    if not isinstance(details, dict):
        raise BadResponse(f"usage.prompt_tokens_details is {details!r:.50}, not an object")
    cached = details.get("cached_tokens")
    if cached is None:
        return None
    if _int(cached, "usage.prompt_tokens_details.cached_tokens") < 0 or cached > prompt_len:
        raise BadResponse(f"usage.prompt_tokens_details.cached_tokens={cached} of a {prompt_len}-token prompt")
    return cached


def token_versions(spans, num_tokens: int) -> torch.Tensor | None:
    """[num_tokens] int32: each output token's weight version, from vLLM's spans (contiguous,
    covering [0, num_tokens), labelled with the trainer's integer versions, never decreasing);
    None when absent or unlabelled (vLLM's "default"). Raises BadResponse otherwise."""
    if spans is None:
        return None
    if not isinstance(spans, list) or not spans or not all(isinstance(s, dict) for s in spans):
        raise BadResponse(f"weight_versions is {spans!r:.100}, not a list of spans")
    if [s.get("version") for s in spans] == [UNLABELLED]:
        return None
    out = torch.empty(num_tokens, dtype=torch.int32)
    at, last = 0, None
    for s in spans:
        start, end = _int(s.get("start"), "a weight_versions start"), _int(s.get("end"), "a weight_versions end")
        label = s.get("version")
        try:
            v = int(label)
        except (TypeError, ValueError):
            raise BadResponse(f"weight version {label!r:.50} is not a trainer version (the server's weights were "
                              f"labelled by someone else, or not at every sync)") from None
        if start != at or end <= start or (last is not None and v < last):
            raise BadResponse(f"weight_versions spans {spans!r:.200} are not contiguous and non-decreasing")
        out[start:end] = v
        at, last = end, v
    if at != num_tokens:
        raise BadResponse(f"weight_versions cover {at} of {num_tokens} tokens")
    return out


def _kept_ids(content: list[dict], ids: list[int], num_logprobs: int, vocab_size: int) -> torch.Tensor:
    """[R, K] ascending kept ids (-1 padded) from processed top log-probs (dropped ones are -9999).
    Each position lists `num_logprobs` entries: the sampled token, then the highest-ranked others;
    the kept set is a top-ranked prefix, so once an entry is dropped every kept one is listed."""
    rows = []
    for t, entry in enumerate(content):
        top = entry.get("top_logprobs")
        if not isinstance(top, list) or not all(isinstance(x, dict) for x in top):
            raise BadResponse(f"top_logprobs[{t}] missing (needed for return_kept_ids)")
        kept = sorted({_int(x.get("token_id"), f"a top_logprobs[{t}] token id") for x in top
                       if isinstance(x.get("logprob"), (int, float)) and x["logprob"] > _DROPPED})
        if ids[t] not in kept:
            raise BadResponse(f"position {t}: the sampled token {ids[t]} is not in the kept set")
        if len(kept) >= num_logprobs and num_logprobs < vocab_size:
            raise UnsupportedError(
                f"the kept top-p/top-k set at position {t} has >= {num_logprobs} tokens, more than the server "
                f"returns (--max-logprobs); raise rollout.vllm.max_logprobs")
        rows.append(kept)
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), -1, dtype=torch.long)
    for t, r in enumerate(rows):
        out[t, :len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def decode_routed_experts(blob, num_positions: int, top_k: int) -> torch.Tensor:
    """vLLM's routed experts (base64 of a .npy array [positions, moe_layers, top_k]) -> int16
    tensor sorted ascending per position (the engines' convention)."""
    import numpy as np

    if not isinstance(blob, str):
        raise BadResponse("routed_experts missing (is the server running with --enable-return-routed-experts?)")
    try:
        arr = np.load(io.BytesIO(base64.b64decode(blob)), allow_pickle=False)
    except Exception as e:  # noqa: BLE001 - any decoding failure is a bad answer
        raise BadResponse(f"routed_experts is not base64 .npy: {e}") from None
    if arr.ndim != 3 or arr.shape[0] != num_positions or arr.shape[2] != top_k:
        raise BadResponse(f"routed_experts shape {arr.shape}, expected ({num_positions}, layers, {top_k})")
    return torch.from_numpy(arr.astype("int64")).sort(dim=-1).values.to(torch.int16)


def prompt_logprobs_body(model: str, tokens: list[int]) -> dict:
    """Score fixed tokens: the log-prob of every token given the ones before (one greedy token out)."""
    return {"model": model, "prompt": list(tokens), "max_tokens": 1, "temperature": 0.0,
            "prompt_logprobs": 0, "return_token_ids": True, "ignore_eos": True}


def parse_prompt_logprobs(resp, tokens: list[int]) -> torch.Tensor:
    """[len(tokens) - 1] fp32: log p(tokens[t] | tokens[:t]) for t >= 1, from `prompt_logprobs`."""
    c = _choice(resp)
    entries = c.get("prompt_logprobs")
    if not isinstance(entries, list) or len(entries) != len(tokens):
        raise BadResponse(f"prompt_logprobs missing or of length {len(entries) if isinstance(entries, list) else None}, "
                          f"expected {len(tokens)}")
    out = []
    for t in range(1, len(tokens)):
        entry = entries[t]
        item = entry.get(str(tokens[t])) if isinstance(entry, dict) else None
        if not isinstance(item, dict):
            raise BadResponse(f"prompt_logprobs[{t}] has no entry for token {tokens[t]}")
        out.append(_finite_logprob(item.get("logprob"), f"prompt position {t}"))
    return torch.tensor(out, dtype=torch.float32)
