"""EmbeddedEngine.generate: KV-cached decoding against full forwards, reproducibility, stops, kept ids, routing."""
import pytest
import torch

from megatron_rl.rollout.embedded import EmbeddedEngine
from megatron_rl.rollout.sampling import truncation_mask
from megatron_rl.rollout.types import SamplingParams
from tests.unit.rollout.conftest import prompts_of

LENGTHS = [5, 9, 1, 14, 7]


def flat(rows):
    return [s for row in rows for s in row]


def _engine(checkpoint, **kw):
    arch, _, ckpt = checkpoint
    engine = EmbeddedEngine(arch, **kw)
    engine.update_weights(ckpt.items(), version=4)
    return engine


@pytest.fixture(scope="module")
def moe_engine(moe_checkpoint):
    return _engine(moe_checkpoint)


def _full_forward(ref, sample):
    """Logits [R, V] of a no-cache forward over prompt + response, at the response positions."""
    p, r = len(sample.prompt_ids), len(sample.response_ids)
    ids = torch.cat([sample.prompt_ids, sample.response_ids])[None]
    with torch.no_grad():
        out = ref(ids, output_router_logits=ref.config.model_type == "qwen3_moe")
    return out.logits[0, p - 1:p + r - 1].float(), out


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.7, top_p=0.9, max_tokens=6, seed=3),
                                      SamplingParams(temperature=0.0, max_tokens=6)], ids=["T0.7", "greedy"])
def test_cached_decoding_matches_full_forward(moe_checkpoint, moe_engine, sampling):
    _, ref, _ = moe_checkpoint
    prompts = prompts_of(LENGTHS, 64)
    out = moe_engine.generate(prompts, n=3, sampling=sampling)
    assert [[(s.prompt_index, s.sample_index) for s in row] for row in out] == [
        [(i, j) for j in range(3)] for i in range(len(prompts))]
    for i, row in enumerate(out):
        for s in row:
            assert s.prompt_ids.tolist() == prompts[i] and s.policy_version == 4
            assert s.response_ids.dtype == torch.int64 and s.rollout_logprobs.dtype == torch.float32
            logits, _ = _full_forward(ref, s)
            t = sampling.temperature or 1.0
            lp = torch.log_softmax(logits / t, -1).gather(-1, s.response_ids[:, None]).squeeze(-1)
            torch.testing.assert_close(s.rollout_logprobs, lp, atol=1e-5, rtol=0)
            if sampling.temperature == 0:
                assert torch.equal(s.response_ids, logits.argmax(-1))
            else:  # every sampled token is in its top-p nucleus
                keep = truncation_mask(logits / t, -1, sampling.top_p)
                assert keep.gather(-1, s.response_ids[:, None]).all()
    if sampling.temperature:  # samples of one prompt differ
        assert len({tuple(s.response_ids.tolist()) for s in out[3]}) > 1


def test_routed_experts_match_full_forward(moe_checkpoint, moe_engine):
    arch, ref, _ = moe_checkpoint
    out = moe_engine.generate(prompts_of(LENGTHS, 64), n=2, sampling=SamplingParams(max_tokens=5, seed=1))
    for s in (s for row in out for s in row):
        p, r = len(s.prompt_ids), len(s.response_ids)
        assert s.routed_experts.shape == (p + r - 1, 2, arch.moe_topk)
        assert s.routed_experts.dtype == torch.int16
        _, full = _full_forward(ref, s)
        want = torch.stack([torch.softmax(x.float(), -1).topk(arch.moe_topk).indices.sort(-1).values
                            for x in full.router_logits], dim=1)[: p + r - 1]  # [S, layers, k]
        assert torch.equal(s.routed_experts.long(), want)


def test_same_seed_same_samples_whatever_the_batch_size(moe_checkpoint, moe_engine):
    prompts = prompts_of(LENGTHS, 64, seed=1)
    sampling = SamplingParams(temperature=1.0, top_k=20, max_tokens=6, seed=11, stop_token_ids=(1, 2, 3, 4))
    big = moe_engine.generate(prompts, n=4, sampling=sampling)
    for mbs in (1, 3):
        small = _engine(moe_checkpoint, max_batch_size=mbs).generate(prompts, n=4, sampling=sampling)
        for a, b in zip(flat(big), flat(small)):
            assert torch.equal(a.response_ids, b.response_ids) and a.finish_reason == b.finish_reason
            torch.testing.assert_close(a.rollout_logprobs, b.rollout_logprobs, atol=1e-5, rtol=0)
            assert torch.equal(a.routed_experts, b.routed_experts)
    other = moe_engine.generate(prompts, n=4, sampling=SamplingParams(top_k=20, max_tokens=6, seed=12))
    assert any(not torch.equal(a.response_ids, b.response_ids) for a, b in zip(flat(big), flat(other)))


