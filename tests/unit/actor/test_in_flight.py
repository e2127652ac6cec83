"""In-flight weight updates (sync.in_flight=true): new weights land between decode steps,
unfinished responses continue on them, every token records the version that produced it
and a sample's staleness counts from its oldest token.

Two levels: the engine's step hook on a tiny model (what the tokens and log-probs
are after a switch) and the actor's hook against a scripted hub (orders, a broken-off
broadcast, goodbye). (A real run: tests/integration/test_in_flight_run.py.)"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import transformers
from conftest import running_coordinator

from async_rl.actor.engines.torch_engine import TorchEngine
from async_rl.actor.sync import InFlight, LeaveNow, Syncer
from async_rl.run.metrics import version_mix
from async_rl.run.tracing import SpanRecorder
from async_rl.weight_transfer.errors import WeightMismatch
from async_rl.wire import (
    ExperienceGroup,
    Goodbye,
    Hello,
    RejectCounter,
    SyncDone,
    SyncOrder,
    Wait,
    WeightsRejected,
    WireLimits,
    WorkGrant,
    WorkRequest,
    decode,
    encode,
    recv,
    send,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]]  # ragged: rows are left-padded
V = 16  # vocabulary
T = 8  # new tokens per response


def tiny_llama(seed: int) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=64, max_position_embeddings=64, tie_word_embeddings=True,
        initializer_range=0.5,  # peaked next-token distributions: greedy is not decided by float noise
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return transformers.LlamaForCausalLM(config).eval()


def new_engine(seed: int = 0, dtype: torch.dtype = torch.float32) -> TorchEngine:
    return TorchEngine(tiny_llama(seed), eos_token_id=None, dtype=dtype)


def uniform_weights(engine: TorchEngine) -> None:
    """Load weights whose output is known exactly: a zero final norm makes every logit 0,
    so each token's log-prob is -log V and greedy picks token 0, whatever the context."""
    with torch.no_grad():
        engine.model.model.norm.weight.zero_()


def switch_at(engine: TorchEngine, step: int, load) -> list[int]:
    """A step hook that loads new weights and bumps the version before decode step `step`."""
    calls: list[int] = []

    def hook() -> None:
        calls.append(len(calls) + 1)  # the hook runs before steps 1, 2, ...
        if len(calls) == step:
            load(engine)
            engine.set_version(engine.version + 1)

    engine.step_hook = hook
    return calls


# --------------------------------------------------------------------- the engine


def test_switch_between_decode_steps_shows_per_token_versions() -> None:
    engine, s = new_engine(), 3
    engine.set_version(4)
    before = engine.generate(PROMPTS, n=2, max_new_tokens=T, temperature=1.3,
                             generator=torch.Generator().manual_seed(7))
    calls = switch_at(engine, s, uniform_weights)
    out = engine.generate(PROMPTS, n=2, max_new_tokens=T, temperature=1.3, generator=torch.Generator().manual_seed(7))
    assert calls == list(range(1, T))  # between every two decode steps, never before the first
    assert engine.version == 5
    for old_group, group in zip(before, out):
        for old, c in zip(old_group, group):
            # Two versions in one response; the oldest (the first token's) is the granted one.
            assert c.versions.tolist() == [4] * s + [5] * (T - s)
            # Up to the switch, the same draws from the same weights as without one.
            assert torch.equal(c.tokens[:s], old.tokens[:s])
            torch.testing.assert_close(c.logprobs[:s], old.logprobs[:s])
            # After it, log-probs are those of the new weights (uniform, whatever the
            # temperature); the old weights are far from uniform.
            torch.testing.assert_close(c.logprobs[s:], torch.full((T - s,), -math.log(V)))
            assert (old.logprobs[s:] - (-math.log(V))).abs().max() > 0.1
    # Greedy makes "sampled from the new weights" exact: argmax of all-zero logits is 0.
    engine2 = new_engine()
    ref = engine2.generate(PROMPTS, max_new_tokens=T, greedy=True)
    switch_at(engine2, s, uniform_weights)
    for old, c in zip(ref, engine2.generate(PROMPTS, max_new_tokens=T, greedy=True)):
        assert c[0].tokens[:s].tolist() == old[0].tokens[:s].tolist()
        assert c[0].tokens[s:].tolist() == [0] * (T - s)


