"""Actor: a rollout process with one generation engine.

Loop: ask the hub for work -> (join a weight sync | generate G responses per granted
prompt, score them, push one message per group | score a chunk of held-out prompts and
push the result (evaluation.py) | wait). New weights are applied
here, between generation batches, so every token of a batch has one version; with
`sync.in_flight=true` also between decode steps (`InFlight`), so a response may span
versions: each token records its own, the group's version is its oldest token's.
A heartbeat thread with its own socket keeps the actor alive in the registry while a
long batch runs, and ships the actor's timeline spans (generate, score, push,
wait-for-admission, sync; see tracing.py) to the hub with each heartbeat.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time

import numpy as np
import torch
import zmq

from async_rl.config import Config, from_yaml
from async_rl.actor.engines import make_engine
from async_rl.actor.engines.vllm_engine import VLLMConfigError
from async_rl.actor.rollout.episodes import Sampling
from async_rl.actor.rollout.runner import EpisodeRunner
from async_rl.run.tracing import SpanRecorder, WaitSpan, now_us, spans_to_arrays
from async_rl.coordinator.eval_rounds import score_prompts
from async_rl.tasks.prompt_format import stop_token_ids
from async_rl.tasks import PromptIndex
from async_rl.staleness import group_version
from async_rl.user_code import REASONS, RewardGuard
from async_rl.wire import (EvalGrant, EvalResult, ExperienceGroup, Goodbye, Heartbeat, Hello, Response, SyncDone,
                         SyncOrder, TraceSpans, Wait, Welcome, WireLimits, WorkGrant, WorkRequest, encode, send)
from async_rl.wire.curve import secure_client
from async_rl.actor.hub_client import ConnectError, HubClient, register
from async_rl.weight_transfer.errors import SyncAbandoned, describe
from async_rl.weight_transfer.receiver import WeightReceiver
from async_rl.weight_transfer.vllm.api import VLLMUnavailable
from async_rl.tasks.prompt_format import prompt_format_for
from async_rl.tasks import task_from_config
from async_rl.run.processes import peak_rss_mb
from async_rl.models.loading import quiet_libraries
from async_rl.device import resolve_device, collective_backend

log = logging.getLogger("async_rl.actor")


def _ship_spans(sock: zmq.Socket, actor_id: int, spans: SpanRecorder, *, flags: int = 0) -> None:
    """Send the oldest pending spans (at most one message's worth); spans that cannot
    be sent are counted as dropped, in the next message."""
    taken, dropped = spans.take(WireLimits().max_trace_spans)
    if not taken and not dropped:
        return
    names, start_us, dur_us, args = spans_to_arrays(taken)
    try:
        send(sock, TraceSpans(actor_id=actor_id, dropped=dropped, names=names, start_us=start_us, dur_us=dur_us,
                              args=args), flags=flags)
    except zmq.ZMQError:
        spans.count_lost(len(taken) + dropped)


def _heartbeat_loop(ctx: zmq.Context, hub_addr: str, keys_dir: str | None, state: dict, spans: SpanRecorder,
                    stop: threading.Event, every_s: float) -> None:
    client = HubClient(ctx, hub_addr, timeout_s=every_s * 5, keys_dir=keys_dir)
    try:
        while not stop.wait(every_s):
            try:
                send(client.sock, Heartbeat(actor_id=state["actor_id"], version=state["version"],
                                            generated_groups=state["generated"], peak_rss_mb=peak_rss_mb()))
            except zmq.Again:
                continue  # the hub is busy; the main loop notices a dead hub through its own timeouts
            _ship_spans(client.sock, state["actor_id"], spans)
    finally:
        client.close()


def run_actor(hub_addr: str, name: str | None = None, keys_dir: str | None = None,
              connect_timeout_s: float = 60.0) -> int:
    """`keys_dir`: the directory of `async-rl keys`, when the hub requires CURVE.
    `connect_timeout_s`: how long to keep trying a hub that does not answer."""
    ctx = zmq.Context()
    name = name or f"actor-{socket.gethostname()}-{os.getpid()}"
    try:
        hub, welcome = register(ctx, hub_addr, name, keys_dir, connect_timeout_s)
    except ConnectError as err:
        print(f"async-rl: actor {name}: {err}", file=sys.stderr, flush=True)
        ctx.destroy(linger=0)
        return 2
    cfg: Config = from_yaml(welcome.config_yaml)
    actor_id = welcome.actor_id
    state = {"actor_id": actor_id, "version": 0, "generated": 0, "epoch": -1}
    spans = SpanRecorder()  # pending until the heartbeat thread ships them
    waiting = WaitSpan(spans, "wait-for-admission")
    stop = threading.Event()
    # Beat from registration on: loading the model may take longer than
    # actors.heartbeat_timeout_s, and a silent newcomer would be reaped as dead.
    beat = threading.Thread(target=_heartbeat_loop, daemon=True,
                            args=(ctx, hub_addr, keys_dir, state, spans, stop, cfg.actors.heartbeat_s))
    beat.start()
    push = None
    try:
        quiet_libraries()
        torch.set_num_threads(cfg.actors.threads)
        hub.sock.setsockopt(zmq.RCVTIMEO, int(cfg.transport.timeout_s * 1000))
        device = resolve_device(cfg.model.device)
        prompt_format = prompt_format_for(cfg.model.path, cfg.task)
        stops = dict(eos_token_id=stop_token_ids(cfg.model.path, prompt_format.tokenizer))
        if cfg.actors.stop:
            stops.update(stop_strings=cfg.actors.stop, tokenizer=prompt_format.tokenizer)
        engine_cfg = cfg.actors.engine
        options = dict(seed=cfg.seed, threads=cfg.actors.threads, **engine_cfg.model_dump(exclude={"name"})) \
            if engine_cfg.name == "vllm" else {"dtype": getattr(torch, engine_cfg.dtype)}
        options["lora"] = cfg.model.lora if cfg.model.lora.rank else None
        try:
            engine = make_engine(engine_cfg.name, model_or_path=cfg.model.path, device=device, **stops, **options)
        except (VLLMUnavailable, VLLMConfigError) as err:  # the engine cannot run here: one line
            print(f"async-rl: actor {name}: {err}", file=sys.stderr, flush=True)
            return 2
        task = task_from_config(cfg.task, cfg.seed)
        reward = RewardGuard.for_task(task, cfg, logger=log)  # user code: failures are counted
        runner = EpisodeRunner(cfg, task, prompt_format) if cfg.env is not None else None  # multi-turn episodes
        prompts = PromptIndex(task)
        sync_args = dict(bucket_mb=cfg.sync.bucket_mb, backend=collective_backend(device), timeout_s=cfg.sync.timeout_s)
        make_receiver = getattr(engine, "weight_receiver", None)  # engines whose weights live elsewhere (vLLM)
        receiver = (make_receiver(**sync_args) if make_receiver is not None
                    else WeightReceiver(engine.parameters_for_sync(), staged=cfg.sync.stage_on_actors, **sync_args))
        push = ctx.socket(zmq.PUSH)
        if keys_dir:
            secure_client(push, keys_dir)
        push.setsockopt(zmq.LINGER, int(cfg.transport.timeout_s * 1000))
        push.setsockopt(zmq.SNDHWM, cfg.transport.hwm)  # learner stalls -> we block here, memory stays bounded
        push.setsockopt(zmq.SNDTIMEO, int(cfg.transport.timeout_s * 1000))
        push.connect(welcome.experience_addr)
        generator = torch.Generator(device=device).manual_seed(cfg.seed * 1000 + actor_id)
        syncer = Syncer(hub, receiver, engine, state, spans)
        if cfg.sync.in_flight:
            engine.step_hook = InFlight(syncer, timeout_s=cfg.transport.timeout_s, poll_s=cfg.sync.in_flight_poll_s)
        log.info("actor %d ready (%s) on %s", actor_id, name, device)
        while True:
            # Parameters left half-updated by a broken-off broadcast (unstaged receivers:
            # sync.stage_on_actors=false, vLLM) must not generate: ask for no prompts
            # (the hub answers Wait or SyncOrder) until a sync completes.
            wanted = cfg.actors.groups_per_request if receiver.intact else 0
            asked_us = now_us()
            try:
                reply = hub.request(WorkRequest(actor_id=actor_id, version=engine.version, max_groups=wanted))
            except TimeoutError:
                log.error("actor %d leaving: the hub did not answer for %.0fs", actor_id, cfg.transport.timeout_s)
                return 1
            if isinstance(reply, Wait):  # one wait-for-admission span until the hub grants or syncs
                waiting.waiting(since_us=asked_us)
                time.sleep(reply.seconds)
                continue
            waiting.done()
            if isinstance(reply, Goodbye) and reply.rejoin:
                actor_id = _register_again(hub, name, state)
                continue
            if isinstance(reply, Goodbye):
                log.info("actor %d leaving: %s", actor_id, reply.reason)
                return 0
            if isinstance(reply, SyncOrder):
                if not syncer.follow(reply):
                    time.sleep(0.05)
            elif isinstance(reply, EvalGrant):
                with spans.span("eval", groups=len(reply.prompt_ids)):
                    push.send_multipart(evaluate_chunk(engine, prompt_format, task, prompts, cfg, reply, actor_id,
                                                       generator, reward, runner), copy=False)
            elif isinstance(reply, WorkGrant):
                try:
                    messages = rollout(engine, prompt_format, task, prompts, cfg, reply, actor_id, generator, spans,
                                       reward, runner)
                except LeaveNow as leave:  # only from the in-flight hook, in the middle of generation
                    if leave.rejoin:  # the grant was re-issued when the hub removed us: drop the batch
                        actor_id = _register_again(hub, name, state)
                        continue
                    log.log(logging.INFO if leave.code == 0 else logging.ERROR, "actor %d leaving: %s", actor_id,
                            leave.why)
                    return leave.code
                with spans.span("push", groups=len(messages)):
                    for msg in messages:
                        push.send_multipart(msg, copy=False)
                        state["generated"] += 1
    finally:
        # The heartbeat thread stops first, so that nothing of ours reaches the hub after
        # the goodbye (it would count as a message from an unknown actor).
        stop.set()
        beat.join(timeout=5)
        while len(spans):  # best effort, like the goodbye: the spans since the last heartbeat
            _ship_spans(hub.sock, actor_id, spans, flags=zmq.NOBLOCK)
        try:  # best effort: the hub re-issues our prompts now instead of after the heartbeat timeout
            send(hub.sock, Goodbye(reason="leaving", actor_id=actor_id), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        if push is not None:
            push.close()
        hub.close(linger_ms=1000)  # lets the goodbye out
        ctx.term()


def _register_again(hub: HubClient, name: str, state: dict) -> int:
    """The hub removed us (silent past actors.heartbeat_timeout_s, e.g. a stopped process,
    or its connection to us closed) and re-issued our grants: register again, keeping
    the weights we hold (the next sync brings them up to date). Returns the new id."""
    welcome = hub.request(Hello(actor_name=name, pid=os.getpid(), host=socket.gethostname()))
    if not isinstance(welcome, Welcome):
        raise RuntimeError(f"the hub refused registration: {welcome}")
    log.warning("actor %d was removed by the hub; registered again as actor %d", state["actor_id"],
                welcome.actor_id)
    state["actor_id"] = welcome.actor_id
    return welcome.actor_id


class Syncer:
    """Carries out the hub's sync orders and remembers the last epoch whose broadcast
    broke off here (rank 0 fails or abandons that epoch too, so joining it again would
    only wait for a group that never forms)."""

    def __init__(self, hub: HubClient, receiver: WeightReceiver, engine, state: dict, spans: SpanRecorder):
        self.hub, self.receiver, self.engine, self.state, self.spans = hub, receiver, engine, state, spans
        self.failed_epoch = -1
        self.completed = 0  # syncs completed

    def follow(self, order: SyncOrder) -> bool:
        """Join the broadcast `order` names; False if the epoch had already failed here
        (the hub has not seen it yet), without trying again."""
        if order.epoch <= self.failed_epoch:
            return False
        if _sync(self.hub, self.receiver, self.engine, order, self.state, self.spans):
            self.completed += 1
        else:
            self.failed_epoch = order.epoch
        return True


class LeaveNow(Exception):
    """From the in-flight hook, out of the middle of generation: the hub said goodbye
    (exit code 0) or stopped answering (1)."""

    def __init__(self, code: int, why: str, rejoin: bool = False):
        super().__init__(why)
        self.code, self.why, self.rejoin = code, why, rejoin


class InFlight:
    """The engine's step hook with sync.in_flight: between two decode steps, at most every
    `poll_s`, ask the hub for no prompts (`WorkRequest(max_groups=0)`; the hub answers a
    request during an outstanding grant like any other: `SyncOrder` or `Wait`) and join a
    waiting broadcast at once, so unfinished responses continue on the new weights.

    A broadcast that breaks off half-way leaves a staged receiver (sync.stage_on_actors)
    on its last complete weights, and decoding goes on with them. An unstaged one is
    left half-updated (`receiver.intact` False): no further token may come from it. The
    generation then waits here, asking the hub like the main loop does, until a
    broadcast completes, and continues on complete weights. Its tokens so far came from
    intact weights before the sync began, so nothing is discarded, and the grant stays
    this actor's: no prompt is lost or generated twice, and if the actor dies meanwhile
    the hub re-issues it. Every member of the broken group is in the same state, so
    handing the prompts back would not get them generated any sooner.
    """

    def __init__(self, syncer: Syncer, *, timeout_s: float, poll_s: float):
        self.syncer, self.timeout_s, self.poll_s = syncer, timeout_s, poll_s
        self.updates = 0  # in-flight syncs completed (weights changed mid-generation)
        self._next_poll = 0.0

    def __call__(self) -> None:
        if time.monotonic() < self._next_poll:
            return
        s = self.syncer
        while True:
            try:
                reply = s.hub.request(WorkRequest(actor_id=s.state["actor_id"], version=s.engine.version, max_groups=0))
            except TimeoutError:
                raise LeaveNow(1, f"the hub did not answer for {self.timeout_s:.0f}s") from None
            if isinstance(reply, Goodbye):
                raise LeaveNow(0, reply.reason, rejoin=reply.rejoin)
            if isinstance(reply, SyncOrder):
                completed = s.completed
                s.follow(reply)
                self.updates += s.completed - completed
            if s.receiver.intact:  # old or new weights, but one whole version: decode on
                break
            time.sleep(reply.seconds if isinstance(reply, Wait) else 0.05)
        self._next_poll = time.monotonic() + self.poll_s


def _sync(hub: HubClient, receiver: WeightReceiver, engine, order: SyncOrder, state: dict,
          spans: SpanRecorder) -> bool:
    """Take part in the broadcast `order` names. A broadcast that breaks off (a peer
    killed, a timeout, rank 0 abandoning the epoch) costs one log line, not the actor."""
    actor_id = state["actor_id"]
    try:
        with spans.span("sync", version=order.version):
            receiver.receive(epoch=order.epoch, rank=order.rank, world_size=order.world_size,
                             store_host=order.store_host, store_port=order.store_port)
    except Exception as err:
        level = logging.INFO if isinstance(err, SyncAbandoned) else logging.WARNING
        log.log(level, "actor %d: weight sync of version %d (epoch %d) failed (%s); %s", actor_id, order.version,
                order.epoch, describe(err),
                "weights unchanged" if receiver.intact else "weights half-updated, generating nothing until a sync")
        return False
    engine.set_version(order.version)
    state["version"] = order.version
    send(hub.sock, SyncDone(actor_id=actor_id, epoch=order.epoch, version=order.version))
    # Once per membership epoch at INFO: joins and recoveries show in the log, routine syncs do not.
    level = logging.INFO if order.epoch != state["epoch"] else logging.DEBUG
    state["epoch"] = order.epoch
    log.log(level, "actor %d synced to version %d (epoch %d, %s)", actor_id, order.version, order.epoch,
            receiver.transport)
    return True


def evaluate_chunk(engine, prompt_format, task, prompts: PromptIndex, cfg: Config, grant: EvalGrant, actor_id: int,
                   generator, reward: RewardGuard | None = None, runner: EpisodeRunner | None = None) -> list:
    """Score one chunk of held-out prompts; the encoded EvalResult. In-flight weight
    updates are off meanwhile: every score of a round comes from the version it names.
    `reward`: the actor's guard around task.reward (default: a new one from cfg.reward);
    `runner`: score episodes (env.name) instead of single responses."""
    e = cfg.eval
    reward = reward if reward is not None else RewardGuard.for_task(task, cfg, logger=log)
    reward.take_counts()  # only this chunk's failures go into its result
    hook, engine.step_hook = getattr(engine, "step_hook", None), None
    threads = torch.get_num_threads()
    torch.set_num_threads(e.threads or threads)
    try:
        chunk = [prompts[i] for i in grant.prompt_ids]
        if runner is not None:
            sampling = Sampling(e.temperature or 1.0, greedy=e.temperature == 0.0)
            rewards, lengths, truncated, env_errors = runner.scores(engine, chunk, e.pass_k, sampling, generator)
        else:
            rewards, lengths, truncated = score_prompts(
                engine, prompt_format, task, chunk, samples=e.pass_k,
                max_new_tokens=e.max_new_tokens or cfg.actors.max_new_tokens, temperature=e.temperature,
                generator=generator, reward=reward)
            env_errors = [0] * len(REASONS)
    finally:
        engine.step_hook = hook
        torch.set_num_threads(threads)
    return encode(EvalResult(actor_id=actor_id, round=grant.round, version=grant.version,
                             prompt_ids=list(grant.prompt_ids), rewards=rewards, response_lengths=lengths,
                             truncated=truncated,
                             reward_errors=[a + b for a, b in zip(reward.take_counts(), env_errors)]))


def rollout(engine, prompt_format, task, prompts: PromptIndex, cfg: Config, grant: WorkGrant, actor_id: int,
            generator, spans: SpanRecorder | None = None, reward: RewardGuard | None = None,
            runner: EpisodeRunner | None = None) -> list:
    """Generate, score and encode one ExperienceGroup per granted prompt; `spans` gets
    the generate and score spans. `reward`: the actor's guard around task.reward
    (default: a new one from cfg.reward); each group carries its own failure counts.
    `runner`: multi-turn episodes (env.name) instead of single responses."""
    spans = spans if spans is not None else SpanRecorder(enabled=False)
    if runner is not None:
        granted = [prompts[i] for i in grant.prompt_ids]
        with spans.span("generate", groups=len(granted)):
            groups = runner.experience(engine, granted, grant, actor_id, cfg.train.group_size,
                                       Sampling(cfg.actors.temperature, cfg.actors.top_p), generator)
        return [encode(g) for g in groups]
    reward = reward if reward is not None else RewardGuard.for_task(task, cfg, logger=log)
    reward.take_counts()  # only this grant's failures go into its groups
    G = cfg.train.group_size
    granted = [prompts[i] for i in grant.prompt_ids]
    prompt_tokens = [prompt_format.encode(p) for p in granted]
    started = time.monotonic()
    with spans.span("generate", groups=len(granted)) as span_args:
        completions = engine.generate(prompt_tokens, n=G, max_new_tokens=cfg.actors.max_new_tokens,
                                      temperature=cfg.actors.temperature, top_p=cfg.actors.top_p, generator=generator)
        greedy_rewards: list[float | None] = [None] * len(granted)
        errors = [[0] * len(REASONS) for _ in granted]  # per group: its samples' and its baseline's failures
        if cfg.train.advantage.name == "remax":
            # ReMax's baseline: one greedy response per prompt from the same weights.
            greedy = engine.generate(prompt_tokens, n=1, max_new_tokens=cfg.actors.max_new_tokens, greedy=True)
            for k, (p, g) in enumerate(zip(granted, greedy)):
                greedy_rewards[k] = reward(p.text, prompt_format.response_text(g[0].tokens.tolist()), p.answer)
                errors[k] = reward.take_counts()
        span_args["tokens"] = sum(len(c.tokens) for samples in completions for c in samples)
    gen_seconds = (time.monotonic() - started) / max(1, len(granted))
    with spans.span("score", groups=len(completions)):
        rewards_of = []
        for k, (p, samples) in enumerate(zip(granted, completions)):
            rewards_of.append(np.array([reward(p.text, prompt_format.response_text(c.tokens.tolist()), p.answer)
                                        for c in samples], dtype=np.float32))
            errors[k] = [a + b for a, b in zip(errors[k], reward.take_counts())]
    out = []
    for k, samples in enumerate(completions):
        responses = [Response(c.tokens.numpy(), c.logprobs.numpy(), c.versions.numpy()) for c in samples]
        out.append(encode(ExperienceGroup.from_responses(
            responses, actor_id=actor_id, group=grant.groups[k], prompt_id=grant.prompt_ids[k],
            version=group_version(np.concatenate([r.versions for r in responses]), default=engine.version),
            prompt_tokens=np.asarray(prompt_tokens[k], dtype=np.int32), rewards=rewards_of[k],
            truncated=np.array([not c.finished for c in samples], dtype=np.uint8),
            gen_seconds=gen_seconds, greedy_reward=greedy_rewards[k], reward_errors=errors[k])))
    return out