def test_stop_tokens_and_lengths(moe_engine):
    stops = tuple(range(0, 64, 4))
    sampling = SamplingParams(max_tokens=7, stop_token_ids=stops, seed=5)
    samples = flat(moe_engine.generate(prompts_of(LENGTHS, 64), n=8, sampling=sampling))
    reasons = {s.finish_reason for s in samples}
    assert reasons == {"stop", "length"}
    for s in samples:
        ids = s.response_ids.tolist()
        assert 1 <= len(ids) <= 7 and len(s.rollout_logprobs) == len(ids)
        assert not any(t in stops for t in ids[:-1])  # a stop token only ever ends the response
        if s.finish_reason == "stop":
            assert ids[-1] in stops
        else:
            assert len(ids) == 7 and ids[-1] not in stops
    one = moe_engine.generate([[5, 6]], n=2, sampling=SamplingParams(max_tokens=1))
    assert [len(s.response_ids) for s in one[0]] == [1, 1] and one[0][0].routed_experts.shape[0] == 2


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (-1, 0.6), (8, 0.5)])
def test_kept_ids(moe_checkpoint, moe_engine, top_k, top_p):
    _, ref, _ = moe_checkpoint
    sampling = SamplingParams(temperature=0.9, top_k=top_k, top_p=top_p, max_tokens=5, seed=2,
                              return_kept_ids=True)
    widths = set()
    for s in flat(moe_engine.generate(prompts_of(LENGTHS, 64), n=2, sampling=sampling)):
        kept = s.kept_ids
        assert kept.dtype == torch.int64 and kept.shape[0] == len(s.response_ids)
        logits, _ = _full_forward(ref, s)
        want = truncation_mask(logits / 0.9, top_k, top_p)
        for t in range(len(s.response_ids)):
            ids = kept[t][kept[t] >= 0]
            assert (kept[t][len(ids):] == -1).all()  # padding only at the end
            assert ids.tolist() == want[t].nonzero().squeeze(-1).tolist()
            assert s.response_ids[t] in ids
            widths.add(len(ids))
    if top_k == 5:
        assert widths == {5}
    else:
        assert len(widths) > 1
    assert moe_engine.generate([[1]], n=1, sampling=SamplingParams(max_tokens=2))[0][0].kept_ids is None


def test_dense_engine_and_close(dense_checkpoint):
    engine = _engine(dense_checkpoint, dtype="bf16")
    [[s]] = engine.generate([[1, 2, 3]], n=1, sampling=SamplingParams(max_tokens=4))
    assert s.routed_experts is None and len(s.response_ids) == 4 and s.rollout_logprobs.dtype == torch.float32
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[1, 99]], n=1, sampling=SamplingParams())
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate([[1]], n=1, sampling=SamplingParams())


def test_fp32_lm_head_matches_the_trainers_fp32_head_kernel(moe_checkpoint):
    """precision.fp32_lm_head: a bf16 engine's log-probs come from an fp32 projection and softmax of
    its last hidden state; the trainer's kernel given the same bf16 hidden state and head weight, as
    the trainer passes them, gives the same numbers to fp32 rounding (and bitwise what it gives on
    inputs upcast first: its logits are fp32 either way). A bf16 head is 100x further off."""
    from megatron_rl.logprobs import token_logprobs_and_entropy

    hidden = []
    outs = {}
    for fp32_head in (True, False):
        engine = _engine(moe_checkpoint, dtype="bf16", fp32_lm_head=fp32_head)
        body = engine.model.model
        real = body.forward

        def capture(*args, _real=real, _keep=fp32_head, **kwargs):
            out = _real(*args, **kwargs)
            if _keep:
                hidden.append(out.last_hidden_state[:, -1])
            return out

        body.forward = capture
        outs[fp32_head] = engine.generate([[3, 4, 5, 6]], 1, SamplingParams(temperature=1.0, max_tokens=4, seed=1))
        weight = engine.model.get_output_embeddings().weight
    [[sample]] = outs[True]
    h = torch.cat(hidden[: len(sample.response_ids)])  # one decoding step per response token
    assert h.dtype == torch.bfloat16
    weight = weight.bfloat16()   # the model's head weight (the engine's fp32 copy is its exact upcast)
    kernel = token_logprobs_and_entropy(h, weight, sample.response_ids, compute_entropy=False)
    upcast = token_logprobs_and_entropy(h.float(), weight.float(), sample.response_ids, compute_entropy=False)
    assert torch.equal(kernel.logprobs, upcast.logprobs)
    torch.testing.assert_close(sample.rollout_logprobs, kernel.logprobs, rtol=0, atol=2e-6)
    [[bf16_head]] = outs[False]
    n = min(len(bf16_head.response_ids), len(sample.response_ids))
    if torch.equal(bf16_head.response_ids[:n], sample.response_ids[:n]):
        assert (bf16_head.rollout_logprobs[:n] - kernel.logprobs[:n]).abs().max() > 1e-4