def test_unfinished_responses_keep_their_kv_cache() -> None:
    """After a switch the engine continues from the cache the old weights filled (as
    PipelineRL does); it does not recompute the prefix with the new weights."""
    from transformers import DynamicCache

    # float64, where the engine's cached forwards and the reference's differ by ~1e-16 (in
    # float32, by what the CPU's kernels make of their different shapes). Both take the
    # softmax of float32 logits, and transformers' RMSNorm computes in float32: a rounding
    # may land on either side, a few float32 epsilons of the logits' scale.
    old_model, new_model = tiny_llama(0).double(), tiny_llama(1).double()
    engine, s, prompt = new_engine(0, torch.float64), 4, [3, 1, 4, 1, 5]

    def load(e: TorchEngine) -> None:
        with torch.no_grad():
            for p, q in zip(e.model.parameters(), new_model.parameters()):
                p.copy_(q)

    switch_at(engine, s, load)
    c = engine.generate([prompt], max_new_tokens=T, greedy=True)[0][0]
    toks = c.tokens.tolist()
    assert c.versions.tolist() == [0] * s + [1] * (T - s)
    with torch.no_grad():
        # Reference: the old weights fill the cache up to token s-2, the new ones go on from there.
        cache = {engine._cache_arg: DynamicCache(config=old_model.config)}  # the engine's argument name
        logits = old_model(input_ids=torch.tensor([prompt + toks[:s - 1]]), **cache, use_cache=True).logits[0, -1]
        kept, scale = [], 0.0
        for t in range(s, T):
            logits = new_model(input_ids=torch.tensor([[toks[t - 1]]]), **cache, use_cache=True).logits[0, -1]
            assert int(logits.argmax()) == toks[t]  # sampled (greedily) from the new weights
            kept.append(torch.log_softmax(logits.float(), -1)[toks[t]])
            scale = max(scale, float(logits.abs().max()))
        bound = 16 * torch.finfo(torch.float32).eps * scale
        assert float((c.logprobs[s:] - torch.stack(kept)).abs().max()) <= bound
        # A full recompute under the new weights would have given other log-probs.
        full = new_model(input_ids=torch.tensor([prompt + toks])).logits[0].float()
        recomputed = torch.log_softmax(full[len(prompt) - 1:-1], -1).gather(-1, c.tokens[:, None])[:, 0]
        assert (recomputed[s:] - c.logprobs[s:]).abs().max() > 1e-3


def test_oldest_token_is_the_sample_version_and_learner_metrics() -> None:
    """What the actor makes of such responses (group version = oldest token, checked by
    the wire) and what the learner logs about them."""
    tv = np.array([2, 2, 3, 3] + [2, 2, 2] + [3, 3, 3, 3], dtype=np.int32)  # three responses, end to end
    lengths = np.array([4, 3, 4], dtype=np.int32)

    def group(version: int) -> ExperienceGroup:
        return ExperienceGroup(actor_id=0, group=0, prompt_id=0, version=version,
                               prompt_tokens=np.array([1, 2], np.int32), response_tokens=np.ones(11, np.int32),
                               response_lengths=lengths, logprobs=np.full(11, -0.5, np.float32),
                               token_versions=tv, rewards=np.zeros(3, np.float32), truncated=np.zeros(3, np.uint8),
                               gen_seconds=0.1)

    assert decode(encode(group(2)), WireLimits()).version == 2
    for wrong in (3, 9):  # the newest token's, or one no token has: refused
        with pytest.raises(Exception, match="version_mismatch"):
            decode(encode(group(wrong)), WireLimits())
    mix = version_mix([group(2)], learner_version=4)
    assert mix["actors/mixed_version_frac"] == pytest.approx(1 / 3)
    # Token staleness 2,2,1,1 | 2,2,2 | 1,1,1,1: per sample 1.5, 2, 1 -> 1.5. The samples'
    # staleness (from the group's oldest token) is 2.
    assert mix["actors/token_staleness_mean"] == pytest.approx(1.5)


# ------------------------------------------------------------ the actor's step hook


class ScriptedHub:
    """Stands in for the actor's HubClient: answers requests from a script (then Wait),
    records what the actor sent, SyncDone included."""

    def __init__(self, *replies) -> None:
        self.replies = list(replies)
        self.requests: list[WorkRequest] = []
        self.sent: list = []
        self.sock = self  # `send(hub.sock, SyncDone)` lands in send_multipart

    def request(self, msg):
        self.requests.append(msg)
        reply = self.replies.pop(0) if self.replies else Wait(seconds=0.0)
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def send_multipart(self, frames, flags=0, copy=True) -> None:
        self.sent.append(decode([bytes(f) for f in frames], WireLimits()))


class ScriptedReceiver:
    """Stands in for ParameterReceiver: each receive() runs the next action on the engine."""

    transport = "scripted"
    broken = None

    def __init__(self, engine: TorchEngine, *actions) -> None:
        self.engine, self.actions, self.intact, self.epochs = engine, list(actions), True, []

    def receive(self, *, epoch, rank, world_size, store_host, store_port, version=None) -> None:
        self.epochs.append(epoch)
        self.actions.pop(0)(self)


def complete(receiver: ScriptedReceiver) -> None:
    uniform_weights(receiver.engine)
    receiver.intact = True


def break_off(receiver: ScriptedReceiver) -> None:
    """Half the buckets arrived: garbage in the parameters, then the peer is gone."""
    with torch.no_grad():
        receiver.engine.model.model.norm.weight.fill_(float("nan"))
    receiver.intact = False
    raise RuntimeError("Connection closed by peer")


def order(epoch: int, version: int) -> SyncOrder:
    return SyncOrder(epoch=epoch, rank=1, world_size=2, store_host="127.0.0.1", store_port=1, version=version)


def hooked(hub: ScriptedHub, *actions) -> tuple[TorchEngine, ScriptedReceiver, InFlight]:
    engine = new_engine()
    receiver = ScriptedReceiver(engine, *actions)
    state = {"actor_id": 3, "version": 0, "generated": 0, "epoch": -1}
    hook = InFlight(Syncer(hub, receiver, engine, state, SpanRecorder(enabled=False)), timeout_s=1.0, poll_s=0.0)
    engine.step_hook = hook
    return engine, receiver, hook


def test_actor_hook_applies_a_sync_order_mid_generation() -> None:
    hub = ScriptedHub(Wait(seconds=0.02), order(epoch=1, version=1))
    engine, receiver, hook = hooked(hub, complete)
    out = engine.generate(PROMPTS, n=2, max_new_tokens=T, generator=torch.Generator().manual_seed(0))
    assert hook.updates == 1 and receiver.epochs == [1] and engine.version == 1
    for c in (c for group in out for c in group):
        assert c.versions.tolist() == [0, 0] + [1] * (T - 2)  # the order came with the 2nd poll, before step 2
        torch.testing.assert_close(c.logprobs[2:], torch.full((T - 2,), -math.log(V)))
    # The hub was asked for no prompts, with the version in use; it heard about the sync.
    assert all(r.max_groups == 0 and r.actor_id == 3 for r in hub.requests)
    assert [r.version for r in hub.requests] == [0, 0] + [1] * (T - 3)
    assert [type(m) for m in hub.sent] == [SyncDone] and hub.sent[0].version == 1


def test_broken_off_broadcast_waits_for_complete_weights_and_keeps_the_batch() -> None:
    # Epoch 1 breaks off half-way; the hub repeats it once (it has not noticed yet), then
    # waits, then orders the retry under epoch 2.
    hub = ScriptedHub(order(1, 1), order(1, 1), Wait(seconds=0.0), order(2, 1))
    engine, receiver, hook = hooked(hub, break_off, complete)
    out = engine.generate(PROMPTS, n=2, max_new_tokens=T, generator=torch.Generator().manual_seed(0))
    assert receiver.epochs == [1, 2] and hook.updates == 1 and receiver.intact
    # Every granted prompt came back whole; no token came from the half-updated weights.
    assert len(out) == len(PROMPTS) and all(len(c) == T for group in out for c in group)
    for c in (c for group in out for c in group):
        assert c.versions.tolist() == [0] + [1] * (T - 1)
        assert torch.isfinite(c.logprobs).all()
        torch.testing.assert_close(c.logprobs[1:], torch.full((T - 1,), -math.log(V)))
    # The first four requests happened before decode step 1, all with the old version.
    assert [r.version for r in hub.requests[:4]] == [0, 0, 0, 0]


def test_a_failed_sync_with_intact_weights_just_decodes_on() -> None:
    def abandoned(receiver: ScriptedReceiver) -> None:
        raise RuntimeError("rank 0 abandoned epoch 1")  # nothing written: still intact

    hub = ScriptedHub(order(1, 1))
    engine, receiver, hook = hooked(hub, abandoned)
    out = engine.generate(PROMPTS, max_new_tokens=T, greedy=True)
    assert hook.updates == 0 and engine.version == 0 and len(hub.requests) == T - 1
    assert all(c.versions.tolist() == [0] * T for group in out for c in group)


@pytest.mark.parametrize("reply, code", [(Goodbye(reason="run finished"), 0), (TimeoutError(), 1)])
def test_hub_goodbye_or_silence_leaves_from_mid_generation(reply, code) -> None:
    engine, _, _ = hooked(ScriptedHub(Wait(seconds=0.0), reply))
    with pytest.raises(LeaveNow) as left:
        engine.generate(PROMPTS, max_new_tokens=T, greedy=True)
    assert left.value.code == code


def test_polls_are_rate_limited() -> None:
    hub = ScriptedHub()
    engine, _, hook = hooked(hub)
    hook.poll_s = 3600.0
    engine.generate(PROMPTS, max_new_tokens=T, greedy=True)
    engine.generate(PROMPTS, max_new_tokens=T, greedy=True)
    assert len(hub.requests) == 1  # the first step hook polls, then not for an hour


# ------------------------------------------------------------------------ the hub


def test_hub_answers_polls_during_a_grant_and_takes_mixed_version_groups(tmp_path) -> None:
    import zmq

    G = 2
    with running_coordinator(tmp_path, {"max_staleness": 2, "train": {"batch_groups": 2, "group_size": G}}) as (
            coord, ctx, task):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVTIMEO, 30_000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(coord.hub_addr)

        def ask(msg):
            send(sock, msg)
            return recv(sock, WireLimits(), RejectCounter(), routed=False)[1]

        actor_id = ask(Hello(actor_name="t", pid=1, host="h")).actor_id
        grant = ask(WorkRequest(actor_id=actor_id, version=0, max_groups=1))
        assert isinstance(grant, WorkGrant) and grant.groups == [0]
        # Polls between decode steps: no prompts, and the grant stays outstanding.
        assert isinstance(ask(WorkRequest(actor_id=actor_id, version=0, max_groups=0)), Wait)
        assert coord.granted[0].actor_id == actor_id and coord.admission.admitted == 1
        coord.advance(2)  # the learner moved on while the response was being generated
        tv = np.array([0, 1, 2] + [0, 0, 2], dtype=np.int32)  # two responses of 3 tokens
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 1000)
        push.connect(coord.experience_addr)
        send(push, ExperienceGroup(
            actor_id=actor_id, group=0, prompt_id=grant.prompt_ids[0], version=0,
            prompt_tokens=np.array([1, 5], np.int32), response_tokens=np.full(G * 3, 4, np.int32),
            response_lengths=np.array([3, 3], np.int32), logprobs=np.full(G * 3, -0.5, np.float32),
            token_versions=tv, rewards=np.array([1.0, 0.0], np.float32), truncated=np.zeros(G, np.uint8),
            gen_seconds=0.1))
        taken = coord.take(1, version=2, timeout=30)
        push.close(0)
        sock.close(0)
    # Stored under its oldest token's version: staleness 2 - 0 = 2 = max_staleness.
    assert taken is not None and taken.versions == [0] and coord.rejects.total == 0


# ----------------------------------------------------------------- a real run


def reject(receiver: ScriptedReceiver) -> None:
    """Every bucket arrived, but not as rank 0 sent it: nothing copied (staged)."""
    raise WeightMismatch("version 1 did not arrive as sent: w (bucket 0, bytes 0-8) differs")


def test_refused_weights_are_reported_and_three_refusals_in_a_row_make_the_actor_leave() -> None:
    hub = ScriptedHub()
    engine = new_engine()
    receiver = ScriptedReceiver(engine, reject, complete, reject, reject, reject)
    syncer = Syncer(hub, receiver, engine, {"actor_id": 3, "version": 0, "generated": 0, "epoch": -1},
                    SpanRecorder(enabled=False))
    assert syncer.follow(order(1, 1)) and engine.version == 0  # refused: the version stays
    rejected = hub.sent[0]
    assert isinstance(rejected, WeightsRejected) and (rejected.actor_id, rejected.epoch, rejected.version) == (3, 1, 1)
    assert rejected.reason == "version 1 did not arrive as sent: w (bucket 0, bytes 0-8) differs"
    assert syncer.follow(order(2, 1)) and engine.version == 1 and syncer.rejected_in_a_row == 0
    syncer.follow(order(3, 2))
    syncer.follow(order(4, 2))
    with pytest.raises(LeaveNow) as leave:
        syncer.follow(order(5, 2))
    assert leave.value.code == 1 and "failed their check 3 syncs in a row" in leave.value.why
    assert [type(m) for m in hub.sent] == [WeightsRejected, SyncDone, WeightsRejected, WeightsRejected,
                                          WeightsRejected]


def test_a_receiver_that_can_receive_no_more_makes_the_actor_leave() -> None:
    def stuck(receiver: ScriptedReceiver) -> None:
        receiver.intact, receiver.broken = False, "a broadcast stays queued on its GPU stream"
        raise TimeoutError("the broadcast did not finish within 8s")

    engine = new_engine()
    syncer = Syncer(ScriptedHub(), ScriptedReceiver(engine, stuck), engine,
                    {"actor_id": 3, "version": 0, "generated": 0, "epoch": -1}, SpanRecorder(enabled=False))
    with pytest.raises(LeaveNow) as leave:
        syncer.follow(order(1, 1))
    assert leave.value.code == 1 and "can no longer be updated: a broadcast stays queued" in leave.value.why
